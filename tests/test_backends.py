"""Which update path the fused optimizers take, and that the emulated kernels really run."""

from __future__ import annotations

import torch

import scaledoptim
from scaledoptim import kernels
from scaledoptim.optim import _fused, _native


def test_cpu_takes_torch_native_ops_unless_emulation_is_requested(monkeypatch) -> None:
    monkeypatch.delenv("SCALEDOPTIM_KERNELS", raising=False)
    assert _fused.backend_for(torch.device("cpu")) is _native
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "emulate")
    assert _fused.backend_for(torch.device("cpu")) is kernels


def test_cuda_takes_our_kernels_when_cupy_is_installed(monkeypatch) -> None:
    monkeypatch.delenv("SCALEDOPTIM_KERNELS", raising=False)
    monkeypatch.setattr(_fused, "_cupy_installed", lambda: True)
    assert _fused.backend_for(torch.device("cuda", 0)) is kernels
    monkeypatch.setattr(_fused, "_cupy_installed", lambda: False)
    assert _fused.backend_for(torch.device("cuda", 0)) is _native


def test_emulation_switch_sends_the_step_through_the_kernel_launcher(monkeypatch) -> None:
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "emulate")
    launched = []
    real_launch = kernels.ops.launch
    monkeypatch.setattr(kernels.ops, "launch", lambda k, *a: (launched.append(k.name), real_launch(k, *a)))
    model = torch.nn.Linear(4, 2)
    opt = scaledoptim.AdamW(model.parameters())
    scaledoptim.scale_outputs(model(torch.randn(3, 4)).sum(), opt.scale).backward()
    opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert any("adam" in name for name in launched)
