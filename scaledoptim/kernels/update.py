"""Running an update kernel the way every fused optimizer does: the update, then its counters."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

from torch import Tensor

from .builtin import STEP_EPILOGUE, StepEpilogueArgs
from .launcher import prepare_launch, scalar_pointer
from .spec import MultiTensorKernel

__all__ = ["launch_update"]


def launch_update(
    kernel: MultiTensorKernel,
    tensor_lists: Sequence[Sequence[Tensor]],
    found_inf: Tensor | None,
    inv_scale: Tensor | None,
    make_args: Callable[[int | None, int | None], ctypes.Structure],
) -> None:
    r"""Launches an update ``kernel`` over ``tensor_lists`` (params first, step counters last)
    with ``make_args(found_inf_pointer, inv_scale_pointer)``, then advances the counters.

    Both launches are validated before either runs.
    """
    if not tensor_lists[0]:
        return
    device = tensor_lists[0][0].device
    update, advance = (
        prepare_launch(kernel, tensor_lists),
        prepare_launch(STEP_EPILOGUE, [tensor_lists[-1]]),
    )
    found = scalar_pointer(found_inf, "found_inf", device)
    args = make_args(found, scalar_pointer(inv_scale, "inv_scale", device))
    update.run(args)
    advance.run(StepEpilogueArgs(found_inf=found))  # See Note [step counters]: after the update
