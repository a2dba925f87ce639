"""The torch-native backend: torch's fused multi-tensor ops, sync-free on any device.

torch's ``_fused_adam(w)_`` / ``_fused_sgd_`` read ``found_inf`` on device and skip the whole
update when it is 1.0 (Note [found_inf contract] in cuda/common.cuh), but they need params,
grads and state of one dtype and they do not advance step counters. So this backend runs 16-bit
params through fp32 working copies (state and math are fp32, the param is rounded once), which
also routes around torch 2.13's CPU ``_fused_sgd_`` leaving bf16/fp16 params of 16 or more
elements unchanged (``tests/test_torch_kernels.py`` shows it). Counters are each optimizer's
business (``FusedOptimizer._torch_update``).

It never unscales in the update: on CPU an in-place unscale followed by the plain fused update
is about twice as fast as torch's in-kernel ``grad_scale``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..kernels.rounding import ROUNDING_LISTS
from ..optim.rounding import stochastic_round_
from ..scaling import ScaleUpdate
from .base import Backend, PreparedEpilogue, PreparedUnscale, PreparedUpdate

__all__ = ["TORCH_NATIVE", "TorchNativeBackend", "advance_steps_", "copy_unless_skipped_", "unscale_in_place_"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class TorchNativeBackend(Backend):
    """Updates through ``FusedOptimizer._torch_update`` on fp32 working copies."""

    name = "torch"
    folds_unscale = False
    applies_scale_update = False

    def check_(self, grads: list[Tensor], found_inf: Tensor) -> None:
        for grad in grads:
            torch.maximum(found_inf, grad.isfinite().logical_not().any().float(), out=found_inf)

    def prepare_unscale(self, grad_lists: list[list[Tensor]]) -> PreparedUnscale:
        def unscale(found_inf: Tensor, inv_scale: Tensor, checked: frozenset[int]) -> None:
            # Every grad is unscaled, so every grad is checked (``checked`` saves nothing here).
            # 16-bit grads are unscaled into fp32 copies, which the update then reads: unscaled
            # in 16 bits, a small true grad flushes to zero, and at a scale below 1 a large one
            # overflows after torch's check. fp32 grads are unscaled in place (the faster path).
            for grads in grad_lists:
                for i, grad in enumerate(grads):
                    if grad.dtype in _LOW_PRECISION:
                        grads[i] = grad.float()
            unscale_in_place_([g for grads in grad_lists for g in grads], found_inf, inv_scale)

        return unscale

    def prepare(self, optimizer, group: dict[str, Any], tensor_lists: list[list[Tensor]]) -> PreparedUpdate:
        params, grads, *state_lists, steps = tensor_lists
        masters, seeds = _split_rounding_lists(optimizer, state_lists)

        def update(found_inf: Tensor | None, inv_scale: Tensor | None) -> None:
            # Note [param rounding]: with masters the update runs on them in place.
            work = masters or [p.float() if p.dtype in _LOW_PRECISION else p for p in params]
            work_grads = [g if g.dtype == w.dtype else g.to(w.dtype) for g, w in zip(grads, work)]
            optimizer._torch_update(group, [work, work_grads, *state_lists, steps], found_inf)
            if seeds:  # the counters now count this step, as the kernels' `*step + 1`
                stochastic_round_(params, work, seeds, steps)
                return
            rounded = [(p, w) for p, w in zip(params, work) if p is not w]
            if rounded:
                torch._foreach_copy_([p for p, _ in rounded], [w for _, w in rounded])

        return update

    def prepare_epilogue(self, steps: list[Tensor]) -> PreparedEpilogue:
        # ``_torch_update`` advanced the counters; a scale update arrives only if deferred.
        def run(found_inf: Tensor | None, scale_update: ScaleUpdate | None) -> None:
            if scale_update is not None:
                scale_update.apply()

        return run


def _split_rounding_lists(optimizer, state_lists: list[list[Tensor]]) -> tuple[list[Tensor], list[Tensor]]:
    """Removes the kernel's ``master_params``/``sr_seeds`` lists from ``state_lists`` (Note
    [param rounding]) and returns them."""
    if optimizer.kernel.lists[-3:-1] != ROUNDING_LISTS:
        return [], []
    seeds, masters = state_lists.pop(), state_lists.pop()
    return masters, seeds


def copy_unless_skipped_(dst: Sequence[Tensor], src: Sequence[Tensor], found_inf: Tensor | None) -> None:
    """``dst[i] = src[i]``, or nothing when ``found_inf`` is set (on device, no host read)."""
    if found_inf is None:
        torch._foreach_copy_(list(dst), list(src))
        return
    skip = found_inf > 0
    for d, s in zip(dst, src):
        d.copy_(torch.where(skip, d, s))


def unscale_in_place_(grads: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """``g *= inv_scale`` for every grad, setting ``found_inf`` on inf/nan (torch's op, grouped
    by dtype as it requires).

    torch checks the grads before multiplying, so 16-bit grads are checked again after: at a
    scale below 1 an unscaled fp16 value can exceed the dtype's range, and that is an overflow.
    """
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for dtype, same_dtype in by_dtype.items():
        torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found_inf, inv_scale)
        if dtype in _LOW_PRECISION:
            torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found_inf, _one(found_inf))


def _one(like: Tensor) -> Tensor:
    return torch.ones((), dtype=torch.float32, device=like.device)


def advance_steps_(steps: list[Tensor], found_inf: Tensor | None) -> None:
    """Adds 1 to every step counter, or nothing when ``found_inf`` is set (on device)."""
    if steps:
        torch._foreach_add_(steps, 1 if found_inf is None else 1 - found_inf)


TORCH_NATIVE = TorchNativeBackend()
