"""Which backend runs the fused update, chosen in one place, and that the emulated kernels run."""

from __future__ import annotations

import warnings

import pytest
import torch

import scaledoptim
from scaledoptim.fused import backends
from scaledoptim.kernels import launcher

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture
def fresh_probe(monkeypatch) -> None:
    """No device probed, found lacking or warned about yet."""
    for name, empty in (("_probed", set()), ("_absent", {}), ("_warned", set())):
        monkeypatch.setattr(backends, name, empty)


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
def test_select_follows_the_environment_and_cupy(
    monkeypatch, fresh_probe, mode, cupy, expected
) -> None:
    if mode is None:
        monkeypatch.delenv("SCALEDOPTIM_KERNELS", raising=False)
    else:
        monkeypatch.setenv("SCALEDOPTIM_KERNELS", mode)
    monkeypatch.setattr(backends, "unmet_requirement", lambda device: None if cupy else "no CuPy")
    monkeypatch.setattr(backends, "probe_kernels", lambda device: None)  # kernels work there
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning: its own test below
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
    monkeypatch.setattr(
        launcher.PreparedLaunch,
        "run",
        lambda self, *a, **k: (launched.append(self.kernel.name), run(self, *a, **k)),
    )
    model = torch.nn.Linear(4, 2)
    opt = scaledoptim.AdamW(model.parameters())
    scaledoptim.scale_outputs(model(torch.randn(3, 4)).sum(), opt.scale).backward()
    opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert launched == ["non_finite_check_kernel", "adam_kernel", "step_epilogue_kernel"]


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


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("overflow", [False, True])
def test_a_kernel_step_is_three_launches(monkeypatch, groups, overflow) -> None:
    """One read-only check, one update per argument table, one epilogue that advances the
    counters and moves the scale (no torch op touches the scale)."""
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "emulate")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    param_groups = (
        [{"params": list(m.parameters())} for m in model] if groups == 2 else model.parameters()
    )
    opt = scaledoptim.AdamW(param_groups).configure_scaling(init_scale=2.0**10, growth_interval=1)
    scaledoptim.scale_outputs(model(torch.randn(5, 4)).sum(), opt.scale).backward()
    if overflow:
        model[0].bias.grad[0] = float("nan")
    launches = []
    real_launch = launcher.emulator.launch
    monkeypatch.setattr(
        launcher.emulator,
        "launch",
        lambda kernel, *a: (launches.append(kernel.name), real_launch(kernel, *a)),
    )
    monkeypatch.setattr(
        scaledoptim.scale.LossScale,
        "update_",
        lambda *a, **k: pytest.fail("scale moved by torch ops"),
    )
    _, found_inf, S = opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert launches == [
        "non_finite_check_kernel",
        *["adam_kernel"] * groups,
        "step_epilogue_kernel",
    ]
    assert S.item() == (2.0**9 if overflow else 2.0**11) and found_inf.item() == float(overflow)


def test_a_step_our_kernels_take_no_param_of_moves_the_scale_as_gradscaler(monkeypatch) -> None:
    """On our kernels' backend (the emulator), a step whose params all take torch's route
    (float64: no kernel updates them) advances no counter of the kernels' part, so the
    epilogue launches nothing and moves the scale with torch ops: the scale, the params and the
    step counters are ``torch.optim.Adam`` + ``GradScaler``'s, overflows skipped."""
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "emulate")
    launches: list[str] = []
    real_launch = launcher.emulator.launch
    monkeypatch.setattr(
        launcher.emulator,
        "launch",
        lambda kernel, *a: (launches.append(kernel.name), real_launch(kernel, *a)),
    )
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3).double() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opt = scaledoptim.Adam(models[0].parameters(), lr=0.1).configure_scaling(
        init_scale=2.0**10, growth_interval=2
    )
    ref_opt = torch.optim.Adam(models[1].parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    x = torch.randn(5, 4, dtype=torch.float64)
    for step in range(5):
        overflow = step == 2
        for model in models:
            model.zero_grad()
        scaledoptim.scale_outputs(models[0](x).square().sum(), opt.scale).backward()
        scaler.scale(models[1](x).square().sum()).backward()
        if overflow:
            for model in models:
                model.bias.grad[0] = float("inf")
        _, found_inf, S = opt.unscale_and_step(grads_scaled_by=opt.scale)
        scaler.step(ref_opt)
        scaler.update()
        assert found_inf.item() == float(overflow)
        assert S.item() == scaler.get_scale()
        for ours, ref in zip(*(model.parameters() for model in models)):
            torch.testing.assert_close(ours, ref)
            assert opt.state[ours]["step"].item() == ref_opt.state[ref]["step"].item()
    assert launches == []  # not even the check: no kernel takes a float64 grad
    assert scaler.get_scale() == 2.0**11  # grew (steps 0-1), backed off (2), grew (3-4)


@pytest.mark.parametrize(
    "missing", ["Fused CUDA kernels need CuPy", "NVRTC 13.0 cannot compile for sm_70"]
)
def test_a_missing_piece_of_the_install_falls_back_to_torch_with_one_warning(
    monkeypatch, fresh_probe, missing
) -> None:
    monkeypatch.delenv("SCALEDOPTIM_KERNELS", raising=False)
    asked = []
    monkeypatch.setattr(
        backends, "unmet_requirement", lambda device: asked.append(device) or missing
    )
    monkeypatch.setattr(
        backends,
        "probe_kernels",
        lambda device: pytest.fail("probed an install that lacks a piece"),
    )
    with pytest.warns(
        RuntimeWarning,
        match=rf"cannot run on cuda:0: {missing}.*SCALEDOPTIM_KERNELS=torch silences",
    ):
        assert backends.select(CUDA) is backends.TORCH_NATIVE
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per device, and the install is read once
        assert backends.select(CUDA) is backends.TORCH_NATIVE
    assert asked == [CUDA]
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "cupy")  # forced: no fallback, errors surface
    assert backends.select(CUDA) is backends.KERNELS
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "torch")
    assert backends.select(CUDA) is backends.TORCH_NATIVE


def test_a_failed_probe_raises_every_time_until_it_passes(monkeypatch, fresh_probe) -> None:
    """Not a silent fallback, and not sticky: each step probes again until the kernels run."""
    monkeypatch.delenv("SCALEDOPTIM_KERNELS", raising=False)
    monkeypatch.setattr(backends, "unmet_requirement", lambda device: None)
    probes = []

    def broken(*args, **kwargs):
        probes.append(args)
        raise AttributeError("'cupy._core.raw.RawKernel' object has no attribute 'ptr'")

    monkeypatch.setattr("scaledoptim.fused.backends.probe.non_finite_check_", broken)
    tensor, zeros = torch.tensor, torch.zeros  # the probe's tensors, on the CPU: no CUDA here
    monkeypatch.setattr(torch, "tensor", lambda data, device: tensor(data))
    monkeypatch.setattr(torch, "zeros", lambda shape, device: zeros(shape))
    for attempt in (1, 2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # raised, not warned
            with pytest.raises(
                backends.KernelProbeError,
                match=r"probe launch on cuda:0 \(AttributeError: .*no attribute 'ptr'\)"
                r".*SCALEDOPTIM_KERNELS=torch",
            ) as error:
                backends.select(CUDA)
        assert isinstance(error.value.__cause__, AttributeError) and len(probes) == attempt
    monkeypatch.setattr(
        "scaledoptim.fused.backends.probe.non_finite_check_",
        lambda tensors, found_inf: found_inf.fill_(1.0),
    )
    assert backends.select(CUDA) is backends.KERNELS
    monkeypatch.setattr("scaledoptim.fused.backends.probe.non_finite_check_", broken)
    assert backends.select(CUDA) is backends.KERNELS  # a passed probe is kept
    assert len(probes) == 2


def test_the_probe_launches_the_check_and_reads_its_result(monkeypatch) -> None:
    """The probe itself, on the CPU (through the emulator): it passes; a wrong result raises."""
    backends.probe_kernels(CPU)
    monkeypatch.setattr(
        "scaledoptim.fused.backends.probe.non_finite_check_", lambda tensors, found_inf: None
    )
    with pytest.raises(
        backends.KernelProbeError,
        match=r"found_inf=0.0 where a NaN makes it 1.0.*SCALEDOPTIM_KERNELS=torch",
    ):
        backends.probe_kernels(CPU)
