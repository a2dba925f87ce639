"""fp32 working copies of 16-bit params a batch at a time, for the elementwise torch forms of
the torch-native backend (Note [working copies by batch])."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...kernels import is_dense
from ...torch_ops import (
    LOW_PRECISION,
    PackedSteps,
    Pieces,
    StochasticRounding,
    advance_steps_,
    skip_on_host,
    unscale_dense_,
)
from ..update import TensorLists

__all__ = ["UnscaledCheck", "WorkingCopies"]

# Note [working copies by batch]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The torch forms compute 16-bit params in fp32 (Note [param rounding] in cuda/). Made whole
# (``p.float()``, ``g.float()``), the working copies are fresh allocations of 4 bytes a param,
# page-faulted in at every step once they pass the allocator's cached sizes, each written to
# memory and read back: a bf16 AdamW step on a CPU cost 1.4-6.2x GradScaler + torch's fused
# AdamW on fp32 params, which move twice the bytes. An elementwise update (``Update.elementwise``)
# needs no whole tensor, so its group's tensors are cut into pieces of at most ``BATCH`` elements
# (a larger tensor into views of its storage, in storage order: ``torch_ops.Pieces``) and run in
# batches of about ``BATCH`` elements. Per batch: the params copied into one fp32 buffer (or the
# fp32 masters updated in place), 16-bit grads copied into another (and, when the unscale left
# them scaled, ``UnscaledCheck``, unscaled there; or, by a form that takes a ``grad_scale``,
# torch's fused Adam(W), SGD and Adagrad, where it reads them: one pass over the batch fewer,
# where the scale is a power of two read on the host, so dividing by it gives the bits of
# multiplying by ``inv_scale``), the torch form over the batch, then the batch
# rounded back: to nearest, or stochastically with each piece's tensor's key and its elements'
# indices in that tensor (``torch_ops.StochasticRounding``), so the bits are those of a
# whole-tensor rounding and of the kernels. The buffers (BATCH floats each, and the stochastic
# rounding's) are allocated once per plan and stay in cache from the copy to the rounding:
# allocated at each step, the rounding's 5 MB were fresh pages to fault in.
#
# The forms advance the counters they are given (once per call), and a cut tensor's pieces fall
# in several batches: so each piece gets its own copy of its tensor's counter (one op over all of
# them, before the batches), which the form reads and advances, and the state's counters are
# advanced once, as the form would, before the batches (the rounding's keys read them). A step
# skipped on the host (Note [host skip] in torch_ops/skip.py) changes nothing; skipped on device,
# each batch's form leaves its working copies as they were, which round back to the same bits
# (a value exactly representable in the param's dtype, or a master rounded with the same key).
# Other devices (a GPU's caching allocator hands out whole copies with no page faults, and a
# batch per BATCH elements would multiply a step's launches), LAMB (not elementwise), DTensor
# shards, torch.optim's implementations, layouts with gaps and working copies of float64 keep
# whole tensors.


def _same_layout(rows: Sequence[Sequence[Tensor]], like: Sequence[Tensor]) -> bool:
    return all(
        not row or all(t.stride() == p.stride() and t.shape == p.shape for t, p in zip(row, like))
        for row in rows
    )


class _Buffer:
    """An fp32 buffer for the largest batch of ``pieces``, and per batch, views of it with the
    layout of ``like`` (the pieces), one after the other from its start (``views``), and the
    1-D view of all of them (``flats``: an op over a batch's elements is one op there)."""

    def __init__(self, like: list[Tensor], pieces: Pieces) -> None:
        sizes = [sum(pieces.sizes[run]) for run in pieces.runs]
        buffer = torch.empty(max(sizes), dtype=torch.float32, device=like[0].device)
        self.flats = [buffer[:size] for size in sizes]
        self.views: list[list[Tensor]] = []
        for run in pieces.runs:
            offset, batch = 0, []
            for piece in like[run]:
                batch.append(buffer.as_strided(piece.shape, piece.stride(), offset))
                offset += piece.numel()
            self.views.append(batch)


class WorkingCopies:
    """A group's fp32 working copies, made a batch of about ``BATCH`` elements at a time.

    Args:
        params, grads, masters, state_lists, seeds, steps: the group's lists, as the plan gave
            them (``masters`` and ``seeds`` empty when the group keeps none).
        scaled_form: the update over grads still scaled by ``grad_scale``, as
            ``scaled_form(lists, found_inf, grad_scale=grad_scale)``, where it takes them so
            (``Update.torch_update_takes_grad_scale``); else ``None``.
    """

    def __init__(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        masters: list[Tensor],
        state_lists: TensorLists,
        seeds: list[Tensor],
        steps: list[Tensor],
        scaled_form: Callable[..., None] | None = None,
    ) -> None:
        self.pieces = pieces = Pieces(params)
        self.scaled_form = scaled_form
        self.params = pieces.cut(params)
        self.masters = pieces.cut(masters) if masters else None
        self.state_lists = [pieces.cut(state) for state in state_lists]
        self.seeds, self.steps = seeds, steps
        self.convert_grads = grads[0].dtype in LOW_PRECISION
        self.batch_size = max(sum(pieces.sizes[run]) for run in pieces.runs)
        # With masters, an fp32 param is its own master: only the others are rounded back.
        kept = {i for i, (p, m) in enumerate(zip(params, masters)) if p is m}
        self.rounded: list[tuple[list[Tensor], list[Tensor]]] = []
        if self.masters is not None:
            for run in pieces.runs:
                run_pieces = [j for j in range(run.start, run.stop) if pieces.owners[j] not in kept]
                self.rounded.append(
                    ([self.params[j] for j in run_pieces], [self.masters[j] for j in run_pieces])
                )
        self.work: _Buffer | None = None
        self.grad_buffer: _Buffer | None = None
        self.counters: Tensor | None = None
        self.batch_steps: list[PackedSteps] = []
        self.rounding: StochasticRounding | None = None

    @staticmethod
    def fits(
        params: list[Tensor],
        grads: list[Tensor],
        masters: list[Tensor],
        state_lists: TensorLists,
    ) -> bool:
        """Whether a group's lists can take working copies by batches: dense params, state,
        masters and grads of one layout; 16-bit params (or float32 masters); grads all 16-bit
        or all float32."""
        if not params or not all(map(is_dense, params)):
            return False
        if masters:
            if any(m.dtype != torch.float32 for m in masters):
                return False
        elif any(p.dtype not in LOW_PRECISION for p in params):
            return False
        if not (
            all(g.dtype in LOW_PRECISION for g in grads)
            or all(g.dtype == torch.float32 for g in grads)
        ):
            return False
        return all(g.layout == torch.strided for g in grads) and _same_layout(
            [grads, masters, *state_lists], params
        )

    def _allocate(self) -> None:
        """The buffers and the pieces' counters, at the first step (not for a plan never run)."""
        pieces = self.pieces
        if self.masters is None:
            self.work = _Buffer(self.params, pieces)
        if self.convert_grads:
            self.grad_buffer = _Buffer(self.params, pieces)
        step = self.steps[0]
        self.counters = torch.empty(len(pieces.sizes), dtype=step.dtype, device=step.device)
        self.batch_steps = [PackedSteps(self.counters[run]) for run in pieces.runs]
        if self.seeds:  # its keys remade at each step (rekey), its buffers kept
            self.rounding = StochasticRounding(
                self.seeds, self.steps, self.batch_size, pieces=pieces
            )

    def __call__(
        self,
        form: Callable[[TensorLists, Tensor | None], None],
        found_inf: Tensor | None,
        grads: list[Tensor],
        inv_scale: Tensor | None,
        host_reads: bool,
    ) -> None:
        """The step: ``form(lists, found_inf)`` over each batch's working lists (or
        ``scaled_form``, with their grads left scaled, where it unscales them in its own read).

        Args:
            grads: the group's grads, scaled by ``1 / inv_scale`` unless ``inv_scale`` is None.
            host_reads: whether ``found_inf`` may be read on the host (the engine's ``host_skip``).
        """
        skip = skip_on_host(found_inf, host_reads)
        if skip:
            return
        if skip is not None:
            found_inf = None  # known to be taken
        if self.counters is None:
            self._allocate()
            assert self.counters is not None
        pieces, steps = self.pieces, self.steps
        counters = steps.flat if isinstance(steps, PackedSteps) else torch.stack(steps)
        if pieces.owner_index is None:
            self.counters.copy_(counters)
        else:
            torch.index_select(counters, 0, pieces.owner_index, out=self.counters)
        advance_steps_(steps, found_inf)  # the rounding's keys read them
        sr = self.rounding
        if sr is not None:
            sr.rekey(self.seeds, steps, on_host=host_reads)
        grad_scale = None
        if self.grad_buffer is not None and self.scaled_form is not None and host_reads:
            grad_scale = _exact_reciprocal(inv_scale)
        grads = pieces.cut(grads)
        for b, run in enumerate(pieces.runs):
            params = self.params[run]
            if self.masters is None:
                assert self.work is not None
                work = self.work.views[b]
                torch._foreach_copy_(work, params)
            else:
                work = self.masters[run]
            batch_grads = grads[run]
            if self.grad_buffer is not None:
                torch._foreach_copy_(self.grad_buffer.views[b], batch_grads)
                batch_grads = self.grad_buffer.views[b]
                if inv_scale is not None and grad_scale is None:  # one op over the batch
                    self.grad_buffer.flats[b].mul_(inv_scale)
            elif inv_scale is not None:
                batch_grads = list(torch._foreach_mul(batch_grads, inv_scale))
            states = [state[run] for state in self.state_lists]
            lists = [work, batch_grads, *states, self.batch_steps[b]]
            if grad_scale is None:
                form(lists, found_inf)
            else:
                assert self.scaled_form is not None
                self.scaled_form(lists, found_inf, grad_scale=grad_scale)
            if sr is not None:
                assert self.work is not None
                sr.round_(params, work, run, self.work.flats[b])
            elif self.masters is None:
                torch._foreach_copy_(params, work)
            elif self.rounded[b][0]:
                torch._foreach_copy_(*self.rounded[b])


def _exact_reciprocal(inv_scale: Tensor | None) -> Tensor | None:
    """``1 / inv_scale`` where dividing a grad by it gives the bits of multiplying it by
    ``inv_scale``: a power of two whose reciprocal is a normal float32 (read on the host)."""
    if inv_scale is None:
        return None
    mantissa, exponent = math.frexp(inv_scale.item())
    return inv_scale.reciprocal() if mantissa == 0.5 and -125 <= exponent <= 127 else None


class UnscaledCheck:
    """``found_inf`` set where the unscaled 16-bit ``grads`` have an inf or nan, as
    ``unscale_in_place_`` of fp32 copies of them sets it, a batch at a time in one fp32 buffer;
    the grads are left as they are, for :class:`WorkingCopies` to unscale where it copies
    them."""

    def __init__(self, grads: list[Tensor]) -> None:
        self.pieces = Pieces(grads)
        self.buffer: _Buffer | None = None

    def __call__(
        self, grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor, host_reads: bool
    ) -> None:
        """Sets ``found_inf``; reads ``inv_scale`` on the host where ``host_reads``."""
        if not grads:
            return
        if host_reads and inv_scale.item() <= 1.0:
            # At a scale of at least 1, a finite grad unscales to a finite fp32 value (no
            # larger), and an inf or nan stays one: the 16-bit grads' own check is the same.
            one = torch.ones((), dtype=torch.float32, device=found_inf.device)
            by_dtype: dict[torch.dtype, list[Tensor]] = {}
            for grad in grads:
                by_dtype.setdefault(grad.dtype, []).append(grad)
            for same_dtype in by_dtype.values():  # (times one: the same values written back)
                torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found_inf, one)
            return
        pieces = self.pieces.cut(grads)
        if self.buffer is None:
            self.buffer = _Buffer(pieces, self.pieces)
        for run, views, flat in zip(self.pieces.runs, self.buffer.views, self.buffer.flats):
            torch._foreach_copy_(views, pieces[run])
            unscale_dense_([flat], found_inf, inv_scale)  # one tensor: no op per grad
