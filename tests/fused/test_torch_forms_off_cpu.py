"""The torch forms (``SCALEDOPTIM_KERNELS=torch``, and CUDA's fallback without CuPy) never read the
host off a CPU, so they are sync-free and CUDA-graph capturable there, checked without a GPU.

Params on the ``meta`` device stand in for a GPU's: they have no values to read, and a dispatch
mode fails every op that reads a tensor on the host or touches a CPU tensor (a counter or a
constant on the CPU, a copy either way). On the CPU, inside ``no_host_reads`` (the torch forms
skip on device there too, Note [host skip]), the same mode watches the host reads a Python patch
cannot see (the argument parser's ``.item()`` of a 0-dim tensor passed as a Scalar), with values:
an inf step is skipped, a clean one updates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from scaledoptim.doctor.sync_free import no_host_reads
from scaledoptim.testing.optim_db import LOW_AND_FULL, Config, OptimInfo, rows

_HOST_READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.item.default,
    torch.ops.aten.is_nonzero.default,
}

CASES = [
    pytest.param(info, config, id=f"{info.name}-{config.name}")
    for info in rows(fused=True)
    for config in info.generic_configs
]


class DeviceOnly(TorchDispatchMode):
    """Fails an op that reads a tensor on the host, or, for a ``device`` other than the CPU, an
    op with a CPU tensor among its inputs or outputs."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            pytest.fail(f"host read: {func}")
        out = func(*args, **(kwargs or {}))
        if self.device.type != "cpu":
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            on_cpu = [tuple(t.shape) for t in tensors if t.device.type == "cpu"]
            if on_cpu:
                pytest.fail(
                    f"{func} mixes CPU tensors of shapes {on_cpu} into a {self.device} step"
                )
        return out


@contextlib.contextmanager
def no_tensors_from_python(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> Iterator[None]:
    """``torch.tensor``/``torch.as_tensor`` of Python values on ``device`` fail: a copy from the
    host (a sync on a GPU, and a value a captured graph would replay forever)."""
    with monkeypatch.context() as patch:
        for name in ("tensor", "as_tensor"):
            real = getattr(torch, name)

            def refusing(data: Any, *args: Any, real=real, name=name, **kwargs: Any) -> Any:
                if torch.device(kwargs.get("device") or "cpu").type != "cpu":
                    pytest.fail(f"torch.{name}({data!r}, device={kwargs['device']}) in the step")
                return real(data, *args, **kwargs)

            patch.setattr(torch, name, refusing)
        yield


@pytest.fixture
def meta_fused_ops() -> Iterator[None]:
    """No-op Meta kernels for torch's fused SGD and Adagrad, which have none (in place, a meta
    update has nothing to compute)."""
    library = torch.library.Library("aten", "IMPL")
    for name in ("_fused_sgd_", "_fused_adagrad_"):
        library.impl(name, lambda *args, **kwargs: None, "Meta")
    yield
    library._destroy()


@pytest.mark.parametrize(("info", "config"), CASES)
def test_torch_forms_touch_no_host_tensor_off_a_cpu(
    info: OptimInfo, config: Config, monkeypatch, meta_fused_ops
) -> None:
    """In every param dtype."""
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "torch")
    for dtype in LOW_AND_FULL:
        _no_host_tensor_off_a_cpu(info, config, dtype, monkeypatch)


def _no_host_tensor_off_a_cpu(
    info: OptimInfo, config: Config, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta = torch.device("meta")
    params = [torch.nn.Parameter(torch.empty(n, dtype=dtype, device=meta)) for n in (3, 40)]
    opt = info.make(params, config)
    scale = opt.scale
    for step in range(3):
        for p in params:
            p.grad = torch.empty_like(p)
        if step == 0:  # creates the state (CPU seeds, counters moved once): outside the watch
            opt.unscale_and_step(grads_scaled_by=scale)
            continue
        with DeviceOnly(meta), no_tensors_from_python(monkeypatch, meta):
            if step == 2 and dtype != torch.float16:  # unscale() refuses fp16 grads in place
                found_inf, scale = opt.unscale(grads_scaled_by=scale)
                opt.step_after_unscale()
            else:
                _, found_inf, scale = opt.unscale_and_step(grads_scaled_by=scale)
    assert found_inf.device == meta and scale.device == meta
    assert all(s["step"].device == meta for s in opt.state.values())


@pytest.mark.parametrize(("info", "config"), CASES)
def test_torch_forms_skip_on_device_without_a_host_read(
    info: OptimInfo, config: Config, monkeypatch
) -> None:
    """In every param dtype."""
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "torch")
    for dtype in LOW_AND_FULL:
        _skips_on_device(info, config, dtype, monkeypatch)


def _skips_on_device(
    info: OptimInfo, config: Config, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=generator).to(dtype)) for n in (3, 40)]
    opt = info.make(params, config)
    scale = opt.scale
    for step in range(4):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=generator) * 1024).to(dtype)
        if step == 2:
            params[1].grad[5] = float("inf")  # type: ignore[index]  # set above
        before = [p.detach().clone() for p in params]
        with no_host_reads(), DeviceOnly(cpu), no_tensors_from_python(monkeypatch, cpu):
            _, found_inf, scale = opt.unscale_and_step(grads_scaled_by=scale)
        assert found_inf.item() == float(step == 2)
        changed = any(not torch.equal(b, p) for b, p in zip(before, params))
        assert changed == (step != 2)
    assert all(s["step"].item() == 3 for s in opt.state.values())
