"""The torch-native backend's route table: how a group's update runs, and how a step's grads are
checked before, chosen once when the plan is prepared (Note [route table])."""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["Check", "Form", "GroupFacts", "Route", "Working", "choose_check", "choose_route"]

# Note [route table]
# ~~~~~~~~~~~~~~~~~~
# A group's update on the torch-native backend takes one route, chosen when the group is
# prepared, so a step planned from the step cache decides nothing: ``choose_route`` reads
# ``GroupFacts`` (the update's torch form, the params' device and dtypes, the layouts) through one
# table of two columns, each the first row that holds:
#
#   what the form runs on                 when
#   the group's tensors                   no fp32 masters, no 16-bit params, grads of their
#                                         params' dtypes
#   fp32 working copies, by batch         a CPU, an elementwise update, layouts WorkingCopies
#                                         takes, not torch.optim's implementation (Note [working
#                                         copies by batch] in working_copies.py)
#   fp32 working copies, whole            otherwise; rounded back once (Note [param rounding])
#
#   the form                              when
#   torch.optim's implementation          the torch.optim backend (Note [torch.optim route])
#   torch's fused op                      the update's torch form is ``torch_update`` (Adam(W),
#                                         SGD, Adagrad): it skips on ``found_inf`` on device, and
#                                         takes ``grad_scale`` where the check left the grads
#                                         scaled (Note [unscale in the update on a CPU] in
#                                         routes.py)
#   the in-place form, skipped on host    ``torch_form_`` where a host read is free (a CPU, Note
#                                         [host skip]): the skip is read, then the form runs on
#                                         the lists by batches of elements (elementwise), or of
#                                         whole tensors (LAMB's, Note [batches of whole tensors])
#   the in-place form on clones           ``torch_form_`` elsewhere: sync-free (Note [one torch
#                                         form])
#
# The check of the step's grads before the updates follows the groups' routes and the step
# (``choose_check``; ``TorchCheck`` in routes.py runs it), the first row that holds:
#
#   the check                             when
#   by the grads' norm, left scaled       fp32 grads, a clipping step on the host, and every
#                                         group on torch's fused op taking grad_scale on its own
#                                         tensors (Note [unscale in the update on a CPU] in
#                                         routes.py)
#   unscaled in place                     fp32 grads (Note [overflow after unscaling])
#   by batches, left scaled               16-bit grads, a step that does not clip, every group on
#                                         copies by batch that unscale them where they copy them
#   unscaled into fp32 copies             otherwise (16-bit grads)
#
# What can move between a plan and a step it serves is the host-read switch
# (``decide_skips_on_device``); a prepared update or check whose switch moved chooses again.


class Working(enum.Enum):
    """What a route's form runs on."""

    TENSORS = "the group's tensors"
    COPIES_BY_BATCH = "fp32 working copies made by batch"
    WHOLE_COPIES = "fp32 working copies of whole tensors"


class Form(enum.Enum):
    """Which torch form a route runs, and how it skips an overflowed step."""

    TORCH_OPTIM = "torch.optim's implementation"
    FUSED_OP = "torch's fused op"
    IN_PLACE = "the in-place form, skipped on the host"
    ON_CLONES = "the in-place form on clones"


@dataclasses.dataclass(frozen=True)
class Route:
    """One group's route: its form, on what (Note [route table])."""

    working: Working
    form: Form


@dataclasses.dataclass(frozen=True)
class GroupFacts:
    """What decides a group's route (Note [route table]), read when it is prepared."""

    torch_optim: bool  # the torch.optim backend
    fused_op: bool  # the update's torch form is torch_update (torch's fused ops)
    host_reads: bool  # found_inf may be read on the host: a CPU (Note [host skip])
    on_tensors: bool  # no masters, no 16-bit params, grads of their params' dtypes
    copies_by_batch: bool  # a CPU, elementwise, layouts WorkingCopies takes (not torch.optim)


def choose_route(facts: GroupFacts) -> Route:
    """The route of Note [route table]."""
    working = (
        Working.TENSORS if facts.on_tensors
        else Working.COPIES_BY_BATCH if facts.copies_by_batch
        else Working.WHOLE_COPIES
    )
    form = (
        Form.TORCH_OPTIM if facts.torch_optim
        else Form.FUSED_OP if facts.fused_op
        else Form.IN_PLACE if facts.host_reads
        else Form.ON_CLONES
    )
    return Route(working, form)


class Check(enum.Enum):
    """How the grads of a step are checked before its updates (Note [route table])."""

    BY_NORM = "checked by their norm, left scaled for torch's fused op"
    UNSCALED_IN_PLACE = "unscaled in place"
    BY_BATCH = "checked by batches, left scaled for the copies by batch"
    INTO_FP32 = "unscaled into fp32 copies"


def choose_check(float32: bool, fused_op: bool, by_batch: bool, host_reads: bool,
                 clipping: bool) -> Check:
    """The check of Note [route table]: for fp32 (dense) grads or not; whether every group takes
    torch's fused op with ``grad_scale`` on its tensors (``fused_op``), or copies by batch that
    unscale 16-bit grads (``by_batch``)."""
    if float32:
        return Check.BY_NORM if clipping and fused_op and host_reads else Check.UNSCALED_IN_PLACE
    return Check.BY_BATCH if by_batch and not clipping else Check.INTO_FP32
