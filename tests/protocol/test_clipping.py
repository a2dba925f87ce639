"""``unscale_and_step(grads_scaled_by=S, max_grad_norm=c)``: what the parity table (tests/parity:
every optimizer, dtype and backend clipped as ``GradScaler.unscale_`` + ``clip_grad_norm_`` +
``step`` + ``update``, ``opt.grad_norm`` the norm ``clip_grad_norm_`` returns) does not see:
a clip that does not bite is today's step bit for bit, torch's fused AdamW, bad ``max_grad_norm``,
grads not scaled, the norm across backends, closures and generic optimizers (Note [clipping in
the step] in scaledoptim/protocol/clipping.py).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import scaledoptim
from scaledoptim.testing.optim_db import OptimInfo, rows
from tests.support.references import kernels_mode
from tests.support.training import assert_bit_identical, loss_of, make_model, snapshot

OVERFLOW_AT = {2: float("inf"), 5: float("nan")}
ROWS = [pytest.param(info, id=info.name) for info in rows(closure=False)]
BACKENDS = ["torch", "emulate"]


def _inject(model: torch.nn.Module, step: int) -> None:
    if step in OVERFLOW_AT:
        param = list(model.parameters())[step % 4]
        param.grad.view(-1)[0] = OVERFLOW_AT[step]


def _gradscaler_clip_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    step: int,
    max_grad_norm: float,
) -> torch.Tensor:
    """torch's recipe: scaled backward, unscale_, clip_grad_norm_, step, update; the norm."""
    opt.zero_grad()
    scaler.scale(loss_of(model, step)).backward()
    _inject(model, step)
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    scaler.step(opt)
    scaler.update()
    return norm


def _clipping_step(
    model: torch.nn.Module, opt: scaledoptim.Optimizer, step: int, max_grad_norm: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ours: scaled backward, unscale_and_step(max_grad_norm=...); ``(found_inf, S)``."""
    opt.zero_grad()
    scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
    _inject(model, step)
    _, found_inf, S = opt.unscale_and_step(grads_scaled_by=opt.scale, max_grad_norm=max_grad_norm)
    return found_inf, S


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("info", ROWS)
def test_a_clip_that_does_not_bite_is_todays_step_bit_for_bit(
    info: OptimInfo, backend: str
) -> None:
    with kernels_mode(backend):
        models = make_model(), make_model()
        opts = [info.make(m.parameters()) for m in models]
        for step in range(4):
            for model, opt, clip in zip(models, opts, (None, 1e30)):
                _clipping_step(model, opt, step, clip)
        assert_bit_identical(snapshot(opts[0]), snapshot(opts[1]))


def test_the_torch_backend_clips_as_gradscaler_and_fused_adamw() -> None:
    """One process, fp32 grads on a CPU: the same norm bit for bit; the update within float32
    rounding of GradScaler's (torch's fused AdamW divides the scaled grads by ``S / coef``
    where GradScaler multiplies by ``1 / S``, then by ``coef``: Note [unscale in the update on
    a CPU] in fused/backends/routes.py)."""
    ref_model, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with kernels_mode("torch"):
        opt = scaledoptim.AdamW(model.parameters(), lr=1e-2).configure_scaling(init_scale=2.0**10)
        for step in range(5):
            ref_norm = _gradscaler_clip_step(ref_model, ref_opt, scaler, step, 0.1)
            _clipping_step(model, opt, step, 0.1)
            assert torch.equal(opt.grad_norm, ref_norm)
            for ref_p, p in zip(ref_model.parameters(), model.parameters()):
                torch.testing.assert_close(p, ref_p, rtol=1e-6, atol=1e-7)


BAD = [
    pytest.param(-1.0, ValueError, id="negative"),
    pytest.param(-(2**70), ValueError, id="negative-past-int64"),
    pytest.param(10**400, ValueError, id="past-float"),
    pytest.param(float("nan"), ValueError, id="nan"),
    pytest.param(float("inf"), ValueError, id="inf"),
    pytest.param(True, TypeError, id="bool"),
    pytest.param("1.0", TypeError, id="str"),
    pytest.param(torch.tensor(1.0), TypeError, id="tensor"),
]


@pytest.mark.parametrize(("value", "error"), BAD)
@pytest.mark.parametrize("closure", [False, True])
def test_a_bad_max_grad_norm_is_refused_before_anything_changes(
    value: object, error: type[Exception], closure: bool
) -> None:
    model = make_model()
    opt = scaledoptim.AdamW(model.parameters())
    for step in range(2):
        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
        if step == 0:
            opt.unscale_and_step(grads_scaled_by=opt.scale, max_grad_norm=1.0)
    before = snapshot(opt) + [p.grad.clone() for p in model.parameters()]
    norm = opt.grad_norm

    def evaluate(S: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the closure ran")

    with pytest.raises(error, match="max_grad_norm"):
        if closure:
            opt.unscale_and_step(evaluate, grads_scaled_by=opt.scale, max_grad_norm=value)  # type: ignore[arg-type]
        else:
            opt.unscale_and_step(grads_scaled_by=opt.scale, max_grad_norm=value)  # type: ignore[arg-type]
    assert_bit_identical(before, snapshot(opt) + [p.grad for p in model.parameters()])
    assert opt.grad_norm is norm
    opt.unscale_and_step(grads_scaled_by=opt.scale, max_grad_norm=1.0)  # still usable


def _clipped_run(backend: str, max_grad_norm: object) -> tuple[list[torch.Tensor], object]:
    with kernels_mode(backend):
        model = make_model()
        opt = scaledoptim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            opt.zero_grad()
            scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
            opt.unscale_and_step(grads_scaled_by=opt.scale, max_grad_norm=max_grad_norm)  # type: ignore[arg-type]
    norm = None if opt.grad_norm is None else opt.grad_norm.clone()
    return snapshot(opt), norm


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("given", "same_as"),
    [
        pytest.param(0, None, id="int-zero"),
        pytest.param(0.0, None, id="zero"),
        pytest.param(Fraction(1, 20), 0.05, id="fraction"),
        pytest.param(2**70, float(2**70), id="int-past-int64"),
    ],
)
def test_max_grad_norm_is_converted_once_at_validation(
    backend: str, given: object, same_as: float | None
) -> None:
    """0 means no clipping (the Trainer's and nanoGPT's habit); any other Python number is the
    float it converts to, so nothing that passed validation fails later for its type."""
    params, norm = _clipped_run(backend, given)
    expected_params, expected_norm = _clipped_run(backend, same_as)
    assert_bit_identical(expected_params, params)
    if same_as is None:
        assert norm is None and expected_norm is None
    else:
        assert_bit_identical([expected_norm], [norm])  # type: ignore[list-item]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=12, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=4),
    log_magnitude=st.floats(-12.0, 6.0),
    log_scale=st.integers(-4, 16),
    seed=st.integers(0, 2**16),
)
def test_grad_norm_is_the_norm_clip_grad_norm_returns(
    backend: str, sizes: list[int], log_magnitude: float, log_scale: int, seed: int
) -> None:
    """Of the unscaled grads, over every grad (several chunks of the kernels' check, several
    tensors), at any scale and magnitude."""
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=gen) * 10.0**log_magnitude for n in sizes]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    S = 2.0**log_scale
    with kernels_mode(backend):
        opt = scaledoptim.SGD(params, lr=0.1)
        for p, g in zip(params, grads):
            p.grad = g * S
        opt.unscale_and_step(grads_scaled_by=S, max_grad_norm=1.0)
    expected = torch.nn.utils.get_total_norm(grads)
    torch.testing.assert_close(opt.grad_norm, expected, rtol=1e-5, atol=0)
    coef = torch.clamp(1.0 / (expected + 1e-6), max=1.0)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p, -0.1 * g * coef, rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unscaled_grads_are_clipped_and_nothing_is_skipped(backend: str) -> None:
    """``grads_scaled_by=None`` (bf16 or fp32 training): clipping as clip_grad_norm_ + step."""
    with kernels_mode(backend):
        param = torch.nn.Parameter(torch.zeros(3))
        opt = scaledoptim.SGD([param], lr=1.0)
        param.grad = torch.tensor([3.0, 4.0, 0.0])
        _, found_inf, S = opt.unscale_and_step(max_grad_norm=1.0)
    assert S is None and found_inf.item() == 0.0
    assert opt.grad_norm.item() == 5.0
    torch.testing.assert_close(param, torch.tensor([-0.6, -0.8, 0.0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_norm_counts_the_grads_checked_during_backward(backend: str) -> None:
    """``check_during_backward`` folds some grads into found_inf early; their squares count."""
    models = make_model(), make_model()
    with kernels_mode(backend):
        opts = [scaledoptim.AdamW(m.parameters()) for m in models]
        opts[0].configure_scaling(check_during_backward=True)
        for model, opt in zip(models, opts):
            scaledoptim.scale_outputs(loss_of(model, 0), opt.scale).backward()
            opt.unscale_and_step(grads_scaled_by=opt.scale, max_grad_norm=0.01)
    assert torch.equal(opts[0].grad_norm, opts[1].grad_norm)
    assert_bit_identical(snapshot(opts[0]), snapshot(opts[1]))


def test_generic_optimizers_clip_the_grads_they_unscale() -> None:
    """``with_scaling(torch.optim.X)``: unscale, clip, step, as GradScaler + clip_grad_norm_."""
    ref_model, model = make_model(), make_model()
    ref_opt = torch.optim.Adamax(ref_model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = scaledoptim.with_scaling(torch.optim.Adamax)(model.parameters(), lr=1e-2)
    opt.configure_scaling(init_scale=2.0**10)
    for step in range(4):
        ref_norm = _gradscaler_clip_step(ref_model, ref_opt, scaler, step, 0.1)
        _clipping_step(model, opt, step, 0.1)
        if step not in OVERFLOW_AT:
            assert torch.equal(opt.grad_norm, ref_norm)
        for ref_p, p in zip(ref_model.parameters(), model.parameters()):
            assert torch.equal(p, ref_p)


def test_the_closure_form_clips_every_evaluation() -> None:
    """LBFGS evaluates its closure several times a step: each evaluation's grads are clipped."""
    ref_model, model = make_model(), make_model()
    ref_opt = torch.optim.LBFGS(ref_model.parameters(), lr=0.5, max_iter=3)
    opt = scaledoptim.with_scaling(torch.optim.LBFGS)(model.parameters(), lr=0.5, max_iter=3)
    norms: list[torch.Tensor] = []

    def ref_closure() -> torch.Tensor:
        ref_opt.zero_grad()
        loss = loss_of(ref_model, 0)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05))
        return loss

    def closure(S: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = loss_of(model, 0)
        scaledoptim.scale_outputs(loss, S).backward()
        return loss

    ref_opt.step(ref_closure)
    opt.unscale_and_step(closure, grads_scaled_by=opt.scale, max_grad_norm=0.05)
    assert len(norms) > 1 and all(n > 0.05 for n in norms)
    torch.testing.assert_close(opt.grad_norm, norms[-1])
    for ref_p, p in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(p, ref_p)


@pytest.mark.filterwarnings("ignore")
def test_the_norm_spans_both_backends_of_a_step() -> None:
    """float64 params take torch's ops beside our (emulated) kernels: one norm over both parts,
    one factor for both."""
    wide = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    narrow = torch.nn.Parameter(torch.zeros(4))
    with kernels_mode("emulate"):
        opt = scaledoptim.SGD([wide, narrow], lr=1.0)
        wide.grad = torch.tensor([3.0, 0.0, 0.0], dtype=torch.float64) * opt.scale
        narrow.grad = torch.tensor([4.0, 0.0, 0.0, 0.0]) * opt.scale
        opt.unscale_and_step(grads_scaled_by=opt.scale, max_grad_norm=1.0)
    assert opt.grad_norm.item() == 5.0
    torch.testing.assert_close(wide, torch.tensor([-0.6, 0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(narrow, torch.tensor([-0.8, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize(
    ("value", "match"),
    [("replica", "must be 'replicated'"), (True, "must be 'replicated'"), ("sharded", "without")],
)
def test_grads_across_ranks_is_checked_before_anything_changes(value: object, match: str) -> None:
    """A value that is not 'replicated'/'sharded'/None, or one without process_group, is refused
    and the scale and its configuration are as before."""
    opt = scaledoptim.AdamW(make_model().parameters()).configure_scaling(init_scale=2.0**5)
    scale = opt.scale
    with pytest.raises(ValueError, match=match):
        opt.configure_scaling(init_scale=2.0**9, grads_across_ranks=value)  # type: ignore[arg-type]
    assert opt.scale is scale and scale.item() == 2.0**5
    assert opt.scaling_state.grads_across_ranks is None


# ------------------------------------------------ sparse and complex grads (torch.optim's route)
ROWS_OF_EMBEDDING = 10


def _routed_loss(kind: str, param: torch.Tensor, other: torch.Tensor, step: int, ours: bool):
    """A loss of ``param`` whose grad is sparse (an embedding's, with repeated rows: uncoalesced)
    or complex for ours; for the reference, the same function of a dense real twin (the dense
    embedding, the complex param's real view)."""
    generator = torch.Generator().manual_seed(step)
    if kind == "sparse":
        index = torch.randint(0, ROWS_OF_EMBEDDING, (8,), generator=generator)
        rows = torch.nn.functional.embedding(index, param, sparse=ours)
    else:
        rows = torch.view_as_real(param) if ours else param
    target = torch.randn(rows.shape, generator=generator)
    weights = torch.randn(other.shape, generator=generator)
    return ((rows - target) ** 2).sum() + (other * weights).sum()


def _poison(kind: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    """An inf in ours' grad (a sparse grad's values) and at the same element of the twin's."""
    if kind == "sparse":
        ours.grad._values()[0, 1] = float("inf")
        ref.grad[ours.grad._indices()[0, 0], 1] = float("inf")
    else:
        torch.view_as_real(ours.grad)[1, 0, 1] = float("inf")
        ref.grad[1, 0, 1] = float("inf")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_grad_norm", [None, 0.5], ids=["no-clip", "clip"])
@pytest.mark.parametrize("kind", ["sparse", "complex"])
def test_sparse_and_complex_grads_step_as_gradscaler_and_clip_grad_norm(
    kind: str, max_grad_norm: float | None, backend: str
) -> None:
    """scaledoptim.SGD on an embedding's sparse grads (uncoalesced: repeated rows) or on a
    complex param, through ``unscale_and_step``, beside a dense param: the steps of
    ``torch.optim.SGD`` + ``GradScaler`` (+ ``clip_grad_norm_``) on the dense real twin (torch's
    GradScaler refuses complex grads, ``clip_grad_norm_`` sparse ones): the same unscaled, clipped
    update, ``grad_norm`` the norm ``clip_grad_norm_`` returns, and an inf in the sparse grad's
    values (in the complex grad) skips the step and backs the scale off."""
    generator = torch.Generator().manual_seed(1)
    if kind == "sparse":
        value = torch.randn(ROWS_OF_EMBEDDING, 3, generator=generator)
        twin = value.clone()
    else:
        value = torch.randn(4, 3, dtype=torch.complex64, generator=generator)
        twin = torch.view_as_real(value).clone()
    other = torch.randn(5, generator=generator)
    params = [torch.nn.Parameter(value.clone()), torch.nn.Parameter(other.clone())]
    ref_params = [torch.nn.Parameter(twin), torch.nn.Parameter(other.clone())]
    ref_opt = torch.optim.SGD(ref_params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    with kernels_mode(backend):
        opt = scaledoptim.SGD(params, lr=0.1).configure_scaling(
            init_scale=2.0**10, growth_interval=2
        )
        for step in range(6):
            overflow = step == 3
            opt.zero_grad()
            ref_opt.zero_grad()
            loss = _routed_loss(kind, *params, step, ours=True)
            scaledoptim.scale_outputs(loss, opt.scale).backward()
            scaler.scale(_routed_loss(kind, *ref_params, step, ours=False)).backward()
            assert params[0].grad.is_sparse == (kind == "sparse")
            if overflow:
                _poison(kind, params[0], ref_params[0])
            _, found_inf, S = opt.unscale_and_step(
                grads_scaled_by=opt.scale, max_grad_norm=max_grad_norm
            )
            scaler.unscale_(ref_opt)
            if max_grad_norm is not None:
                ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_grad_norm)
                if not overflow:
                    assert ref_norm > max_grad_norm  # the clip bites
                    torch.testing.assert_close(opt.grad_norm, ref_norm, rtol=1e-6, atol=0)
            scaler.step(ref_opt)
            scaler.update()
            assert found_inf.item() == float(overflow)
            assert S.item() == scaler.get_scale()
            ours = torch.view_as_real(params[0]) if kind == "complex" else params[0]
            torch.testing.assert_close(ours.detach(), ref_params[0].detach())
            torch.testing.assert_close(params[1].detach(), ref_params[1].detach())
    assert scaler.get_scale() == 2.0**11  # grew (steps 0-1, 4-5), backed off (step 3)
