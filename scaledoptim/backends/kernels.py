"""The kernel backend: our CUDA kernels (``cuda/``), through CuPy on CUDA tensors and through the
g++ emulator on CPU tensors. Updates unscale in registers, so grads are read once for the
inf/nan check and once for the update, and never written."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from ..kernels.builtin import AdvanceStepsArgs, non_finite_check_, prepare_advance_steps
from ..kernels.launcher import prepare_launch, scalar_pointer
from .base import Backend, PreparedUpdate

__all__ = ["KERNELS", "KernelBackend"]


class KernelBackend(Backend):
    """Launches the optimizer's ``kernel`` with its ``_kernel_args``, then the step counters."""

    name = "kernels"
    folds_unscale = True

    def check_(self, grads: Sequence[Tensor], found_inf: Tensor) -> None:
        non_finite_check_(grads, found_inf)

    def prepare(self, optimizer, group: dict[str, Any], tensor_lists: list[list[Tensor]]) -> PreparedUpdate:
        device = tensor_lists[0][0].device
        launches = optimizer._prepare_kernel_launches(group, tensor_lists)
        if launches is not None:  # an update of several launches (LAMB)

            def run_launches(found_inf: Tensor | None, inv_scale: Tensor | None) -> None:
                launches(scalar_pointer(found_inf, "found_inf", device), scalar_pointer(inv_scale, "inv_scale", device))

            return run_launches
        update = prepare_launch(optimizer.kernel, tensor_lists)
        advance = prepare_advance_steps(tensor_lists[-1])

        def run(found_inf: Tensor | None, inv_scale: Tensor | None) -> None:
            found = scalar_pointer(found_inf, "found_inf", device)
            inv = scalar_pointer(inv_scale, "inv_scale", device)
            update.run(optimizer._kernel_args(group, found, inv))
            advance.run(AdvanceStepsArgs(found))  # Note [step counters]: after the update

        return run


KERNELS = KernelBackend()
