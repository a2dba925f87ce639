"""The overflow a scale below 1 makes while unscaling is caught, and the pass that catches it runs
only where it can find one (Note [overflow after unscaling] in torch_ops/skip.py): on a CPU the
scale is read on the host, and at a scale of at least 1 the grads are checked and unscaled in one
pass; with host reads off (a GPU's sync-free step) the second pass always runs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import scaledoptim
from scaledoptim.fused.backends.torch_native import decide_skips_on_device

CHECK = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
#: A finite float32 grad that overflows when unscaled at a scale of 2**-20 (1e33 * 2**20 > 3.4e38).
LARGE = 1e33


class CountChecks(TorchDispatchMode):
    """Counts the calls of torch's check-and-unscale op inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += func is CHECK
        return func(*args, **(kwargs or {}))


def _unscale_and_step(opt: scaledoptim.Optimizer, scale: torch.Tensor) -> torch.Tensor:
    return opt.unscale_and_step(grads_scaled_by=scale)[1]


def _split(opt: scaledoptim.Optimizer, scale: torch.Tensor) -> torch.Tensor:
    found_inf, _ = opt.unscale(grads_scaled_by=scale)
    opt.step_after_unscale()
    return found_inf


def _fused(params: list[torch.Tensor]) -> scaledoptim.Optimizer:
    return scaledoptim.AdamW(params, lr=1e-2)


def _generic(params: list[torch.Tensor]) -> scaledoptim.Optimizer:
    return scaledoptim.with_scaling(torch.optim.SGD)(params, lr=1e-2)  # type: ignore[return-value]


#: (optimizer, params' dtype, the step): every route of the unscale on a CPU's torch backend.
ROUTES: dict[str, tuple[Callable[[list[torch.Tensor]], scaledoptim.Optimizer], torch.dtype,
                        Callable[[scaledoptim.Optimizer, torch.Tensor], torch.Tensor]]] = {
    "fused-fp32": (_fused, torch.float32, _unscale_and_step),
    "fused-bf16": (_fused, torch.bfloat16, _unscale_and_step),
    "fused-split": (_fused, torch.float32, _split),
    "generic": (_generic, torch.float32, _unscale_and_step),
    "generic-split": (_generic, torch.float32, _split),
}


def _setup(route: str, scale: float) -> tuple[scaledoptim.Optimizer, list[torch.Tensor]]:
    make, dtype, _ = ROUTES[route]
    params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in (5, 300, 7)]
    opt = make(params)
    opt.configure_scaling(init_scale=scale)
    for p in params:
        p.grad = torch.randn(p.shape).to(dtype) * scale
    return opt, params


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SCALEDOPTIM_KERNELS", raising=False)  # a CPU's default: torch's ops


@pytest.mark.parametrize("host_reads", [True, False], ids=["cpu", "sync-free"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_an_overflow_made_by_unscaling_at_a_scale_below_one_is_caught(
    route: str, host_reads: bool
) -> None:
    scale = 2.0**-20
    opt, params = _setup(route, scale)
    assert params[1].grad is not None
    params[1].grad[17] = LARGE  # finite as it is, inf once divided by the scale
    before = [p.detach().clone() for p in params]
    if host_reads:
        found_inf = ROUTES[route][2](opt, opt.scale)
    else:
        with decide_skips_on_device():
            found_inf = ROUTES[route][2](opt, opt.scale)
    assert found_inf.item() == 1.0
    assert opt.scale.item() == scale / 2  # backed off
    for p, b in zip(params, before):
        assert torch.equal(p, b)  # the step was skipped


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize(
    ("scale", "host_reads", "passes"),
    [(2.0**16, True, 1), (1.0, True, 1), (2.0**-4, True, 2), (2.0**16, False, 2)],
    ids=["scale-above-1", "scale-1", "scale-below-1", "sync-free"],
)
def test_the_second_pass_runs_only_where_a_scale_below_one_can_overflow(
    route: str, scale: float, host_reads: bool, passes: int
) -> None:
    opt, _ = _setup(route, scale)
    counter = CountChecks()
    if host_reads:
        with counter:
            found_inf = ROUTES[route][2](opt, opt.scale)
    else:
        with decide_skips_on_device(), counter:
            found_inf = ROUTES[route][2](opt, opt.scale)
    assert found_inf.item() == 0.0
    assert counter.calls == passes
