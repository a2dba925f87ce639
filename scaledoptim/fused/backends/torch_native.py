"""The torch-native backend: each optimizer's torch form, sync-free on any device: its
``Update.torch_update`` over torch's fused ops, or its ``Update.torch_form_`` through one of the
two drivers here (on a CPU, the skip read on the host; or working copies copied back unless
skipped).

torch's ``_fused_adam(w)_`` / ``_fused_sgd_`` read ``found_inf`` on device and skip the whole
update when it is 1.0 (Note [found_inf contract] in cuda/common.cuh), but they need params,
grads and state of one dtype and they do not advance step counters. So this backend runs 16-bit
params through fp32 working copies (state and math are fp32, the param is rounded once), which
also routes around torch 2.13's CPU ``_fused_sgd_`` leaving bf16/fp16 params of 16 or more
elements unchanged (``tests/fused/test_torch_kernels.py`` shows it); an elementwise update's
copies are made a batch of about ``BATCH`` elements at a time (Note [working copies by batch] in
working_copies.py). Counters are each torch form's business.

Grads are unscaled in place in a pass of their own, which serves every group and the fp32
copies of 16-bit grads at once, and which the torch forms without a ``grad_scale`` argument
(RMSprop, Lion, LAMB) need; except on a CPU, where the forms that take one (torch's fused
Adam(W), SGD and Adagrad) unscale in their own read of the grads (Note [unscale in the update
on a CPU]), and for 16-bit grads of updates whose copies are made by batches, which are checked
by batches and unscaled where they are copied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from itertools import chain
from typing import cast

import torch
from torch import Tensor

from ...kernels import PLAIN_TENSOR_TYPES, ROUNDING_LISTS
from ...protocol.clipping import sum_of_squares
from ...scale import ScaleUpdate
from ...torch_ops import (
    HOST_READS,
    LOW_PRECISION,
    advance_steps_,
    copy_unless_skipped_,
    elementwise_batches,
    local_tensors,
    may_overflow_when_unscaled,
    skip_on_host,
    stochastic_round_,
    unscale_dense_,
    unscale_in_place_,
)
from ..update import GradReduction, Group, ScaledTorchUpdate, TensorLists, Update
from .base import Backend, PreparedUpdate
from .working_copies import UnscaledCheck, WorkingCopies

__all__ = [
    "TORCH_NATIVE",
    "TorchNativeBackend",
    "TorchUpdate",
    "decide_skips_on_device",
    "update_in_place_",
    "update_on_working_copies_",
]

# Note [tensor subclasses]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Params that are tensor subclasses (DTensor under FSDP2 or tensor parallel, ...) take this
# backend (Note [launchable tensors] in kernels/launcher.py) but for DTensors of an elementwise
# update, which the plan hands both backends as their local tensors (Note [DTensor steps on our
# kernels] in fused/sharded.py). Other updates (LAMB's per-tensor norms) take the DTensors and
# step their local shards too, their sums over whole tensors added up over the mesh (Note [sums
# over the mesh] in torch_ops/sharded.py); their grads are checked through their local tensors,
# and the plan agrees on ``found_inf`` (and the clip's sum of squares) over the meshes, on
# device, so every rank of a mesh sees an overflow in any shard and skips with the others, with
# or without ``process_group``, and plain params may stand beside them. What is left (a
# ``Partial`` DTensor, another subclass) runs torch's ops on the tensors as they are: an
# elementwise update on their local tensors (``local_tensors``: a DTensor's shard, any other
# subclass itself), whose check DTensor all-reduces over the mesh before it reaches the plain
# ``found_inf`` (tests/distributed/test_dist_sharded.py, an inf in one rank's shard of FSDP2
# params on both backends).


class TorchNativeBackend(Backend):
    """Updates through ``Update.torch_update`` on fp32 working copies."""

    name = "torch"
    folds_unscale = False
    applies_scale_update = False

    @property
    def host_skip(self) -> bool:
        """Whether, on a CPU, the torch forms read ``found_inf`` and skip on the host (the
        default: a host read is free there); ``False``: they decide on device everywhere, as on
        a GPU. The switch of Note [host skip] in torch_ops/skip.py."""
        return HOST_READS.on_cpu

    @host_skip.setter
    def host_skip(self, value: bool) -> None:
        HOST_READS.on_cpu = value

    def host_reads_free(self, device: torch.device) -> bool:
        """Whether a torch form may read a tensor on ``device`` on the host: on a CPU, when
        :attr:`host_skip`."""
        return HOST_READS.free(device)

    def check_(self, grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor | None) -> None:
        for grad in grads:
            unscaled = grad if inv_scale is None else grad.float() * inv_scale
            torch.maximum(found_inf, unscaled.isfinite().logical_not().any().float(), out=found_inf)

    def prepare_unscale(
        self, grad_lists: list[list[Tensor]], updates: list[PreparedUpdate]
    ) -> _TorchUnscale:
        return _TorchUnscale(grad_lists, updates)

    def prepare(
        self, update: Update, group: Group, lists: TensorLists, scratch: list[Tensor]
    ) -> TorchUpdate:
        return TorchUpdate(update, group, lists)

    def prepare_reduction(
        self, reduction: GradReduction, grad_lists: list[list[Tensor]]
    ) -> _TorchReduction:
        return _TorchReduction(reduction)

    def prepare_epilogue(self, steps: list[Tensor]) -> _TorchEpilogue:
        return _TorchEpilogue()


# Note [unscale in the update on a CPU]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Unscaled in a pass of their own, then clipped in place, fp32 grads are read and written twice
# before the update reads them: on a CPU, where a step is bound by memory traffic, that made a
# clipping step cost more than GradScaler + ``clip_grad_norm_`` + torch's fused AdamW. So when a
# step clips (``max_grad_norm``) and every update of it takes a ``grad_scale``
# (``Update.torch_update_takes_grad_scale``: torch's fused Adam(W), SGD and Adagrad) over float32
# params and grads, on a CPU (the engine's ``host_skip``, Note [host skip] in torch_ops/skip.py),
# the check reads the scaled grads once, read-only, for the 2-norm the clip needs (one
# ``_foreach_norm``), and leaves them scaled; the update divides them by ``S / coef`` (Note
# [clipping in the step] in protocol/clipping.py) and, as torch's fused ops do, leaves them unscaled
# and clipped. ``found_inf`` is set on device, no host read, when the unscaled norm (the scaled one
# times ``inv_scale``) is not below ``_FOLD_NORM_LIMIT``: an inf or nan anywhere makes it
# non-finite, and below the limit no unscaled element can overflow, at a scale below 1 too. One case
# differs from GradScaler, which checks the elements: finite grads whose scaled norm is past
# float32's range (about 1.8e19) count as an overflow, so the step is skipped and the scale backs
# off until the norm fits. That is why a step that does not clip keeps the element check (unscale in
# place): at a large scale, as after a long run of clean steps, the scaled norm of finite grads may
# pass the range, and a step without clipping must skip exactly where GradScaler does. The unscaled
# norm is the scaled one times ``inv_scale``: with a scale that is a power of 2, the same float as
# the norm of the unscaled grads. Other devices and the sync-free form keep the unscale in place.
_FOLD_NORM_LIMIT = 1e37  # an unscaled grad norm below it: no unscaled element can overflow


class _TorchUnscale:
    """Every grad unscaled in place (and so checked: ``checked`` saves nothing here), or, where
    the updates unscale in their own read, checked only (Note [unscale in the update on a
    CPU])."""

    def __init__(self, grad_lists: list[list[Tensor]], updates: list[PreparedUpdate]) -> None:
        # Dense float32 grads only (the common case) take torch's op with no per-grad Python;
        # the step cache keeps the grads' dtypes and layout as planned (Note [step cache]).
        self.float32 = all(
            g.dtype == torch.float32 and g.layout == torch.strided
            for g in chain.from_iterable(grad_lists)
        )
        self.folds = (
            self.float32
            and bool(updates)
            and all(isinstance(u, TorchUpdate) and u.takes_grad_scale() for u in updates)
        )
        # See Note [tensor subclasses]: DTensor grads of an update that is not elementwise are
        # checked through their local tensors (the plan agrees over their meshes).
        self.local = any(
            isinstance(u, TorchUpdate) and not u.update.elementwise for u in updates
        ) and any(type(g) not in PLAIN_TENSOR_TYPES for g in chain.from_iterable(grad_lists))
        # 16-bit grads checked by batches and left scaled, for updates that copy them into fp32
        # by batches and unscale there (see Note [working copies by batch] in working_copies.py).
        self.check: UnscaledCheck | None = None
        if (
            not self.float32
            and bool(updates)
            and all(
                isinstance(u, TorchUpdate) and u.copies is not None and u.copies.convert_grads
                for u in updates
            )
        ):
            self.check = UnscaledCheck(list(chain.from_iterable(grad_lists)))

    def __call__(
        self,
        found_inf: Tensor,
        inv_scale: Tensor,
        checked: frozenset[int],
        grad_lists: list[list[Tensor]],
        norm_sq: Tensor | None = None,
    ) -> Tensor | None:
        if self.float32:
            grads = grad_lists[0] if len(grad_lists) == 1 else list(chain.from_iterable(grad_lists))
            if self.local:
                grads = local_tensors(grads)
            if grads:
                # See Note [unscale in the update on a CPU]: a clipping step only
                if (
                    norm_sq is not None
                    and self.folds
                    and TORCH_NATIVE.host_reads_free(grads[0].device)
                ):
                    _check_by_norm(grads, found_inf, inv_scale, norm_sq)
                    return inv_scale  # the updates unscale (Note [unscale in the update on a CPU])
                # See Note [overflow after unscaling]: the second pass only at a scale below 1
                unscale_dense_(grads, found_inf, inv_scale, may_overflow_when_unscaled(inv_scale))
                if norm_sq is not None:  # See Note [clipping in the step]: of the unscaled grads
                    norm_sq.add_(sum_of_squares(grads))
            return None
        if self.check is not None and norm_sq is None:
            grads = list(chain.from_iterable(grad_lists))
            host_reads = bool(grads) and TORCH_NATIVE.host_reads_free(grads[0].device)
            self.check(grads, found_inf, inv_scale, host_reads)
            return inv_scale  # the updates unscale (see Note [working copies by batch])
        # 16-bit grads are unscaled into fp32 copies, which the update then reads: unscaled in
        # 16 bits, a small true grad flushes to zero, and at a scale below 1 a large one
        # overflows after torch's check. fp32 grads are unscaled in place (the faster path).
        for grads in grad_lists:
            for i, grad in enumerate(grads):
                if grad.dtype in LOW_PRECISION:
                    grads[i] = grad.float()
        grads = list(chain.from_iterable(grad_lists))
        if self.local:
            grads = local_tensors(grads)
        unscale_in_place_(grads, found_inf, inv_scale)
        if norm_sq is not None and grads:
            norm_sq.add_(sum_of_squares(grads))
        return None

    def repoint(self, pointers: list[int]) -> None:
        pass  # it holds no grads


def _check_by_norm(
    grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor, norm_sq: Tensor
) -> None:
    """Sets ``found_inf`` (on device) unless the unscaled 2-norm of the scaled ``grads``, read
    once, is below ``_FOLD_NORM_LIMIT``, and adds its square to ``norm_sq`` (Note [unscale in
    the update on a CPU])."""
    # sqrt(x ** 2) == x exactly (Note [clipping in the step]): the norm clip_grad_norm_ computes
    norm = sum_of_squares(grads).sqrt() * inv_scale
    torch.maximum(found_inf, (norm < _FOLD_NORM_LIMIT).logical_not().float(), out=found_inf)
    norm_sq.add_(norm.square())


class TorchUpdate:
    """One group's torch form, on fp32 working copies of 16-bit params (made a batch of about
    ``BATCH`` elements at a time for an elementwise update)."""

    # See Note [working copies by batch] in working_copies.py.

    #: Whether an elementwise update's working copies may run by batches (torch.optim's
    #: implementations, which keep counters their own way, take whole tensors).
    batches_copies = True

    def __init__(self, update: Update, group: Group, lists: TensorLists) -> None:
        self.update = update
        self.group = group
        params, _, *state_lists, steps = lists
        self.params, self.steps = params, steps
        self.masters: list[Tensor] = []
        self.seeds: list[Tensor] = []
        if update.kernel.lists[-3:-1] == ROUNDING_LISTS:  # See Note [param rounding]
            *state_lists, self.masters, self.seeds = state_lists
        self.state_lists = state_lists
        # See Note [tensor subclasses]: elementwise updates of DTensors run on their local shards.
        self.on_shards = update.elementwise and any(
            type(p) not in PLAIN_TENSOR_TYPES for p in params
        )
        # No working copies: no masters, no 16-bit params, grads of their params' dtypes (the
        # step cache keeps the dtypes as planned, Note [step cache]).
        self.in_place = not self.masters and all(
            p.dtype not in LOW_PRECISION and g.dtype == p.dtype for p, g in zip(params, lists[1])
        )
        # See Note [working copies by batch] in working_copies.py: on a CPU only (on a GPU the
        # caching allocator hands out whole copies with no page faults, and batches of BATCH
        # elements would multiply the launches of a step by the tensors' sizes).
        self.copies: WorkingCopies | None = None
        if (
            self.batches_copies
            and bool(params)
            and params[0].device.type == "cpu"
            and update.elementwise
            and not self.in_place
            and not self.on_shards
            and WorkingCopies.fits(params, lists[1], self.masters, state_lists)
        ):
            scaled_form = None  # where the update can unscale the grads in its own read
            if update.torch_update_takes_grad_scale:
                scaled_form = partial(cast(ScaledTorchUpdate, update).torch_update, group)
            self.copies = WorkingCopies(
                params, lists[1], self.masters, state_lists, self.seeds, steps, scaled_form
            )

    def takes_grad_scale(self) -> bool:
        """Whether it can take grads still scaled (Note [unscale in the update on a CPU]): an
        update in place on plain fp32 tensors whose torch form takes a ``grad_scale``."""
        return self.update.torch_update_takes_grad_scale and self.in_place and not self.on_shards

    def __call__(
        self, found_inf: Tensor | None, inv_scale: Tensor | None, grads: list[Tensor]
    ) -> None:
        params, masters, state_lists = self.params, self.masters, self.state_lists
        steps = self.steps
        if self.copies is not None:  # grads left scaled by UnscaledCheck where inv_scale is set
            host_reads = TORCH_NATIVE.host_reads_free(params[0].device)
            self.copies(self.run, found_inf, grads, inv_scale, host_reads)
            return
        if inv_scale is not None:  # grads left scaled for it: Note [unscale in the update on a CPU]
            scaled = cast(ScaledTorchUpdate, self.update)
            lists = [params, grads, *state_lists, steps]
            scaled.torch_update(self.group, lists, found_inf, grad_scale=inv_scale.reciprocal())
            return
        if self.on_shards:
            params, grads, masters = map(local_tensors, (params, grads, masters))
            state_lists = [local_tensors(state) for state in state_lists]
        if self.in_place:
            self.run([params, grads, *state_lists, steps], found_inf)
            return
        # See Note [param rounding]: with masters the update runs on them in place.
        work = masters or [p.float() if p.dtype in LOW_PRECISION else p for p in params]
        work_grads = [g if g.dtype == w.dtype else g.to(w.dtype) for g, w in zip(grads, work)]
        self.run([work, work_grads, *state_lists, steps], found_inf)
        if self.seeds:  # the counters now count this step, as the kernels' `*step + 1`
            seeds = local_tensors(self.seeds) if self.on_shards else self.seeds
            on_host = TORCH_NATIVE.host_reads_free(params[0].device) if params else False
            stochastic_round_(params, work, seeds, steps, on_host=on_host)
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

    def run(self, lists: TensorLists, found_inf: Tensor | None) -> None:
        """The update over the working lists: ``Update.torch_update``, or one of the two
        drivers of ``Update.torch_form_``."""
        # See Note [one torch form].
        update = self.update
        if not update.torch_form_in_place:  # torch's fused ops: they skip on found_inf
            update.torch_update(self.group, lists, found_inf)
            return
        params = lists[0]
        if not params:
            return
        skip = skip_on_host(found_inf, TORCH_NATIVE.host_reads_free(params[0].device))
        if skip:
            return
        if skip is None and (found_inf is not None or torch.is_grad_enabled()):
            update_on_working_copies_(update, self.group, lists, found_inf)
            return
        advance_steps_(lists[-1], None)  # the step is taken: the form reads the new count
        update_in_place_(update, self.group, lists, batched=skip is not None)

    def repoint(self, pointers: list[int]) -> None:
        pass  # it holds no grads


# Note [one torch form]
# ~~~~~~~~~~~~~~~~~~~~~
# RMSprop, Lion and LAMB have no torch op that takes found_inf, so each writes its torch math
# once, in place over lists and taken unconditionally (``Update.torch_form_``), and this module
# owns the two ways to skip it:
# * on the host (a CPU, Note [host skip] in torch_ops/skip.py): the skip is read, and a taken
#   step runs the form on the lists themselves, an elementwise update batch by batch
#   (``elementwise_batches``: the temporaries stay in the cache), LAMB (per-tensor and global
#   norms) over the whole lists, which it batches itself;
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


class _TorchReduction:
    """A reduction's torch form over the step's grads as the unscale left them."""

    def __init__(self, reduction: GradReduction) -> None:
        self.reduction = reduction

    def __call__(
        self, found_inf: Tensor | None, inv_scale: Tensor | None, grad_lists: list[list[Tensor]]
    ) -> None:
        self.reduction.out.zero_()
        grads = list(chain.from_iterable(grad_lists))
        if inv_scale is not None:  # left scaled for updates that unscale in their own read
            grads = [g.float() if g.dtype in LOW_PRECISION else g for g in grads]
            grads = list(torch._foreach_mul(grads, inv_scale))
        self.reduction.torch_form(grads)

    def repoint(self, pointers: list[int]) -> None:
        pass  # it holds no grads


class _TorchEpilogue:
    """The torch forms advanced the counters; a scale update arrives only if deferred."""

    def __call__(self, found_inf: Tensor | None, scale_update: ScaleUpdate | None) -> None:
        if scale_update is not None:
            scale_update.apply()


TORCH_NATIVE = TorchNativeBackend()


@contextlib.contextmanager
def decide_skips_on_device() -> Iterator[None]:
    """Inside the block the torch forms take their sync-free forms on a CPU too: the torch-native
    engine's ``host_skip`` is off."""
    # See Note [host skip] in torch_ops/skip.py: how the suite and the doctor check the GPU's form.
    saved = TORCH_NATIVE.host_skip
    TORCH_NATIVE.host_skip = False
    try:
        yield
    finally:
        TORCH_NATIVE.host_skip = saved
