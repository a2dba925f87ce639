"""A kernel's list layout is declared once, by the names in its Python spec: the per-tensor and
per-chunk indices follow from them, and the C++ enum that sizes its table has one entry per
name."""

from __future__ import annotations

import re

import pytest

from scaledoptim import kernels
from scaledoptim.kernels import STEP_EPILOGUE, MultiTensorKernel, registered_kernels
from scaledoptim.optim.lamb import LAMB_GRAD_NORM_KERNEL, LAMB_KERNEL
from scaledoptim.optim.sgd import SGD_KERNEL


def test_the_indices_follow_from_the_names() -> None:
    count = len(registered_kernels())
    sgd = SGD_KERNEL
    again = MultiTensorKernel(sgd.source, sgd.name, sgd.lists, sgd.args_type, dtype_lists=(0, 1))
    assert again == SGD_KERNEL and len(registered_kernels()) == count  # nothing new registered
    assert again.per_tensor_lists == (4, 5)  # sr_seeds, steps
    assert LAMB_KERNEL.per_tensor_lists == (7, 8)
    assert LAMB_KERNEL.per_chunk_lists == (4, 5)  # param_sq_partials, update_sq_partials
    assert LAMB_GRAD_NORM_KERNEL.per_chunk_lists == (1,)
    assert STEP_EPILOGUE.per_tensor_lists == ()  # list 0 is walked by element, whatever its name


def _enum_entries(source: str, kernel_name: str) -> int:
    """How many lists the table of ``kernel_name`` in ``source`` has: a literal, or the entries
    of the enum before its count."""
    size = re.search(rf"\b{kernel_name}\s*\(\s*TensorTable<(\w+)>", source)
    assert size is not None, kernel_name
    if size.group(1).isdigit():
        return int(size.group(1))
    enum = re.search(rf"enum\s+\w+\s*\{{([^}}]*?)\b{size.group(1)}\b", source)
    assert enum is not None, size.group(1)
    body = re.sub(r"//[^\n]*", "", enum.group(1))
    return len([entry for entry in body.split(",") if entry.strip()])


@pytest.mark.parametrize("kernel", kernels.builtin_kernels(), ids=lambda k: k.name)
def test_the_cuda_table_has_one_list_per_name(kernel: MultiTensorKernel) -> None:
    assert _enum_entries(kernel.source.read_text(), kernel.name) == kernel.n_lists
