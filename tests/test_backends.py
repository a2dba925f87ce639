"""Which backend runs the fused update, chosen in one place, and that the emulated kernels run."""

from __future__ import annotations

import pytest
import torch

import scaledoptim
from scaledoptim import backends
from scaledoptim.kernels import launcher

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    "mode, cupy, expected",
    [
        (None, True, {CPU: backends.TORCH_NATIVE, CUDA: backends.KERNELS}),
        (None, False, {CPU: backends.TORCH_NATIVE, CUDA: backends.TORCH_NATIVE}),
        ("auto", True, {CPU: backends.TORCH_NATIVE, CUDA: backends.KERNELS}),
        ("emulate", False, {CPU: backends.KERNELS, CUDA: backends.KERNELS}),
        ("torch", True, {CPU: backends.TORCH_NATIVE, CUDA: backends.TORCH_NATIVE}),
        ("cupy", False, {CPU: backends.TORCH_NATIVE, CUDA: backends.KERNELS}),
    ],
)
def test_select_follows_the_environment_and_cupy(monkeypatch, mode, cupy, expected) -> None:
    if mode is None:
        monkeypatch.delenv("SCALEDOPTIM_KERNELS", raising=False)
    else:
        monkeypatch.setenv("SCALEDOPTIM_KERNELS", mode)
    monkeypatch.setattr(backends, "_cupy_installed", lambda: cupy)
    for device, backend in expected.items():
        assert backends.select(device) is backend


def test_an_unknown_mode_is_refused_naming_the_choices(monkeypatch) -> None:
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "gpu")
    with pytest.raises(ValueError, match=r"SCALEDOPTIM_KERNELS='gpu'.*'emulate'"):
        backends.select(CPU)


def test_emulation_switch_sends_the_step_through_the_kernel_launcher(monkeypatch) -> None:
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "emulate")
    launched = []
    run = launcher.PreparedLaunch.run
    monkeypatch.setattr(launcher.PreparedLaunch, "run", lambda self, a: (launched.append(self.kernel.name), run(self, a)))
    model = torch.nn.Linear(4, 2)
    opt = scaledoptim.AdamW(model.parameters())
    scaledoptim.scale_outputs(model(torch.randn(3, 4)).sum(), opt.scale).backward()
    opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert launched == ["non_finite_check_kernel", "adam_kernel", "advance_steps_kernel"]


def test_kernels_fold_the_unscale_into_the_update_and_leave_grads_scaled(monkeypatch) -> None:
    """One read-only check, one update unscaling in registers: the grads stay as backward left
    them, and the step equals the unscale-in-place path."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
    models[1].load_state_dict(models[0].state_dict())
    x = torch.randn(5, 4)
    results = []
    for model, mode in zip(models, ["emulate", "torch"]):
        monkeypatch.setenv("SCALEDOPTIM_KERNELS", mode)
        opt = scaledoptim.AdamW(model.parameters(), lr=0.1).configure_scaling(init_scale=1024.0)
        scaledoptim.scale_outputs(model(x).square().sum(), opt.scale).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.unscale_and_step(grads_scaled_by=opt.scale)
        kept = all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
        results.append((kept, [p.detach().clone() for p in model.parameters()]))
    (emulated_kept, emulated), (native_kept, native) = results
    assert emulated_kept and not native_kept
    for a, b in zip(emulated, native):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
