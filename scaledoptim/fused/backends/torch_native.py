"""The torch-native backend: each optimizer's torch form, sync-free on any device: its
``Update.torch_update`` over torch's fused ops, or its ``Update.torch_form_`` through one of two
drivers (on a CPU, the skip read on the host; or working copies copied back unless skipped), on
the route each group takes (Note [route table] in routes.py); here, the check of the grads
before the updates, and the backend.

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
from itertools import chain

import torch
from torch import Tensor

from ...kernels import PLAIN_TENSOR_TYPES
from ...protocol.clipping import sum_of_squares
from ...scale import ScaleUpdate
from ...torch_ops import (
    HOST_READS,
    LOW_PRECISION,
    local_tensors,
    may_overflow_when_unscaled,
    unscale_dense_,
    unscale_in_place_,
)
from ..update import GradReduction, Group, TensorLists, Update
from .base import Backend, PreparedUpdate
from .routes import Check, TorchUpdate, choose_check
from .working_copies import UnscaledCheck

__all__ = ["TORCH_NATIVE", "TorchNativeBackend", "TorchUpdate", "decide_skips_on_device"]

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
    """The check of a step's grads, on the route of Note [route table]: unscaled in place (and
    so checked: ``checked`` saves nothing here), or checked only where the updates unscale them
    in their own read (Note [unscale in the update on a CPU], Note [working copies by batch])."""

    def __init__(self, grad_lists: list[list[Tensor]], updates: list[PreparedUpdate]) -> None:
        grads = list(chain.from_iterable(grad_lists))
        torch_updates = [u for u in updates if isinstance(u, TorchUpdate)]
        every = bool(updates) and len(torch_updates) == len(updates)
        # Dense float32 grads only (the common case) take torch's op with no per-grad Python;
        # the step cache keeps the grads' dtypes and layout as planned (Note [step cache]).
        self.float32 = all(g.dtype == torch.float32 and g.layout == torch.strided for g in grads)
        self.fused_op = every and all(u.takes_grad_scale() for u in torch_updates)
        self.by_batch = every and all(
            u.copies is not None and u.copies.convert_grads for u in torch_updates
        )
        # See Note [tensor subclasses]: DTensor grads of an update that is not elementwise are
        # checked through their local tensors (the plan agrees over their meshes).
        self.local = any(not u.update.elementwise for u in torch_updates) and any(
            type(g) not in PLAIN_TENSOR_TYPES for g in grads
        )
        self.device = grads[0].device if grads else None
        self.by_batches = UnscaledCheck(grads) if self.by_batch and not self.float32 else None
        self._choose()

    def _choose(self) -> None:
        self._switch = HOST_READS.on_cpu
        self.host_reads = self.device is not None and HOST_READS.free(self.device)
        #: The check of a step that does not clip, and of one that does.
        self.checks = [
            choose_check(self.float32, self.fused_op, self.by_batch, self.host_reads, clipping)
            for clipping in (False, True)
        ]

    def __call__(
        self,
        found_inf: Tensor,
        inv_scale: Tensor,
        checked: frozenset[int],
        grad_lists: list[list[Tensor]],
        norm_sq: Tensor | None = None,
    ) -> Tensor | None:
        if HOST_READS.on_cpu != self._switch:  # See Note [route table]: the one fact that moves
            self._choose()
        check = self.checks[norm_sq is not None]
        if check is Check.INTO_FP32:
            # 16-bit grads are unscaled into fp32 copies, which the update then reads: unscaled in
            # 16 bits, a small true grad flushes to zero, and at a scale below 1 a large one
            # overflows after torch's check.
            for same_group in grad_lists:
                for i, grad in enumerate(same_group):
                    if grad.dtype in LOW_PRECISION:
                        same_group[i] = grad.float()
        grads = grad_lists[0] if len(grad_lists) == 1 else list(chain.from_iterable(grad_lists))
        if self.local:
            grads = local_tensors(grads)
        if not grads:
            return None
        if check is Check.BY_NORM:  # See Note [unscale in the update on a CPU]
            assert norm_sq is not None
            _check_by_norm(grads, found_inf, inv_scale, norm_sq)
            return inv_scale  # the updates unscale
        if check is Check.BY_BATCH:  # See Note [working copies by batch]
            assert self.by_batches is not None
            self.by_batches(grads, found_inf, inv_scale, self.host_reads)
            return inv_scale  # the copies unscale
        if check is Check.UNSCALED_IN_PLACE:
            # See Note [overflow after unscaling]: the second pass only at a scale below 1
            unscale_dense_(grads, found_inf, inv_scale, may_overflow_when_unscaled(inv_scale))
        else:
            unscale_in_place_(grads, found_inf, inv_scale)
        if norm_sq is not None:  # See Note [clipping in the step]: of the unscaled grads
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
