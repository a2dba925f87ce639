"""Closure replay: LBFGS and any closure optimizer get finite grads; exhaustion changes nothing.

The replay tests of the closure forms run the default config of every row whose ``step()``
takes no closure of its own (the replay does not branch on the update's options).
"""

from __future__ import annotations

import pytest
import torch

import scaledoptim
from scaledoptim.testing.optim_db import OptimInfo, rows
from tests.support.training import assert_bit_identical, loss_of, make_model, snapshot

pytestmark = pytest.mark.usefixtures("kernel_backend")


def _fp16_regression():
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 1) + 0.1 * torch.randn(64, 1)
    return torch.nn.Linear(8, 1), x, y


def test_lbfgs_with_too_large_initial_scale_replays_and_trains() -> None:
    model, x, y = _fp16_regression()
    opt = scaledoptim.LBFGS(model.parameters(), lr=0.5, max_iter=10)
    opt.configure_scaling(init_scale=2.0**40)  # the fp16 backward overflows at this scale

    def closure(S):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        # The fp16 activation grad overflows at S = 2**40: the first tries replay.
        scaledoptim.scale_outputs(loss, S).backward()
        return loss

    S = opt.scale
    first_loss = None
    for _ in range(5):
        loss, found_inf, S = opt.unscale_and_step(closure, grads_scaled_by=S)
        first_loss = first_loss if first_loss is not None else loss.item()
        assert found_inf.item() == 0.0
    assert S.item() < 2.0**40, "the scale was backed off by the replays"
    assert loss.item() < 0.2 * first_loss
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_wrapped_closure_gives_lbfgs_finite_grads_every_evaluation() -> None:
    model, x, y = _fp16_regression()
    opt = scaledoptim.LBFGS(model.parameters(), lr=0.5, max_iter=6)
    opt.configure_scaling(init_scale=2.0**40)
    seen = []

    def closure(S):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.half().float()), y)
        scaled = scaledoptim.scale_outputs(loss, S)
        scaled.backward()
        if S.item() > 2.0**30:  # pretend the fp16 backward overflowed
            model.weight.grad.view(-1)[0] = float("nan")
        return loss

    original = opt.unscale

    def recording_unscale(grads_scaled_by=None):
        result = original(grads_scaled_by)
        seen.append((result[0].item(), [p.grad.clone() for p in model.parameters()]))
        return result

    opt.unscale = recording_unscale
    opt.unscale_and_step(closure, grads_scaled_by=opt.scale)
    evaluations_after_finite = [
        grads for inf, grads in seen[seen.index(next(s for s in seen if s[0] == 0.0)) :]
    ]
    assert len(evaluations_after_finite) > 1, "LBFGS evaluated the closure several times"
    for grads in evaluations_after_finite:
        assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("info", rows(closure=False), ids=str)
def test_step_after_unscale_closure_form_replays(info: OptimInfo) -> None:
    model = make_model()
    opt = info.make(model.parameters()).configure_scaling(init_scale=2.0**20)
    calls = []

    def closure(S):
        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, 0), S).backward()
        if S.item() > 2.0**18:
            model[0].weight.grad.view(-1)[3] = float("inf")
        found_inf, S = opt.unscale(grads_scaled_by=S)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        calls.append(found_inf.item())
        return torch.tensor(0.0), found_inf, S

    before = [p.clone() for p in model.parameters()]
    _, found_inf, S = opt.step_after_unscale(closure, current_grad_scale=opt.scale)
    assert calls == [1.0, 1.0, 0.0]
    assert found_inf.item() == 0.0 and S.item() == 2.0**18
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("info", rows(closure=False), ids=str)
def test_closure_that_never_becomes_finite_raises_and_changes_nothing(info: OptimInfo) -> None:
    model = make_model()
    opt = info.make(model.parameters()).configure_scaling(max_replays=5)
    opt.unscale_and_step(
        lambda S: scaledoptim.scale_outputs(loss_of(model, 0), S).backward(),
        grads_scaled_by=opt.scale,
    )
    before = snapshot(opt)
    tries = []

    def closure(S):
        opt.zero_grad()
        tries.append(S.item())
        loss = loss_of(model, 1) * float("nan")
        scaledoptim.scale_outputs(loss, S).backward()
        return loss

    with pytest.raises(scaledoptim.ClosureReplayError, match="restored"):
        opt.unscale_and_step(closure, grads_scaled_by=opt.scale)
    assert len(tries) == 6, "bounded: one try plus max_replays replays"
    assert_bit_identical(before, snapshot(opt))


def test_replay_stops_at_min_scale() -> None:
    model = make_model()
    opt = scaledoptim.SGD(model.parameters(), lr=0.1).configure_scaling(
        init_scale=4.0, min_scale=1.0
    )
    tries = []

    def closure(S):
        opt.zero_grad()
        tries.append(S.item())
        (loss_of(model, 0) * float("inf")).backward()

    with pytest.raises(scaledoptim.ClosureReplayError):
        opt.unscale_and_step(closure, grads_scaled_by=opt.scale)
    assert tries == [4.0, 2.0, 1.0]


def test_closure_that_raises_restores_params_state_and_scale() -> None:
    model, x, y = _fp16_regression()
    opt = scaledoptim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    calls = []
    def closure(S):
        calls.append(1)
        if len(calls) == 7:  # in the second step, after LBFGS already moved the params
            raise KeyError("data loader broke")
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaledoptim.scale_outputs(loss, S).backward()
        return loss

    opt.unscale_and_step(closure, grads_scaled_by=opt.scale)
    assert len(calls) == 5, "the first step evaluates the closure max_iter times"
    before = snapshot(opt)
    with pytest.raises(KeyError):
        opt.unscale_and_step(closure, grads_scaled_by=opt.scale)
    assert_bit_identical(before, snapshot(opt))


def test_unscaled_closure_runs_without_replay() -> None:
    model = make_model()
    opt = scaledoptim.SGD(model.parameters(), lr=0.1)

    def closure(S):
        assert S is None
        opt.zero_grad()
        loss = loss_of(model, 0)
        loss.backward()
        return loss

    loss, found_inf, S = opt.unscale_and_step(closure)
    assert S is None and found_inf.item() == 0.0 and loss.item() > 0
