"""The kernel backend: our CUDA kernels (``cuda/``), through CuPy on CUDA tensors and through the
g++ emulator on CPU tensors. Updates unscale in registers, so grads are read once for the
inf/nan check and once for the update, and never written."""

from __future__ import annotations

from itertools import chain

import torch
from torch import Tensor

from ...kernels import (
    CUDA_TYPE_NAMES,
    NON_FINITE_CHECK,
    NON_FINITE_CHECK_NORM,
    STEP_EPILOGUE,
    ChunkPartials,
    NonFiniteCheckArgs,
    NonFiniteCheckNormArgs,
    PreparedLaunch,
    StepEpilogueArgs,
    chunk_count,
    is_dense,
    non_finite_check_,
    prepare_launch,
    scalar_pointer,
)
from ...scale import ScaleUpdate
from ..update import GradReduction, Group, TensorLists, Update
from .base import Backend, PreparedUpdate

__all__ = ["KERNELS", "KernelBackend"]


class KernelBackend(Backend):
    """Three launches a step: the read-only check, the optimizer's kernel with its
    ``kernel_args`` (one per argument table), and the epilogue that advances every step
    counter and moves the loss scale."""

    name = "kernels"
    folds_unscale = True
    applies_scale_update = True

    def supports(self, param: Tensor) -> bool:
        return param.dtype in CUDA_TYPE_NAMES  # float32, float16, bfloat16

    def check_(self, grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor | None) -> None:
        dense = [g if is_dense(g) else g.contiguous() for g in grads]
        non_finite_check_(dense, found_inf, inv_scale)

    def prepare_unscale(
        self, grad_lists: list[list[Tensor]], updates: list[PreparedUpdate]
    ) -> _KernelCheck:
        grads = list(chain.from_iterable(grad_lists))
        return _KernelCheck([prepare_launch(NON_FINITE_CHECK, [grads])], 0, _pointers(grads))

    def prepare(
        self, update: Update, group: Group, lists: TensorLists, scratch: list[Tensor]
    ) -> _KernelUpdate:
        # A low-bit state's scales: one per block of the block size its layout declares.
        blocks = {layout.block_size for layout in update.state_layouts(group).values()}
        blocks.discard(None)
        block_size = blocks.pop() if blocks else None
        launches = [
            prepare_launch(kernel, lists, block_size=block_size if kernel.block_lists else None)
            for kernel in (*update.kernels_before, update.kernel)
        ]
        return _KernelUpdate(update, group, launches, scratch, _pointers(lists[1]))

    def prepare_reduction(
        self, reduction: GradReduction, grad_lists: list[list[Tensor]]
    ) -> _KernelReduction:
        grads = list(chain.from_iterable(grad_lists))
        return _KernelReduction(
            reduction,
            prepare_launch(reduction.kernel, reduction.tensor_lists(grads)),
            _pointers(grads),
        )

    def prepare_epilogue(self, steps: list[Tensor]) -> _KernelEpilogue:
        return _KernelEpilogue(steps, prepare_launch(STEP_EPILOGUE, [steps]))


class _Tables:
    """Prepared launches whose tables this object owns once it repoints them (the launcher's
    cached tables are shared by every launch over the same tensors), and the grad pointers they
    hold in list ``grads_list``."""

    def __init__(
        self, launches: list[PreparedLaunch], grads_list: int, pointers: list[int]
    ) -> None:
        self.launches = launches
        self.grads_list = grads_list
        self.pointers = pointers

    def repoint(self, pointers: list[int]) -> None:
        if pointers is self.pointers or pointers == self.pointers:
            return
        self.launches = [
            launch if launch.owns_tables else launch.detached() for launch in self.launches
        ]
        for launch in self.launches:
            launch.repoint(self.grads_list, pointers)
        self.pointers = pointers


class _KernelCheck(_Tables):
    """The read-only inf/nan check over every grad of a step, in one prepared launch, of the
    unscaled values the updates compute in registers; and, for a step that clips, the launch of
    the check that also sums their squares (prepared at the first such step: a step that never
    clips allocates no partials)."""

    def __init__(
        self, launches: list[PreparedLaunch], grads_list: int, pointers: list[int]
    ) -> None:
        super().__init__(launches, grads_list, pointers)
        self.sum: tuple[ChunkPartials, Tensor] | None = None  # the partials and the sum

    def __call__(
        self,
        found_inf: Tensor,
        inv_scale: Tensor,
        checked: frozenset[int],
        grad_lists: list[list[Tensor]],
        norm_sq: Tensor | None = None,
        unscaled: list[list[Tensor]] | None = None,
    ) -> Tensor:
        launch = self.launches[0]  # (reads the grads only: ``unscaled`` stays as it is)
        if norm_sq is not None:
            self._check_and_sum(found_inf, inv_scale, grad_lists, norm_sq)
        elif checked:  # some grads were checked during backward: check only the others
            non_finite_check_(
                [g for grads in grad_lists for g in grads if id(g) not in checked],
                found_inf,
                inv_scale,
            )
        elif launch.plans:
            # The unscaled values, as the updates will compute them in registers.
            launch.run(
                NonFiniteCheckArgs(
                    scalar_pointer(found_inf, "found_inf", launch.device),
                    scalar_pointer(inv_scale, "inv_scale", launch.device),
                )
            )
        return inv_scale

    def _check_and_sum(
        self, found_inf: Tensor, inv_scale: Tensor, grad_lists: list[list[Tensor]], norm_sq: Tensor
    ) -> None:
        """The check, and the sum of squares of the unscaled grads added to ``norm_sq``, in one
        read of the grads (Note [clipping in the step] in protocol/clipping.py)."""
        if self.sum is None:
            # At the grads' current pointers, which are the tables' (repoint() ran first).
            grads = list(chain.from_iterable(grad_lists))
            device = self.launches[0].device
            partials = ChunkPartials(sum(chunk_count(g.numel()) for g in grads), device)
            self.launches.append(
                prepare_launch(NON_FINITE_CHECK_NORM, [grads, partials.per_tensor(grads)])
            )
            self.sum = partials, torch.zeros((), device=grads[0].device if grads else device)
        partials, total = self.sum
        launch = self.launches[1]
        if not launch.plans:
            return
        launch.run(
            NonFiniteCheckNormArgs(
                scalar_pointer(found_inf, "found_inf", launch.device),
                scalar_pointer(inv_scale, "inv_scale", launch.device),
                total.data_ptr(),
                partials.partials.data_ptr(),
                partials.arrivals.data_ptr(),
                partials.partials.numel(),
            )
        )
        norm_sq.add_(total)


class _KernelUpdate(_Tables):
    """One group's update: the update's kernels over the group's prepared tables, with the
    arguments ``update.kernel_args`` gives at each run (a scheduler may have moved ``lr``)."""

    def __init__(
        self,
        update: Update,
        group: Group,
        launches: list[PreparedLaunch],
        scratch: list[Tensor],
        pointers: list[int],
    ) -> None:
        super().__init__(launches, 1, pointers)  # the lists are (params, grads, ...)
        self.update = update
        self.group = group
        self.scratch = scratch
        self.device = launches[0].device

    def __call__(
        self, found_inf: Tensor | None, inv_scale: Tensor | None, grads: list[Tensor]
    ) -> None:
        found = scalar_pointer(found_inf, "found_inf", self.device)
        inv = scalar_pointer(inv_scale, "inv_scale", self.device)
        args = self.update.kernel_args(self.group, found, inv)
        if self.scratch:
            torch._foreach_zero_(self.scratch)
        for launch in self.launches:
            launch.run(args)


class _KernelReduction(_Tables):
    """A reduction over every grad of the step, in one prepared launch (it applies inv_scale)."""

    def __init__(
        self, reduction: GradReduction, launch: PreparedLaunch, pointers: list[int]
    ) -> None:
        super().__init__([launch], 0, pointers)
        self.reduction = reduction

    def __call__(
        self, found_inf: Tensor | None, inv_scale: Tensor | None, grad_lists: list[list[Tensor]]
    ) -> None:
        (launch,) = self.launches
        self.reduction.out.zero_()
        found = scalar_pointer(found_inf, "found_inf", launch.device)
        launch.run(
            self.reduction.kernel_args(found, scalar_pointer(inv_scale, "inv_scale", launch.device))
        )


def _pointers(tensors: list[Tensor]) -> list[int]:
    return [t.data_ptr() for t in tensors]


class _KernelEpilogue:
    """The step's last launch: every step counter advanced, and the loss scale moved once."""

    def __init__(self, steps: list[Tensor], launch: PreparedLaunch) -> None:
        self.steps = steps
        self.launch = launch

    def __call__(self, found_inf: Tensor | None, scale_update: ScaleUpdate | None) -> None:
        if not self.steps:  # nothing to launch over: the scale moves with torch ops
            if scale_update is not None:
                scale_update.apply()
            return
        found = scalar_pointer(found_inf, "found_inf", self.launch.device)
        counters_only = StepEpilogueArgs(found_inf=found)
        first = counters_only if scale_update is None else _epilogue_args(found, scale_update)
        self.launch.run(first, later_args=counters_only)  # the scale moves once


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
        growth_interval=config.tracked_growth_interval,
        hysteresis=config.tracked_hysteresis,
        force_backoff=update.force_backoff,
    )


KERNELS = KernelBackend()
