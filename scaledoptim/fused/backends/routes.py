"""The torch-native backend's routes: how a group's update runs, chosen once when the group is
prepared, from one table (Note [route table]), and the drivers of each route."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from functools import partial
from typing import cast

import torch
from torch import Tensor

from ...kernels import PLAIN_TENSOR_TYPES, ROUNDING_LISTS
from ...torch_ops import (
    HOST_READS,
    LOW_PRECISION,
    advance_steps_,
    copy_unless_skipped_,
    elementwise_batches,
    local_tensors,
    skip_on_host,
    stochastic_round_,
)
from ..update import Group, ScaledTorchUpdate, TensorLists, Update
from .working_copies import WorkingCopies

__all__ = [
    "Check",
    "Form",
    "GroupFacts",
    "Route",
    "TorchUpdate",
    "Working",
    "choose_check",
    "choose_route",
    "update_in_place_",
    "update_on_working_copies_",
]

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
#                                         scaled (Note [unscale in the update on a CPU])
#   the in-place form, skipped on host    ``torch_form_`` where a host read is free (a CPU, Note
#                                         [host skip]): the skip is read, then the form runs on
#                                         the lists by batches of elements (elementwise), or of
#                                         whole tensors (LAMB's, Note [batches of whole tensors])
#   the in-place form on clones           ``torch_form_`` elsewhere: sync-free (Note [one torch
#                                         form])
#
# The check of the step's grads before the updates follows the groups' routes and the step
# (``choose_check``; ``_TorchUnscale`` in torch_native.py runs it), the first row that holds:
#
#   the check                             when
#   by the grads' norm, left scaled       fp32 grads, a clipping step on the host, and every
#                                         group on torch's fused op taking grad_scale on its own
#                                         tensors (Note [unscale in the update on a CPU])
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

    def __str__(self) -> str:
        return f"{self.form.value} on {self.working.value}"


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


class TorchUpdate:
    """One group's update on its route (Note [route table])."""

    #: Whether this is torch.optim's implementation (the torch.optim backend's subclass).
    torch_optim = False

    def __init__(self, update: Update, group: Group, lists: TensorLists) -> None:
        self.update = update
        self.group = group
        params, grads, *state_lists, steps = lists
        masters: list[Tensor] = []
        seeds: list[Tensor] = []
        if update.kernel.lists[-3:-1] == ROUNDING_LISTS:  # See Note [param rounding]
            *state_lists, masters, seeds = state_lists
        # See Note [tensor subclasses] in torch_native.py: the subclass params the plan hands an
        # elementwise update as they are run on their local tensors.
        self.local = update.elementwise and any(type(p) not in PLAIN_TENSOR_TYPES for p in params)
        if self.local:
            params, grads, masters, seeds = map(local_tensors, (params, grads, masters, seeds))
            state_lists = [local_tensors(state) for state in state_lists]
        self.params, self.masters, self.seeds, self.steps = params, masters, seeds, steps
        self.state_lists = state_lists
        # The step cache keeps the dtypes and layouts as planned (Note [step cache]).
        on_tensors = not masters and all(
            p.dtype not in LOW_PRECISION and g.dtype == p.dtype for p, g in zip(params, grads)
        )
        self.facts = GroupFacts(
            torch_optim=self.torch_optim,
            fused_op=not update.torch_form_in_place,
            host_reads=bool(params) and HOST_READS.free(params[0].device),
            on_tensors=on_tensors,
            copies_by_batch=not on_tensors
            and not self.torch_optim  # its counters are kept its way
            and bool(params)
            and params[0].device.type == "cpu"
            and update.elementwise
            and WorkingCopies.fits(params, grads, masters, state_lists),
        )
        self.copies: WorkingCopies | None = None
        if self.facts.copies_by_batch:
            scaled_form = None  # where the update can unscale the grads in its own read
            if update.torch_update_takes_grad_scale:
                scaled_form = partial(cast(ScaledTorchUpdate, update).torch_update, group)
            self.copies = WorkingCopies(
                params, grads, masters, state_lists, seeds, steps, scaled_form
            )
        self._choose(self.facts)

    def _choose(self, facts: GroupFacts) -> None:
        self.facts = facts
        self.route = choose_route(facts)
        self._switch = HOST_READS.on_cpu
        # The route's functions, unbound: a bound method kept on the instance would be a
        # reference cycle, and the state it holds would outlive a load_state_dict until a
        # collection.
        self._run = _RUNS[self.route.working]
        self._form = _FORMS[self.route.form]

    def takes_grad_scale(self) -> bool:
        """Whether it can take grads still scaled (Note [unscale in the update on a CPU]):
        torch's fused op, taking a ``grad_scale``, on the group's own plain fp32 tensors."""
        return (
            self.route == Route(Working.TENSORS, Form.FUSED_OP)
            and self.update.torch_update_takes_grad_scale
            and not self.local
        )

    def __call__(
        self, found_inf: Tensor | None, inv_scale: Tensor | None, grads: list[Tensor]
    ) -> None:
        if HOST_READS.on_cpu != self._switch:  # See Note [route table]: the one fact that moves
            params = self.params
            host_reads = bool(params) and HOST_READS.free(params[0].device)
            self._choose(dataclasses.replace(self.facts, host_reads=host_reads))
        self._run(self, found_inf, inv_scale, local_tensors(grads) if self.local else grads)

    def repoint(self, pointers: list[int]) -> None:
        pass  # it holds no grads

    # ---------------------------------------------------------------- what the form runs on
    def _on_tensors(
        self, found_inf: Tensor | None, inv_scale: Tensor | None, grads: list[Tensor]
    ) -> None:
        lists = [self.params, grads, *self.state_lists, self.steps]
        if inv_scale is not None:  # grads left scaled for it: Note [unscale in the update on a CPU]
            scaled = cast(ScaledTorchUpdate, self.update)
            scaled.torch_update(self.group, lists, found_inf, grad_scale=inv_scale.reciprocal())
            return
        self._form(self, lists, found_inf)

    def _on_copies_by_batch(
        self, found_inf: Tensor | None, inv_scale: Tensor | None, grads: list[Tensor]
    ) -> None:
        # Grads left scaled by UnscaledCheck where inv_scale is set (Note [working copies by
        # batch]).
        assert self.copies is not None
        self.copies(partial(self._form, self), found_inf, grads, inv_scale, self.facts.host_reads)

    def _on_whole_copies(
        self, found_inf: Tensor | None, inv_scale: Tensor | None, grads: list[Tensor]
    ) -> None:
        params = self.params
        # See Note [param rounding]: with masters the update runs on them in place.
        work = self.masters or [p.float() if p.dtype in LOW_PRECISION else p for p in params]
        work_grads = [g if g.dtype == w.dtype else g.to(w.dtype) for g, w in zip(grads, work)]
        self._form(self, [work, work_grads, *self.state_lists, self.steps], found_inf)
        if self.seeds:  # the counters now count this step, as the kernels' `*step + 1`
            stochastic_round_(params, work, self.seeds, self.steps, on_host=self.facts.host_reads)
            return
        rounded = [(p, w) for p, w in zip(params, work) if p is not w]
        if not rounded:
            return
        # A differentiable step: autograd records copy_, not the foreach op.
        if torch.is_grad_enabled():
            for param, value in rounded:
                param.copy_(value)
        else:
            torch._foreach_copy_([p for p, _ in rounded], [w for _, w in rounded])

    # ---------------------------------------------------------------- the forms
    def _torch_optim_form(self, lists: TensorLists, found_inf: Tensor | None) -> None:
        self.update.torch_optim_update(self.group, lists, found_inf)

    def _fused_op(self, lists: TensorLists, found_inf: Tensor | None) -> None:
        self.update.torch_update(self.group, lists, found_inf)

    def _in_place(self, lists: TensorLists, found_inf: Tensor | None) -> None:
        if not lists[0]:
            return
        skip = skip_on_host(found_inf, host_reads=True)
        if skip:
            return
        if skip is None:  # a step autograd records: decided on device
            self._on_clones(lists, found_inf)
            return
        advance_steps_(lists[-1], None)  # the step is taken: the form reads the new count
        update_in_place_(self.update, self.group, lists, batched=True)

    def _on_clones(self, lists: TensorLists, found_inf: Tensor | None) -> None:
        if not lists[0]:
            return
        if found_inf is None and not torch.is_grad_enabled():  # taken: no clones needed
            advance_steps_(lists[-1], None)
            update_in_place_(self.update, self.group, lists, batched=False)
            return
        update_on_working_copies_(self.update, self.group, lists, found_inf)


_RUNS: dict[Working, Callable[[TorchUpdate, Tensor | None, Tensor | None, list[Tensor]], None]] = {
    Working.TENSORS: TorchUpdate._on_tensors,
    Working.COPIES_BY_BATCH: TorchUpdate._on_copies_by_batch,
    Working.WHOLE_COPIES: TorchUpdate._on_whole_copies,
}
_FORMS: dict[Form, Callable[[TorchUpdate, TensorLists, Tensor | None], None]] = {
    Form.TORCH_OPTIM: TorchUpdate._torch_optim_form,
    Form.FUSED_OP: TorchUpdate._fused_op,
    Form.IN_PLACE: TorchUpdate._in_place,
    Form.ON_CLONES: TorchUpdate._on_clones,
}


# Note [one torch form]
# ~~~~~~~~~~~~~~~~~~~~~
# RMSprop, Lion and LAMB have no torch op that takes found_inf, so each writes its torch math
# once, in place over lists and taken unconditionally (``Update.torch_form_``), and this module
# owns the two ways to skip it:
# * on the host (a CPU, Note [host skip] in torch_ops/skip.py): the skip is read, and a taken
#   step runs the form on the lists themselves, an elementwise update batch by batch
#   (``elementwise_batches``: the temporaries stay in the cache), LAMB (per-tensor and global
#   norms) over the whole lists, which its form runs by the backend's batches of whole tensors
#   (Note [batches of whole tensors] in tensor_batches.py);
# * on device (any device: a GPU, a differentiable step, ``decide_skips_on_device``): the counters
#   advance unless skipped, the form runs on working copies (clones) of what it writes, the
#   params and state lists, and they are copied back unless found_inf is set.
# Both run the same function over the same values, so they give the same bits by construction
# (tests/fused/test_host_skip.py checks it still). Adam(W), SGD and Adagrad call torch's fused
# ops, which take found_inf themselves: they keep their single form, ``Update.torch_update``.


def update_in_place_(update: Update, group: Group, lists: TensorLists, batched: bool) -> None:
    """``update.torch_form_`` on ``lists`` themselves (the step is taken; the counters already
    count it): by batches of about ``BATCH`` elements if ``batched`` and the update is
    elementwise (without the counters, which an elementwise form does not read), else over the
    whole lists: the same function as :func:`update_on_working_copies_` runs, so the same
    bits."""
    if not (batched and update.elementwise):
        update.torch_form_(group, lists)
        return
    for batch in elementwise_batches(lists[:-1]):
        update.torch_form_(group, [*batch, []])


def update_on_working_copies_(
    update: Update, group: Group, lists: TensorLists, found_inf: Tensor | None
) -> None:
    """``update.torch_form_`` on clones of the params and state lists (what it writes), copied
    back unless ``found_inf`` is set, and the counters advanced unless it is: all on device, no
    host read."""
    steps = lists[-1]
    advance_steps_(steps, found_inf)  # first: the form reads the new count (unused if skipped)
    # Not the grads (1), nor the kernels' per-chunk scratch, which the form leaves alone.
    scratch = update.kernel.per_chunk_lists
    written = [i for i in range(len(lists) - 1) if i != 1 and i not in scratch]
    work = list(lists)
    for i in written:
        work[i] = [t.clone() for t in lists[i]]
    update.torch_form_(group, work)
    for i in written:
        # See Note [tensor subclasses]: a DTensor's local shard is copied as a plain tensor.
        copy_unless_skipped_(local_tensors(lists[i]), local_tensors(work[i]), found_inf)
