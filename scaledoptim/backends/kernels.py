"""The kernel backend: our CUDA kernels (``cuda/``), through CuPy on CUDA tensors and through the
g++ emulator on CPU tensors. Updates unscale in registers, so grads are read once for the
inf/nan check and once for the update, and never written."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..kernels.builtin import (
    NON_FINITE_CHECK,
    STEP_EPILOGUE,
    NonFiniteCheckArgs,
    StepEpilogueArgs,
    non_finite_check_,
)
from ..kernels.launcher import PreparedLaunch, is_dense, prepare_launch, scalar_pointer
from ..kernels.spec import CUDA_TYPE_NAMES
from ..scaling import ScaleUpdate
from .base import Backend, PreparedEpilogue, PreparedUpdate

__all__ = ["KERNELS", "KernelBackend", "KernelCheck", "KernelUpdate"]


class KernelBackend(Backend):
    """Three launches a step: the read-only check, the optimizer's ``kernel`` with its
    ``_kernel_args`` (one per argument table), and the epilogue that advances every step
    counter and moves the loss scale."""

    name = "kernels"
    folds_unscale = True
    applies_scale_update = True

    def supports(self, param: Tensor) -> bool:
        return param.dtype in CUDA_TYPE_NAMES  # float32, float16, bfloat16

    def check_(self, grads: list[Tensor], found_inf: Tensor) -> None:
        non_finite_check_([g if is_dense(g) else g.contiguous() for g in grads], found_inf)

    def prepare_unscale(self, grad_lists: list[list[Tensor]]) -> KernelCheck:
        grads = [g for grads in grad_lists for g in grads]
        return KernelCheck(prepare_launch(NON_FINITE_CHECK, [grads]), grad_lists)

    def prepare(self, optimizer, group: dict[str, Any], tensor_lists: list[list[Tensor]]) -> PreparedUpdate:
        device = tensor_lists[0][0].device
        launches = optimizer._prepare_kernel_launches(group, tensor_lists)
        if launches is not None:  # an update of several launches (LAMB)

            def run_launches(found_inf: Tensor | None, inv_scale: Tensor | None) -> None:
                launches(scalar_pointer(found_inf, "found_inf", device), scalar_pointer(inv_scale, "inv_scale", device))

            return run_launches
        return KernelUpdate(optimizer, group, prepare_launch(optimizer.kernel, tensor_lists))

    def prepare_epilogue(self, steps: list[Tensor]) -> PreparedEpilogue:
        epilogue = prepare_launch(STEP_EPILOGUE, [steps])

        def run(found_inf: Tensor | None, scale_update: ScaleUpdate | None) -> None:
            if not steps:  # nothing to launch over: the scale moves with torch ops
                if scale_update is not None:
                    scale_update.apply()
                return
            found = scalar_pointer(found_inf, "found_inf", steps[0].device)
            counters_only = StepEpilogueArgs(found_inf=found)
            first = counters_only if scale_update is None else _epilogue_args(found, scale_update)
            epilogue.run(first, later_args=counters_only)  # the scale moves once

        return run


class KernelCheck:
    """The read-only inf/nan check over every grad of a step, in one prepared launch (the
    updates unscale in registers)."""

    def __init__(self, launch: PreparedLaunch, grad_lists: list[list[Tensor]]) -> None:
        self.launch = launch
        self.grad_lists = grad_lists

    def __call__(self, found_inf: Tensor, inv_scale: Tensor, checked: frozenset[int]) -> Tensor:
        if checked:  # some grads were checked during backward: check only the others
            non_finite_check_(
                [g for grads in self.grad_lists for g in grads if id(g) not in checked], found_inf
            )
        elif self.launch.plans:
            self.launch.run(NonFiniteCheckArgs(scalar_pointer(found_inf, "found_inf", self.launch.device)))
        return inv_scale


class KernelUpdate:
    """One group's update: ``optimizer.kernel`` over the group's prepared tables, with the
    arguments ``optimizer._kernel_args`` gives at each run (a scheduler may have moved ``lr``)."""

    def __init__(self, optimizer, group: dict[str, Any], launch: PreparedLaunch) -> None:
        self.optimizer = optimizer
        self.group = group
        self.launch = launch

    def __call__(self, found_inf: Tensor | None, inv_scale: Tensor | None) -> None:
        device = self.launch.device
        found = scalar_pointer(found_inf, "found_inf", device)
        inv = scalar_pointer(inv_scale, "inv_scale", device)
        self.launch.run(self.optimizer._kernel_args(self.group, found, inv))


def _epilogue_args(found_inf: int | None, update: ScaleUpdate) -> StepEpilogueArgs:
    scale, config = update.loss_scale, update.loss_scale.config
    return StepEpilogueArgs(
        found_inf=found_inf,
        scale_found_inf=update.found_inf.data_ptr(),
        scaled_by=update.scaled_by.data_ptr(),
        scale=scale.scale.data_ptr(),
        growth_tracker=scale.growth_tracker.data_ptr(),
        hysteresis_tracker=scale.hysteresis_tracker.data_ptr(),
        growth_factor=config.growth_factor,
        backoff_factor=config.backoff_factor,
        min_scale=config.min_scale,
        max_scale=config.max_scale,
        growth_interval=config.growth_interval,
        hysteresis=config.hysteresis,
        force_backoff=update.force_backoff,
    )


KERNELS = KernelBackend()
