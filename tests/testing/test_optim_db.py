"""The optimizer table itself (scaledoptim/testing/optim_db.py): one well-formed row per optimizer,
every fused optimizer of the package in it, importable with torch and scaledoptim alone."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

import scaledoptim
import scaledoptim.optim
from scaledoptim.fused import FusedOptimizer
from scaledoptim.testing.optim_db import optim_db, row, rows
from tests.support.launches import row_update


def test_every_fused_optimizer_of_the_package_has_one_row() -> None:
    exported = {
        getattr(scaledoptim.optim, name)
        for name in scaledoptim.optim.__all__
        if isinstance(getattr(scaledoptim.optim, name), type)
        and issubclass(getattr(scaledoptim.optim, name), FusedOptimizer)
    }
    assert exported <= {info.cls for info in rows(fused=True)}
    names = [info.name for info in optim_db]
    assert len(names) == len(set(names))
    assert all(row(name).name == name for name in names)


@pytest.mark.parametrize("info", optim_db, ids=str)
def test_a_row_is_well_formed(info) -> None:
    assert info.name == info.cls.__name__
    names = [config.name for config in info.configs]
    assert names and len(names) == len(set(names)) and info.default.generic
    signature = inspect.signature(info.cls.__init__)
    takes = set(signature.parameters) - {"self", "params"}
    for config in info.configs:
        assert set(config.kwargs) <= takes, config
        info.make([torch.nn.Parameter(torch.zeros(2))], config)
        if info.reference is not None:
            info.reference_for([torch.nn.Parameter(torch.zeros(2))], config)
    assert set(info.ranges) <= takes


@pytest.mark.parametrize("info", rows(fused=True), ids=str)
def test_a_fused_rows_kernel_and_lists_are_well_formed(info) -> None:
    kernel = info.cls.kernel
    assert kernel.lists[:2] == ("params", "grads") and kernel.lists[-1] == "steps", kernel
    assert kernel.dtype_lists == (0, 1) and kernel.per_tensor_lists[-1] == kernel.n_lists - 1
    assert info.kernels[-1] is kernel and set(info.kernels) <= set(info.launched_kernels)
    assert set(info.mixed_param_dtypes) <= set(info.dtypes)
    for config in info.configs:  # row_update asserts one list per list of the kernel
        row_update(info, [torch.ones(2)], [torch.ones(2)], config)


def test_the_table_imports_with_torch_and_scaledoptim_alone() -> None:
    code = (
        "import sys; sys.modules['hypothesis'] = None; sys.modules['pytest'] = None\n"
        "from scaledoptim.testing.optim_db import optim_db; print(len(optim_db))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == str(len(optim_db)), result.stderr
