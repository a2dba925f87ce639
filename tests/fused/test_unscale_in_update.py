"""On a CPU, a clipping step of the torch backend leaves fp32 grads scaled for torch's fused
Adam(W)/SGD/Adagrad to unscale and clip where they read them, after a check that reads them once
for their norm, with no host read (Note [unscale in the update on a CPU] in
scaledoptim/fused/backends/routes.py): the same steps as GradScaler + clip_grad_norm_ +
torch's fused optimizers and as the unscale-in-place path, except that finite grads whose norm is
past float32's range count as an overflow. A step that does not clip unscales in place.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scaledoptim
from scaledoptim.doctor.sync_free import HOST_READS, HostRead
from scaledoptim.fused.backends import routes
from scaledoptim.fused.backends.torch_native import decide_skips_on_device
from tests.support.references import kernels_mode

SHAPES = [(7, 5), (5,), (3, 4, 2)]

FOLDING: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "AdamW": lambda ps: scaledoptim.AdamW(ps, lr=1e-2),
    "Adam-amsgrad": lambda ps: scaledoptim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.1),
    "SGD-momentum": lambda ps: scaledoptim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    "SGD-dampening": lambda ps: scaledoptim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.3),
    "SGD": lambda ps: scaledoptim.SGD(ps, lr=1e-2),
    "Adagrad": lambda ps: scaledoptim.Adagrad(ps, lr=1e-1, lr_decay=1e-3, weight_decay=0.1),
}
TORCH = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "Adam-amsgrad": lambda ps: torch.optim.Adam(
        ps, lr=1e-2, amsgrad=True, weight_decay=0.1, fused=True
    ),
    "SGD-momentum": lambda ps: torch.optim.SGD(
        ps, lr=1e-2, momentum=0.9, nesterov=True, fused=True
    ),
    "SGD-dampening": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.3),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-2, fused=True),
    "Adagrad": lambda ps: torch.optim.Adagrad(
        ps, lr=1e-1, lr_decay=1e-3, weight_decay=0.1, fused=True
    ),
}


def _params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).requires_grad_() for shape in SHAPES]


def _grads(step: int, scale: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=gen) * scale for shape in SHAPES]


@pytest.fixture
def exact_path_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the in-place unscales of fp32 grads (the exact path) of the torch backend."""
    calls: list[int] = []
    unscale = routes.unscale_dense_

    def counting(*args: object) -> None:
        calls.append(1)
        unscale(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(routes, "unscale_dense_", counting)
    return calls


@contextlib.contextmanager
def host_reads_refused() -> Iterator[None]:
    """Every host read of a tensor raises inside (the engine left as it is: its CPU form runs)."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise HostRead("host read")

    with pytest.MonkeyPatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, refuse)
        yield


@pytest.mark.parametrize("clip", [None, 0.1], ids=["no-clip", "clip"])
@pytest.mark.parametrize("name", list(FOLDING))
def test_steps_as_gradscaler_and_torchs_fused_optimizer_without_unscaling_first(
    name: str, clip: float | None, exact_path_calls: list[int]
) -> None:
    params, ref_params = _params(), _params()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    scaler.scale(torch.ones(()))  # creates its scale: the grads below come scaled already
    ref_opt = TORCH[name](ref_params)
    with kernels_mode("torch"):
        opt = FOLDING[name](params).configure_scaling(init_scale=2.0**12)  # type: ignore[attr-defined]
        for step in range(4):
            S = opt.scale
            for p, ref_p, g in zip(params, ref_params, _grads(step, S.item())):
                p.grad, ref_p.grad = g.clone(), g.clone()
            _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=S, max_grad_norm=clip)
            scaler.unscale_(ref_opt)
            if clip is not None:
                ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, clip)
                torch.testing.assert_close(opt.grad_norm, ref_norm, rtol=1e-6, atol=0)
            scaler.step(ref_opt)
            scaler.update()
            assert found_inf.item() == 0.0 and opt.scale.item() == scaler.get_scale()
            for p, ref_p in zip(params, ref_params):
                torch.testing.assert_close(p, ref_p, rtol=1e-6, atol=1e-7)
                # torch's fused ops leave the grads unscaled (and clipped), as GradScaler does
                assert p.grad is not None and ref_p.grad is not None
                torch.testing.assert_close(p.grad, ref_p.grad, rtol=1e-6, atol=0)
    # a clipping step's check is the one read; a step without clipping unscales in place
    assert (exact_path_calls == []) == (clip is not None)


def _run(
    name: str,
    grads: list[torch.Tensor],
    scale: float,
    clip: float | None,
    exact: bool,
) -> tuple[torch.optim.Optimizer, torch.Tensor, list[torch.Tensor]]:
    params = _params()
    with kernels_mode("torch"):
        opt = FOLDING[name](params).configure_scaling(init_scale=scale)  # type: ignore[attr-defined]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if exact:  # the sync-free form: no host read, so the exact path
            with decide_skips_on_device():
                _, found_inf, _ = opt.unscale_and_step(
                    grads_scaled_by=opt.scale, max_grad_norm=clip
                )
        else:
            _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale, max_grad_norm=clip)
    return opt, found_inf, params


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(list(FOLDING)),
    scale_exp=st.integers(-24, 24),
    grad_exp=st.integers(-40, 126),
    bad=st.sampled_from([None, math.inf, -math.inf, math.nan]),
    where=st.integers(0, 10_000),
    clip=st.sampled_from([None, 0.1, 1e30]),
)
def test_decides_as_the_exact_path_whatever_the_grads(
    name: str,
    scale_exp: int,
    grad_exp: int,
    bad: float | None,
    where: int,
    clip: float | None,
) -> None:
    """Random scales (below 1 too), grad magnitudes up to past float32's range once squared or
    unscaled, an inf or nan anywhere: found_inf, the scale, the norm and the params are those of
    the unscale-in-place path, but where the norm is past the range (an overflow here)."""
    grads = _grads(0, 2.0**grad_exp)
    if bad is not None:
        flat = torch.cat([g.view(-1) for g in grads])
        index = where % flat.numel()
        for g in grads:
            if index < g.numel():
                g.view(-1)[index] = bad
                break
            index -= g.numel()
    scale = 2.0**scale_exp
    opt, found_inf, params = _run(name, grads, scale, clip, exact=False)
    ref_opt, ref_found_inf, ref_params = _run(name, grads, scale, clip, exact=True)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) / scale
    past_range = not norm.item() < routes._FOLD_NORM_LIMIT
    if clip is not None and ref_found_inf.item() == 0.0 and past_range:
        # finite grads past the range: an overflow here, skipped and backed off
        assert found_inf.item() == 1.0 and opt.scale.item() == scale / 2  # type: ignore[attr-defined]
        assert all(torch.equal(p, q) for p, q in zip(params, _params()))
        return
    assert found_inf.item() == ref_found_inf.item()
    assert opt.scale.item() == ref_opt.scale.item()  # type: ignore[attr-defined]
    if clip is not None:
        norm, ref_norm = opt.grad_norm, ref_opt.grad_norm  # type: ignore[attr-defined]
        if math.isfinite(ref_norm.item()):
            torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        else:
            assert not math.isfinite(norm.item())
    for p, ref_p in zip(params, ref_params):
        torch.testing.assert_close(p, ref_p, rtol=1e-6, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("clip", [0.1, 1e30], ids=["clip-bites", "clip-does-not-bite"])
@pytest.mark.parametrize(
    ("grad", "scale", "skipped"),
    [
        (math.inf, 2.0**16, True),
        (math.nan, 2.0**16, True),
        (1e30, 2.0**16, True),  # finite, but its square is past float32: an overflow here
        (1e18, 2.0**-70, True),  # a finite norm, inf once unscaled (a scale below 1)
        (1e35, 2.0**-20, True),  # finite, inf once unscaled
        (1.0, 2.0**-20, False),  # a scale below 1 alone is no overflow
    ],
    ids=["inf", "nan", "norm-past-range", "unscaled-norm-past-range", "unscaled-inf", "below-1"],
)
def test_overflows_are_found_on_device_with_the_grads_left_scaled(
    grad: float, scale: float, skipped: bool, clip: float | None, exact_path_calls: list[int]
) -> None:
    grads = _grads(0, 1.0)
    grads[1].view(-1)[2] = grad
    params = _params()
    with kernels_mode("torch"):
        opt = scaledoptim.AdamW(params, lr=1e-2).configure_scaling(init_scale=scale)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        with host_reads_refused():
            _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale, max_grad_norm=clip)
    assert exact_path_calls == []  # no unscale in place
    assert found_inf.item() == float(skipped)
    assert opt.scale.item() == (scale / 2 if skipped else scale)
    unchanged = all(torch.equal(p, q) for p, q in zip(params, _params()))
    assert unchanged == skipped
    if skipped:  # a skipped step leaves the grads as backward left them, scaled
        for p, g in zip(params, grads):
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)


def test_sixteen_bit_params_and_other_updates_unscale_first(exact_path_calls: list[int]) -> None:
    """Working copies (16-bit params) and torch forms without a grad_scale (RMSprop) read
    grads unscaled in place."""
    with kernels_mode("torch"):
        for make, dtype in [
            (lambda ps: scaledoptim.AdamW(ps, lr=1e-2), torch.bfloat16),
            (lambda ps: scaledoptim.RMSprop(ps, lr=1e-2), torch.float32),
        ]:
            params = [p.detach().to(dtype).requires_grad_() for p in _params()]
            opt = make(params)
            for p, g in zip(params, _grads(0, opt.scale.item())):
                p.grad = g.float() if dtype == torch.float32 else g.to(dtype)
            opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert len(exact_path_calls) == 1  # the fp32 RMSprop step; bf16 grads take unscale_in_place_
