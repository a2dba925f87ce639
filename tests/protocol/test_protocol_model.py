"""Random sequences of protocol calls against a plain-Python model of the protocol.

The model is the stage machine (ready -> unscaled -> ready) and the scale state machine in
Python floats. After every call the optimizer must have raised exactly when the model says the
call is out of order, and its scale and trackers must equal the model's. Checkpoints taken at
random points (mid growth interval, mid hysteresis) and resumed into a fresh optimizer must
end bit-identical to a twin that never stopped.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scaledoptim
from tests.support.training import assert_bit_identical, snapshot

CONFIG = dict(
    init_scale=16.0, growth_interval=3, hysteresis=2, min_scale=1.0, max_scale=64.0, max_replays=3
)


@dataclasses.dataclass
class ProtocolModel:
    scale: float = CONFIG["init_scale"]
    growth: int = 0
    hysteresis: int = CONFIG["hysteresis"]
    unscaled: bool = False
    overflowing_grads: bool = False

    def update(self, found_inf: bool, force_backoff: bool = False) -> None:
        if found_inf:
            self.hysteresis = max(self.hysteresis - 1, 0)
            if force_backoff or self.hysteresis == 0:
                self.scale = max(self.scale * 0.5, CONFIG["min_scale"])
            self.growth = 0
        else:
            self.hysteresis = CONFIG["hysteresis"]
            self.growth += 1
            if self.growth >= CONFIG["growth_interval"]:
                self.scale, self.growth = min(self.scale * 2.0, CONFIG["max_scale"]), 0


def _fresh():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, scaledoptim.AdamW(model.parameters(), lr=1e-2).configure_scaling(**CONFIG)


class Run:
    """One (model, optimizer) pair driven by the actions; ``resumable`` ones checkpoint for real."""

    def __init__(self, resumable: bool) -> None:
        self.model, self.opt = _fresh()
        self.resumable = resumable

    def backward(self, S: torch.Tensor, overflow: bool) -> torch.Tensor:
        self.opt.zero_grad()
        x = torch.linspace(-1, 1, 6).reshape(2, 3)
        loss = self.model(x).pow(2).mean()
        scaledoptim.scale_outputs(loss, S).backward()
        if overflow:
            self.model.weight.grad[0, 0] = float("inf")
        return loss

    def checkpoint(self) -> None:
        self.opt.zero_grad()
        if not self.resumable:
            return
        buffer = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict()}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer)
        self.model, self.opt = _fresh()
        self.model.load_state_dict(saved["model"])
        self.opt.load_state_dict(saved["opt"])


ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("backward"), st.booleans()),
        st.tuples(
            st.sampled_from(
                ["unscale", "step_after_unscale", "unscale_and_step", "zero_grad", "checkpoint"]
            ),
            st.none(),
        ),
        st.tuples(st.just("closure_step"), st.integers(0, 2)),
    ),
    max_size=30,
)


def _apply(run: Run, model: ProtocolModel, action: str, arg) -> None:
    opt = run.opt
    S = opt.scale
    if action == "backward":
        run.backward(S, overflow=arg)
        model.unscaled, model.overflowing_grads = False, arg
    elif action == "zero_grad":
        opt.zero_grad()
        model.unscaled = model.overflowing_grads = False
    elif action == "checkpoint":
        if model.unscaled:
            with pytest.raises(RuntimeError, match="between unscale"):
                opt.state_dict()
        run.checkpoint()
        model.unscaled = model.overflowing_grads = False
    elif action in ("unscale", "unscale_and_step", "closure_step") and model.unscaled:
        with pytest.raises(RuntimeError, match="unscale"):
            _call(run, action, arg, S)
    elif action == "step_after_unscale" and not model.unscaled:
        with pytest.raises(RuntimeError, match=r"call opt\.unscale"):
            opt.step_after_unscale()
    else:
        _call(run, action, arg, S)
        _advance(model, action, arg)


def _call(run: Run, action: str, arg, S: torch.Tensor) -> None:
    opt = run.opt
    if action == "unscale":
        opt.unscale(grads_scaled_by=S)
    elif action == "step_after_unscale":
        opt.step_after_unscale()
    elif action == "unscale_and_step":
        opt.unscale_and_step(grads_scaled_by=S)
    else:
        overflows = iter(range(arg))
        try:
            opt.unscale_and_step(
                lambda S: run.backward(S, next(overflows, None) is not None), grads_scaled_by=S
            )
        except scaledoptim.ClosureReplayError:
            pass  # the model predicts it at min_scale; _advance checks that it was expected


def _advance(model: ProtocolModel, action: str, arg) -> None:
    if action == "unscale":
        model.update(model.overflowing_grads)
        model.unscaled = True
    elif action == "step_after_unscale":
        model.unscaled = False
    elif action == "unscale_and_step":
        model.update(model.overflowing_grads)
    else:  # closure_step: every overflowing evaluation backs off; a replay at min_scale fails
        before = dataclasses.replace(model)
        for _ in range(arg):
            if model.scale == CONFIG["min_scale"]:
                model.__dict__.update(dataclasses.asdict(before))  # scale restored...
                model.overflowing_grads = True  # ...but the grads are the last evaluation's
                return
            model.update(True, force_backoff=True)
        model.update(False)
        model.overflowing_grads = False


def _assert_matches(opt: scaledoptim.Optimizer, model: ProtocolModel) -> None:
    loss_scale = opt.scaling_state.loss_scale
    assert loss_scale.scale.item() == model.scale
    assert loss_scale.growth_tracker.item() == model.growth
    assert loss_scale.hysteresis_tracker.item() == model.hysteresis


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=ACTIONS)
def test_optimizer_follows_the_protocol_model_and_resumes_bit_identically(actions) -> None:
    resumed, twin = Run(resumable=True), Run(resumable=False)
    model, twin_model = ProtocolModel(), ProtocolModel()
    for action, arg in actions:
        _apply(resumed, model, action, arg)
        _apply(twin, twin_model, action, arg)
        _assert_matches(resumed.opt, model)
    assert model == twin_model
    assert_bit_identical(snapshot(twin.opt), snapshot(resumed.opt))
