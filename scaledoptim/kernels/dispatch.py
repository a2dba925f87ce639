"""``launch``: a multi-tensor launch run now, or as the launch op under ``torch.compile``.

It sits above both the launcher and the launch op (``library.py``, which prepares and runs its
launches through the launcher), so neither imports the other's importer; the op's module loads
only when something compiles.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import Tensor

from .launcher import check_args, prepare_launch
from .spec import MultiTensorKernel

__all__ = ["launch"]


def launch(
    kernel: MultiTensorKernel, tensor_lists: Sequence[Sequence[Tensor]], args: ctypes.Structure
) -> None:
    r"""Runs ``kernel`` over every tensor of ``tensor_lists`` with scalar arguments ``args``.

    Tensors are grouped by the dtypes of ``kernel.dtype_lists`` (one instantiation per group),
    split into chunks of ``launch_config.chunk_size`` elements, and the chunks into as many
    launches as the 4 KB argument table needs. CUDA tensors run through CuPy on torch's current
    stream, asynchronously and with no host sync (the table travels by value in the kernel
    parameters, so a launch can be captured in a CUDA graph); CPU tensors run through the
    emulator and the call returns when they are done. See :func:`prepare_launch` for the rules
    ``tensor_lists`` must follow.

    Under ``torch.compile`` the launch is the custom op of
    :func:`scaledoptim.kernels.library.launch_op`, which the graph holds (no graph break); the
    pointer fields of ``args`` are then constants of the graph: pass device scalars created in
    the compiled function to ``launch_op`` as ``pointers`` instead.
    """
    if torch.compiler.is_compiling():
        from . import library  # loaded only once something compiles

        library.launch_op(kernel, tensor_lists, args)
        return
    check_args(kernel, args)
    prepare_launch(kernel, tensor_lists).run(args)
