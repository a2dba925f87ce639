"""The torch-native backend's drivers of an in-place torch form (``Update.torch_form_``): on the
lists after a host read of the skip, by batches of elements, or on clones copied back unless
skipped (Note [one torch form]); and for a form that reads norms over each whole tensor (LAMB's
trust ratio), batches of whole tensors and pieces of larger ones, with sums over the mesh (Note
[batches of whole tensors])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from ...torch_ops import (
    BATCH,
    MeshSums,
    advance_steps_,
    batches,
    copy_unless_skipped_,
    elementwise_batches,
    local_tensors,
    storage_flat,
)
from ..update import Group, TensorLists, Update

__all__ = [
    "KEPT_DIRECTION",
    "TensorwiseStep",
    "tensor_batches_",
    "update_in_place_",
    "update_on_working_copies_",
]

# Note [one torch form]
# ~~~~~~~~~~~~~~~~~~~~~
# RMSprop, Lion and LAMB have no torch op that takes found_inf, so each writes its torch math
# once, in place over lists and taken unconditionally (``Update.torch_form_``), and this module
# owns the two ways to skip it:
# * on the host (a CPU, Note [host skip] in torch_ops/skip.py): the skip is read, and a taken
#   step runs the form on the lists themselves, an elementwise update batch by batch
#   (``elementwise_batches``: the temporaries stay in the cache), LAMB (per-tensor and global
#   norms) over the whole lists, which its form runs by the backend's batches of whole tensors
#   (Note [batches of whole tensors]);
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


# Note [batches of whole tensors]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An update whose every tensor's step reads a norm over that whole tensor (LAMB: the trust ratio
# ||p|| / ||u|| of the param and its update direction u) cannot run by batches of elements as an
# elementwise form does. It states its math as a ``TensorwiseStep`` of three parts, and this
# driver runs them. On a CPU the tensors go by batches of about ``BATCH`` elements of whole
# tensors (``torch_ops.batches``) with the batch's temporaries (its directions) in the cache:
# ``first_`` (the state in place, the directions), the batch's norms, ``last_`` (the params). A
# tensor of more than ``BATCH`` elements is a batch of its own, run by pieces of ``BATCH``
# elements of its storage: ``first_`` per piece, with the squares of the piece's param and
# direction added up in float64 (a piece's share of the tensor's norm), then ``last_`` per piece
# with the whole tensor's norms; the pieces' directions are kept meanwhile up to
# ``KEPT_DIRECTION`` elements, or made again by ``direction`` (the same ops on the same state,
# so the same bits: a second sqrt pass costs less than writing and reading back a direction out
# of the cache). Elsewhere (a GPU: launches per batch would multiply a step's launches), and for
# DTensors, the lists go whole, in one batch. DTensors step their local shards, and their norms
# are summed over the mesh (Note [sums over the mesh] in torch_ops/sharded.py). Both drivers of
# an in-place form (the host's and the one on clones, Note [one torch form])
# reach this one through the update's ``torch_form_``: the same batches, so the same bits.

#: The largest tensor whose whole direction the CPU driver keeps while it computes its norm (8 MB
#: in float32); a larger one's direction is made again, piece by piece.
KEPT_DIRECTION = 1 << 21


class TensorwiseStep(Protocol):
    """One step of an update with norms over whole tensors, over ``lists`` = ``[params, grads,
    *state lists]`` sliced alike to a batch; ``run`` is the batch's slice of the params (of
    their per-param factors). Hyper-parameters are Python numbers or tensors on the params'
    device: no host read."""

    #: Whether :meth:`last_` reads the norms of the params and directions.
    needs_norms: bool

    def first_(self, lists: TensorLists, run: slice) -> list[Tensor]:
        """Updates the state of the batch in place; returns its directions (new tensors)."""
        ...

    def direction(self, lists: TensorLists, run: slice) -> list[Tensor]:
        """The directions again, from the state :meth:`first_` left (the same ops)."""
        ...

    def last_(self, params: list[Tensor], directions: list[Tensor], norms: Tensor | None,
              run: slice) -> None:
        """Updates the params; ``norms`` (``[2, n]``: each param's and its direction's 2-norm
        over the whole tensor), or ``None`` unless :attr:`needs_norms`."""
        ...


def tensor_batches_(step_of: Callable[[TensorLists], TensorwiseStep], lists: TensorLists) -> None:
    """The step ``step_of(local lists)`` makes over ``lists`` (``[params, grads, *state
    lists]``: DTensors as their local shards), by the batches of Note [batches of whole
    tensors]."""
    sums = MeshSums(lists[0])
    lists = [sums.local(tensors) for tensors in lists]
    step = step_of(lists)
    params = lists[0]
    by_batch = params[0].device.type == "cpu" and not sums.sharded
    for run in batches(params) if by_batch else [slice(None)]:
        batch = [tensors[run] for tensors in lists]
        if by_batch and len(batch[0]) == 1 and batch[0][0].numel() > BATCH:
            _by_pieces_(step, batch, run)
            continue
        directions = step.first_(batch, run)
        norms = None
        if step.needs_norms:
            norms = torch.stack(
                [torch.stack(torch._foreach_norm(ts)) for ts in (batch[0], directions)]
            )
            if sums.sharded:
                norms = sums.reduce_(norms.square()).sqrt()
        step.last_(batch[0], directions, norms, run)


def _by_pieces_(step: TensorwiseStep, lists: TensorLists, run: slice) -> None:
    """One tensor of more than ``BATCH`` elements (``lists`` of one tensor each), by pieces of
    ``BATCH`` elements of its storage (Note [batches of whole tensors])."""
    cut = zip(*(storage_flat(tensor).split(BATCH) for (tensor,) in lists))
    pieces = [[[piece] for piece in same_piece] for same_piece in cut]
    kept: list[list[Tensor]] = []
    squares = torch.zeros(2, dtype=torch.float64, device=lists[0][0].device)
    keep = lists[0][0].numel() <= KEPT_DIRECTION
    for piece in pieces:
        directions = step.first_(piece, run)
        if not step.needs_norms:
            step.last_(piece[0], directions, None, run)
            continue
        squares += torch.stack(torch._foreach_norm([piece[0][0], directions[0]])).double().square()
        if keep:
            kept.append(directions)
    if not step.needs_norms:
        return
    norms = squares.sqrt().view(2, 1)
    for i, piece in enumerate(pieces):
        directions = kept[i] if keep else step.direction(piece, run)
        step.last_(piece[0], directions, norms, run)
