"""``scaledoptim.GradScaler.step(opt, max_grad_norm=c)``: the clip a GradScaler script writes as
``unscale_`` + ``clip_grad_norm_`` + ``step``, inside the step (issue 41, item 1).

Each run is compared with ``torch.amp.GradScaler`` + ``unscale_`` + ``clip_grad_norm_`` +
``step`` of the matching torch optimizer: the same skipped iterations and scales, the same norm,
the params within the rounding docs/recipes/clipping.md names.
"""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch

import scaledoptim
from scaledoptim.doctor.sync_free import no_host_reads

STEPS = 12
OVERFLOWS = {2, 7}
CLIP = 0.5


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(12, 6, generator=gen), 4 * torch.randn(12, 2, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x), y)
    return loss * 1e38 if step in OVERFLOWS else loss


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _torch_iteration(model, opt, scaler, step) -> torch.Tensor:
    opt.zero_grad()
    scaler.scale(_loss(model, step)).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    scaler.step(opt)
    scaler.update()
    return norm


def _fused_iteration(model, opt, scaler, step) -> torch.Tensor:
    opt.zero_grad()
    scaler.scale(_loss(model, step)).backward()
    scaler.step(opt, max_grad_norm=CLIP)
    scaler.update()
    return opt.grad_norm


PAIRS = {
    "AdamW": (
        lambda p: scaledoptim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    ),
    "SGD": (
        lambda p: scaledoptim.SGD(p, lr=0.05, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    ),
    "with_scaling(RMSprop)": (
        lambda p: scaledoptim.with_scaling(torch.optim.RMSprop)(p, lr=1e-2),
        lambda p: torch.optim.RMSprop(p, lr=1e-2),
    ),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_step_with_max_grad_norm_follows_unscale_clip_step(name, kernel_backend) -> None:
    ours_cls, torch_cls = PAIRS[name]
    model, reference = _model(), _model()
    opt, torch_opt = ours_cls(model.parameters()), torch_cls(reference.parameters())
    scaler = scaledoptim.GradScaler("cpu", growth_interval=3)
    torch_scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    clipped = 0
    for step in range(STEPS):
        before = _params(model)
        norm = _fused_iteration(model, opt, scaler, step)
        torch_norm = _torch_iteration(reference, torch_opt, torch_scaler, step)
        skipped = all(torch.equal(a, b) for a, b in zip(before, _params(model)))
        assert skipped == (step in OVERFLOWS), step
        assert scaler.get_scale() == torch_scaler.get_scale(), step
        if step in OVERFLOWS:
            assert not torch.isfinite(norm)
            continue
        clipped += bool(torch_norm > CLIP)
        # The norm of the same grads is the same float where both sum the squares with torch's
        # foreach norms (the first step); after it the params, so the grads, differ by rounding.
        exact = step == 0 and kernel_backend == "torch-native"
        torch.testing.assert_close(norm, torch_norm, rtol=0 if exact else 1e-5, atol=0)
        for a, b in zip(_params(model), _params(reference)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert clipped >= 5  # the clip bound on most steps
    assert opt.scale is scaler._get_scale_async()


def test_one_step_reads_the_grads_of_the_three_calls_within_one_rounding(kernel_backend) -> None:
    """docs/recipes/clipping.md: SGD without momentum shows the grad its update read in
    ``p - lr * g``. Our kernels multiply each grad by ``(1 / S) * coef``, exact for a power-of-two
    ``S``: the grads ``unscale_`` + ``clip_grad_norm_`` leave, bit for bit. torch's fused CPU
    updates divide by ``S / coef``, rounded once to float32: one rounding apart."""
    model, reference = _model(), _model()
    opt = scaledoptim.SGD(model.parameters(), lr=1.0)
    torch_opt = torch.optim.SGD(reference.parameters(), lr=1.0)
    scaler = scaledoptim.GradScaler("cpu")
    torch_scaler = torch.amp.GradScaler("cpu")
    before = _params(model)
    norm = _fused_iteration(model, opt, scaler, 0)
    torch_norm = _torch_iteration(reference, torch_opt, torch_scaler, 0)
    assert torch_norm > CLIP and torch.equal(norm, torch_norm)
    for b, p, q in zip(before, _params(model), _params(reference)):
        if kernel_backend == "emulated-kernels":
            assert torch.equal(p, q)
            continue
        ours, theirs = (b - p).double(), (b - q).double()  # the grad read, as rounded in p
        ulp = torch.finfo(torch.float32).eps * theirs.abs()
        # one rounding of the grad, then p - g's own rounding (of up to half an ulp of p)
        p_ulp = torch.finfo(torch.float32).eps * b.double().abs()
        assert ((ours - theirs).abs() <= ulp + p_ulp).all()


@pytest.mark.parametrize("no_clip", [0, 0.0, None])
def test_zero_and_none_do_not_clip(no_clip) -> None:
    model, reference = _model(), _model()
    opt, other = scaledoptim.AdamW(model.parameters()), scaledoptim.AdamW(reference.parameters())
    scaler, other_scaler = scaledoptim.GradScaler("cpu"), scaledoptim.GradScaler("cpu")
    for step in range(3):
        for m, o, s, kwargs in (
            (model, opt, scaler, {"max_grad_norm": no_clip}),
            (reference, other, other_scaler, {}),
        ):
            o.zero_grad()
            s.scale(_loss(m, step)).backward()
            s.step(o, **kwargs)
            s.update()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    assert opt.grad_norm is None


@pytest.mark.parametrize(
    "bad, error",
    [(-1.0, ValueError), (math.nan, ValueError), (math.inf, ValueError),
     (torch.tensor(1.0), TypeError), (True, TypeError), ("1.0", TypeError)],
)
def test_a_bad_max_grad_norm_is_refused_and_changes_nothing(bad, error) -> None:
    model = _model()
    opt = scaledoptim.AdamW(model.parameters())
    scaler = scaledoptim.GradScaler("cpu")
    scaler.scale(_loss(model, 0)).backward()
    before, grads = _params(model), [p.grad.clone() for p in model.parameters()]
    with pytest.raises(error, match="max_grad_norm"):
        scaler.step(opt, max_grad_norm=bad)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model)))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    scaler.step(opt, max_grad_norm=1.0)  # the iteration goes on
    scaler.update()


def test_after_unscale_a_clip_in_the_step_is_refused_naming_both_fixes() -> None:
    model = _model()
    opt = scaledoptim.AdamW(model.parameters())
    scaler = scaledoptim.GradScaler("cpu")
    scaler.scale(_loss(model, 0)).backward()
    scaler.unscale_(opt)
    before = _params(model)
    with pytest.raises(RuntimeError, match=r"drop unscale_\(\).*clip_grad_norm_"):
        scaler.step(opt, max_grad_norm=1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model)))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the other way still works
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_the_clip_in_the_step_never_reads_the_host(name) -> None:
    model = _model()
    opt = PAIRS[name][0](model.parameters())
    scaler = scaledoptim.GradScaler("cpu", growth_interval=2)
    for step in range(4):
        opt.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        with no_host_reads():
            scaler.step(opt, max_grad_norm=CLIP)
            scaler.update()


def test_a_torch_optimizer_gets_the_three_calls() -> None:
    model, reference = _model(), _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    scaler = scaledoptim.GradScaler("cpu", growth_interval=3)
    torch_scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        scaler.step(opt, max_grad_norm=CLIP)
        scaler.update()
        _torch_iteration(reference, torch_opt, torch_scaler, step)
        assert scaler.get_scale() == torch_scaler.get_scale()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("optimizer", ["scaledoptim", "torch"])
def test_a_disabled_scaler_still_clips(optimizer) -> None:
    """nanoGPT's ``GradScaler(enabled=(dtype == 'float16'))``: in bf16/fp32 the same line clips."""
    model, reference = _model(), _model()
    make = scaledoptim.SGD if optimizer == "scaledoptim" else torch.optim.SGD
    opt = make(model.parameters(), lr=0.1)
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler = scaledoptim.GradScaler("cpu", enabled=False)
    for step in (0, 1, 3):
        opt.zero_grad()
        torch_opt.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        scaler.step(opt, max_grad_norm=CLIP)
        _loss(reference, step).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        torch_opt.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _warned_at(record, text: str) -> tuple[str, int]:
    (warning,) = [w for w in record if text in str(w.message)]
    return warning.filename, warning.lineno


@pytest.mark.parametrize("call", ["step", "step(max_grad_norm)", "unscale_"])
def test_the_dropped_checkpoint_scale_warning_names_the_users_line(call) -> None:
    model = _model()
    saved = scaledoptim.AdamW(model.parameters())
    saved.configure_scaling(init_scale=2.0**10)
    opt = scaledoptim.AdamW(model.parameters())
    opt.load_state_dict(saved.state_dict())
    scaler = scaledoptim.GradScaler("cpu")
    scaler.scale(_loss(model, 0)).backward()
    calls = {
        "step": lambda: scaler.step(opt),
        "step(max_grad_norm)": lambda: scaler.step(opt, max_grad_norm=1.0),
        "unscale_": lambda: scaler.unscale_(opt),
    }
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        calls[call]()
    line = calls[call].__code__.co_firstlineno
    assert _warned_at(record, "loaded from a checkpoint") == (__file__, line)


def test_the_torch_gradscaler_warning_names_the_users_line() -> None:
    model = _model()
    opt = scaledoptim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(model, 0)).backward()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        scaler.step(opt)
    assert _warned_at(record, "A torch.amp.GradScaler steps") == (__file__, line)
