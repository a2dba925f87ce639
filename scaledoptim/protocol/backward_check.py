"""The overflow check overlapped with backward (``configure_scaling(check_during_backward=True)``).

Note [overlapped overflow check]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A fused step on our kernels reads each grad twice: once for the read-only inf/nan check, once
in the update (32 B/param for fp32 AdamW; GradScaler + torch's fused AdamW read and write the
grads to check them and read them again: 36). With this option a post-accumulate-grad hook
folds each grad into this iteration's ``found_inf`` as backward produces it, while it is still
in cache, and records the grad (a weak reference, its data pointer and version counter: the
hooks keep no grad alive). What it folds is what the update will read: the grad times the
reciprocal of the optimizer's scale as the iteration's first hook found it (at a scale below 1 a
finite scaled grad can unscale to inf). The step uses what was folded only when it unscales by
that same scale tensor, unmoved since (its version counter); any other scale is checked anew. The
step then checks only grads that were not recorded, or changed since (set outside backward, modified
in place, accumulated by another backward): 28 B/param when none did. ``found_inf`` is still agreed
across the process group before anything uses it. On torch's ops the step unscales, and so checks,
every grad in place anyway: there the hooks do nothing.

What was folded belongs to the grads it was folded from, so it is dropped with them: by the
optimizer's ``zero_grad``; by a hook that finds its param's recorded grad gone or written since
other than by accumulating onto it (one version step: ``model.zero_grad()``, grads set to
``None`` by hand, a discarded backward); and by the step when any recorded grad is no longer its
param's as recorded. The step then checks every grad itself: a probe backward that overflowed
and was thrown away cannot skip the next step.

Once ``torch.distributed`` is initialized the hooks do nothing either. A hook sees the rank's
local grad, and the step uses the reduced one; a collective writes a tensor in place without
moving its version counter, so a grad all-reduced after its hook (``dist.all_reduce(p.grad)``,
a DDP comm hook reducing bucket-view grads in place) would look unchanged, yet finite grads on
every rank can sum to inf, and without a process group one rank's inf would reach the others
unseen (tests/distributed/test_dist_backward_check.py). DDP's own reducer writes every grad
after its hook (the copy back from the bucket, or the division in it), so its step checked each
grad again anyway: there the hooks only added a read.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch import distributed as dist

__all__ = ["BackwardCheck", "GradCheck"]

#: ``check(grads, found_inf, inv_scale)`` sets ``found_inf`` to 1.0 if any of ``grads`` times
#: ``inv_scale`` (``None``: as they are) is inf/nan.
GradCheck = Callable[[list[Tensor], Tensor, "Tensor | None"], None]


class BackwardCheck:
    """The hooks of one optimizer's params, and what they found in the current iteration.

    Args:
        param_groups: the optimizer's param groups; every param that requires grad gets a hook.
        check_for: the check to fold a grad on a device with, or ``None`` where the step checks
            every grad anyway (the optimizer decides: ``Optimizer._overlapped_check``).
        scale_for: the optimizer's scale tensor now, whose reciprocal the grads are checked at.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        check_for: Callable[[torch.device], GradCheck | None],
        scale_for: Callable[[], Tensor],
    ) -> None:
        self._check_for = check_for
        self._scale_for = scale_for
        self._found_inf: Tensor | None = None
        # The scale the iteration's grads were checked at, its version then, and its reciprocal.
        self._scale: tuple[Tensor, int, Tensor] | None = None
        # id(param) -> (its grad, the grad's data pointer and version counter when folded)
        self._checked: dict[int, tuple[weakref.ref[Tensor], int, int]] = {}
        self._handles = [
            param.register_post_accumulate_grad_hook(self._fold)
            for group in param_groups
            for param in group["params"]
            if param.requires_grad
        ]

    def _fold(self, param: Tensor) -> None:
        if dist.is_available() and dist.is_initialized():
            return  # a collective may rewrite the grad unseen: Note [overlapped overflow check]
        grad = param.grad
        if grad is None or grad.layout != torch.strided or not grad.is_floating_point():
            return  # the step's plan refuses or skips it, with the message
        check = self._check_for(grad.device)
        if check is None:
            return  # its step unscales every grad in place, checking it: nothing to save
        seen = self._checked.get(id(param))
        if seen is not None and not (seen[0]() is grad and seen[2] + 1 == grad._version):
            # Not this backward accumulating onto the grad folded before (that moves its
            # version by one): that grad was dropped or rewritten, so what was folded may
            # count values no step will read.
            self.reset()
        if self._found_inf is None or self._scale is None:
            self._found_inf = torch.zeros((), dtype=torch.float32, device=grad.device)
            scale = self._scale_for()
            self._scale = (scale, scale._version, scale.double().reciprocal().float())
        check([grad], self._found_inf, self._scale[2])
        self._checked[id(param)] = (weakref.ref(grad), grad.data_ptr(), grad._version)

    def reset(self) -> None:
        """Forgets what was folded (the grads were zeroed or dropped)."""
        self._found_inf, self._checked, self._scale = None, {}, None

    def take(
        self, params: list[Tensor], device: torch.device, scaled_by: Tensor
    ) -> tuple[Tensor, frozenset[int]]:
        """This iteration's ``found_inf`` and the ids of the grads it covers as they are now, or
        zeros and none when a folded grad is no longer its param's as it was folded, or the step
        unscales by another scale than the grads were checked at (the step then checks every
        grad); starts the next iteration."""
        found_inf, checked, checked_at = self._found_inf, self._checked, self._scale
        self.reset()
        if (
            checked_at is None
            or checked_at[0] is not scaled_by
            or checked_at[1] != scaled_by._version
        ):
            return torch.zeros((), dtype=torch.float32, device=device), frozenset()
        covered = frozenset(
            id(grad)
            for p in params
            if (grad := p.grad) is not None
            and (seen := checked.get(id(p))) is not None
            and seen[0]() is grad
            and seen[1] == grad.data_ptr()
            and seen[2] == grad._version
        )
        if found_inf is None or len(covered) != len(checked):
            return torch.zeros((), dtype=torch.float32, device=device), frozenset()
        return found_inf, covered

    def remove(self) -> None:
        """Unregisters the hooks."""
        for handle in self._handles:
            handle.remove()
