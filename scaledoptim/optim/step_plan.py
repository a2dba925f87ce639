"""The validated plan of a fused step: per backend, the prepared group updates, the grads they
read, their step counters and the epilogue that ends the step."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from ..backends import TORCH_NATIVE, Backend
from ..backends.base import PreparedEpilogue, PreparedUnscale, PreparedUpdate
from ..scaling import ScaleUpdate

if TYPE_CHECKING:
    from .fused import FusedOptimizer

__all__ = ["PENDING"]  # and the plan classes, private to the fused optimizers

# While the protocol runs ``self.step()``, the validated plan and its scalars wait here, so that
# the step hooks, schedulers and the profiler see an ordinary ``step()`` call.
PENDING = "_scaledoptim_pending_step"


def _split_by_support(
    backend: Backend, params: list[torch.Tensor]
) -> list[tuple[Backend, list[int]]]:
    """Which params ``backend`` updates and which torch's ops update instead (float64 ones on
    our kernels: torch.optim takes float64 params, so the fused optimizers do too)."""
    ours = [i for i, p in enumerate(params) if backend.supports(p)]
    others = [i for i, p in enumerate(params) if not backend.supports(p)]
    return [(b, picked) for b, picked in ((backend, ours), (TORCH_NATIVE, others)) if picked]


@dataclasses.dataclass
class _Part:
    """What one backend runs in a step: its group updates, the grads they read (per group, in
    their params' layout), their step counters, the check (or unscale) of those grads and the
    epilogue over the counters."""

    updates: list[PreparedUpdate] = dataclasses.field(default_factory=list)
    grad_lists: list[list[torch.Tensor]] = dataclasses.field(default_factory=list)
    steps: list[torch.Tensor] = dataclasses.field(default_factory=list)
    unscale: PreparedUnscale | None = None
    epilogue: PreparedEpilogue | None = None


class _FusedStepPlan:
    """A fused step, validated: the prepared group updates and the state they will create."""

    def __init__(self, optimizer: FusedOptimizer, backend: Backend) -> None:
        self.optimizer = optimizer
        self.backend = backend
        self.applies_scale_update = backend.applies_scale_update
        self.new_state: dict[torch.Tensor, dict[str, Any]] = {}
        self.parts: dict[Backend, _Part] = {}
        # The params with a grad and their grads as they are (StepPlan's); per group the group,
        # those params and the group's tensor lists; whether a grad was copied into its
        # param's layout.
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.groups: list[tuple[dict[str, Any], list[torch.Tensor], list[list[torch.Tensor]]]] = []
        self.grads_copied = False
        # Per backend, the inv_scale its updates must still apply once the grads are checked.
        self.left: dict[Backend, torch.Tensor | None] = {}

    def part(self, backend: Backend) -> _Part:
        return self.parts.setdefault(backend, _Part())

    def unscale_grads_(
        self,
        found_inf: torch.Tensor,
        inv_scale: torch.Tensor,
        checked: frozenset[int] = frozenset(),
    ) -> torch.Tensor | None:
        for backend, part in self.parts.items():
            self.left[backend] = part.unscale(found_inf, inv_scale, checked)
        return inv_scale

    def step(
        self,
        found_inf: torch.Tensor | None,
        inv_scale: torch.Tensor | None,
        scale_update: ScaleUpdate | None = None,
    ) -> None:
        optimizer = self.optimizer
        optimizer.__dict__[PENDING] = (self, found_inf, inv_scale, scale_update)
        try:
            optimizer.step()
        finally:
            optimizer.__dict__.pop(PENDING, None)

    def commit(
        self,
        found_inf: torch.Tensor | None,
        inv_scale: torch.Tensor | None,
        scale_update: ScaleUpdate | None,
    ) -> None:
        """Installs the new state, runs every update and the epilogue: only device errors can
        interrupt."""
        self.optimizer.state.update(self.new_state)
        for backend, part in self.parts.items():
            for update in part.updates:
                update(found_inf, self.left.get(backend))
        for backend, part in self.parts.items():
            part.epilogue(found_inf, scale_update if backend is self.backend else None)
