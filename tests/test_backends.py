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


def test_kernels_fold_the_unscale_into_the_update_and_leave_grads_scaled(monkeypatch) -> None:
    """One read-only check, one update unscaling in registers: the grads stay as backward left
    them, and the step equals the unscale-in-place path."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
    models[1].load_state_dict(models[0].state_dict())
    x = torch.randn(5, 4)
    results = []
    for model, mode in zip(models, ["emulate", "native"]):
        if mode == "emulate":
            monkeypatch.setenv("SCALEDOPTIM_KERNELS", "emulate")
        else:
            monkeypatch.delenv("SCALEDOPTIM_KERNELS")
        opt = scaledoptim.AdamW(model.parameters(), lr=0.1).configure_scaling(init_scale=1024.0)
        scaledoptim.scale_outputs(model(x).square().sum(), opt.scale).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        _, found_inf, S = opt.unscale_and_step(grads_scaled_by=opt.scale)
        kept = all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
        results.append((kept, [p.detach().clone() for p in model.parameters()]))
    (emulated_kept, emulated), (native_kept, native) = results
    assert emulated_kept and not native_kept
    for a, b in zip(emulated, native):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
