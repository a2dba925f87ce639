"""The public multi-tensor launcher: tensor lists in, one or more kernel launches out."""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

from . import cuda_backend, emulator
from .config import launch_config
from .spec import CUDA_TYPE_NAMES, MultiTensorKernel
from .table import PlannedLaunch, plan_launches

__all__ = ["launch"]

# Tables are rebuilt only when a tensor set's data pointers (or sizes, dtypes, chunk size)
# change; an optimizer reuses the same few sets every step.
_PLAN_CACHE_SIZE = 64
_plans: OrderedDict[tuple, list[tuple[str, PlannedLaunch]]] = OrderedDict()


def launch(
    kernel: MultiTensorKernel, tensor_lists: Sequence[Sequence[Tensor]], args: ctypes.Structure
) -> None:
    r"""Runs ``kernel`` over every tensor of ``tensor_lists`` with scalar arguments ``args``.

    Tensors are grouped by the dtypes of ``kernel.dtype_lists`` (one instantiation per group),
    split into chunks of ``launch_config.chunk_size`` elements, and the chunks into as many
    launches as the 4 KB argument table needs. CUDA tensors run through CuPy on torch's current
    stream, asynchronously and with no host sync (the table travels by value in the kernel
    parameters, so a launch can be captured in a CUDA graph); CPU tensors run through the
    emulator and the call returns when they are done.

    Args:
        kernel: the kernel to run.
        tensor_lists: ``kernel.n_lists`` lists, each empty (the kernel gets null pointers and
            must not read that list) or as long as the first. All tensors are contiguous and on
            one device; tensor ``i`` of every list has ``tensor_lists[0][i].numel()`` elements,
            except in ``kernel.per_tensor_lists`` where it has one.
        args: an instance of ``kernel.args_type``; device scalars go in as ``data_ptr()``.

    The tensor set is validated when its table is built, i.e. at the first launch and after any
    data pointer changes.
    """
    if len(tensor_lists) != kernel.n_lists:
        raise ValueError(
            f"{kernel.name} takes {kernel.n_lists} tensor lists {kernel.lists}, "
            f"got {len(tensor_lists)}"
        )
    if not isinstance(args, kernel.args_type):
        raise TypeError(
            f"{kernel.name} takes args of type {kernel.args_type.__name__}, "
            f"got {type(args).__name__}"
        )
    first = tensor_lists[0]
    if not first:
        return
    device = first[0].device
    for planned_instantiation, planned in _planned_launches(kernel, tensor_lists):
        params = (ctypes.c_void_p * 2)(ctypes.addressof(planned.table), ctypes.addressof(args))
        if device.type == "cuda":
            cuda_backend.launch(
                kernel,
                planned_instantiation,
                params,
                planned.n_chunks,
                launch_config.threads_per_block,
                device,
            )
        else:
            emulator.launch(
                kernel,
                planned_instantiation,
                params,
                planned.n_chunks,
                launch_config.emulator_threads_per_block,
            )


def _planned_launches(
    kernel: MultiTensorKernel, tensor_lists: Sequence[Sequence[Tensor]]
) -> list[tuple[str, PlannedLaunch]]:
    first = tensor_lists[0]
    key = (
        kernel,
        launch_config.chunk_size,
        tuple(t.data_ptr() for tensors in tensor_lists for t in tensors),
        tuple(t.numel() for t in first),
        tuple(
            tensor_lists[i][j].dtype
            for i in kernel.dtype_lists
            if tensor_lists[i]
            for j in range(len(first))
        ),
    )
    plans = _plans.get(key)
    if plans is None:
        launch_config.validate()
        _validate(kernel, tensor_lists)
        plans = _build_plans(kernel, tensor_lists)
        _plans[key] = plans
        if len(_plans) > _PLAN_CACHE_SIZE:
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    return plans


def _build_plans(
    kernel: MultiTensorKernel, tensor_lists: Sequence[Sequence[Tensor]]
) -> list[tuple[str, PlannedLaunch]]:
    groups: dict[tuple[torch.dtype, ...], list[int]] = {}
    for i in range(len(tensor_lists[0])):
        dtypes = tuple(tensor_lists[j][i].dtype for j in kernel.dtype_lists)
        groups.setdefault(dtypes, []).append(i)
    plans = []
    for dtypes, indices in groups.items():
        pointers = [
            [tensors[i].data_ptr() if tensors else 0 for tensors in tensor_lists] for i in indices
        ]
        sizes = [tensor_lists[0][i].numel() for i in indices]
        for planned in plan_launches(pointers, sizes, kernel.n_lists, launch_config.chunk_size):
            plans.append((kernel.instantiation(dtypes), planned))
    return plans


def _validate(kernel: MultiTensorKernel, tensor_lists: Sequence[Sequence[Tensor]]) -> None:
    first = tensor_lists[0]
    device = first[0].device
    if device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"{kernel.name} runs on CUDA tensors (CPU tensors through the emulator), got {device}"
        )
    for list_index, (list_name, tensors) in enumerate(zip(kernel.lists, tensor_lists)):
        if tensors and len(tensors) != len(first):
            raise ValueError(
                f"{kernel.name}: {list_name} has {len(tensors)} tensors but {kernel.lists[0]} has "
                f"{len(first)}; pass one tensor per tensor of {kernel.lists[0]}, or an empty list"
            )
        allowed = CUDA_TYPE_NAMES if list_index in kernel.dtype_lists else (torch.float32,)
        per_tensor = list_index in kernel.per_tensor_lists
        for i, t in enumerate(tensors):
            where = f"{kernel.name}: {list_name}[{i}]"
            if t.device != device:
                raise ValueError(
                    f"{where} is on {t.device} but {kernel.lists[0]}[0] is on {device}"
                )
            if t.dtype not in allowed:
                raise TypeError(f"{where} has dtype {t.dtype}; expected one of {list(allowed)}")
            if not is_dense(t) or (not per_tensor and t.stride() != first[i].stride()):
                raise ValueError(
                    f"{where} is not dense with the layout of {kernel.lists[0]}[{i}]; kernels "
                    "walk storage flat, so pass .contiguous() tensors (or all channels_last)"
                )
            expected = 1 if per_tensor else first[i].numel()
            if t.numel() != expected:
                raise ValueError(f"{where} has {t.numel()} elements, expected {expected}")


def is_dense(t: Tensor) -> bool:
    """Whether ``t`` covers its storage span with no gaps or overlaps in a standard layout, so
    that an elementwise kernel may walk it as a flat array from ``data_ptr``."""
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return True
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return True
    return t.is_contiguous()

