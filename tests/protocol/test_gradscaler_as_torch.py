"""``scaledoptim.GradScaler`` raises or loads where torch.amp.GradScaler does, so code written for
torch's meets the same errors and loads the same checkpoints: a growth tracker past a shortened
growth interval loads and grows as torch's; a step with nothing checked and a scale of something
that is no tensor raise torch's errors, changing nothing."""

from __future__ import annotations

import pytest
import torch

import scaledoptim
from tests.scale.test_gradscaler_state import _loss, _model
from tests.support.training import assert_bit_identical, snapshot

pytestmark = pytest.mark.usefixtures("kernel_backend")

CLEAN_BEFORE_SHORTENING = 4


def _iterate(model, opt, scaler, steps) -> list[float]:
    scales = []
    for step in steps:
        opt.zero_grad()
        scaler.scale(_loss(model, step)).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _shortened(scaler_cls, opt_cls):
    """A scaler whose tracker (4 clean iterations) is past the interval set after them (2)."""
    model = _model()
    opt, scaler = opt_cls(model.parameters()), scaler_cls("cpu", init_scale=8.0, growth_interval=10)
    _iterate(model, opt, scaler, range(CLEAN_BEFORE_SHORTENING))
    scaler.set_growth_interval(2)
    return model, opt, scaler


def test_a_tracker_past_a_shortened_interval_loads_and_moves_as_torchs() -> None:
    torch_model, torch_opt, torch_scaler = _shortened(torch.amp.GradScaler, torch.optim.SGD)
    model, opt, scaler = _shortened(scaledoptim.GradScaler, scaledoptim.SGD)
    assert scaler.state_dict() == torch_scaler.state_dict()
    assert scaler.state_dict()["_growth_tracker"] == CLEAN_BEFORE_SHORTENING

    resumed_model = _model()
    resumed_model.load_state_dict(model.state_dict())
    resumed_opt, resumed_scaler = (
        scaledoptim.SGD(resumed_model.parameters()),
        scaledoptim.GradScaler("cpu"),
    )
    resumed_opt.load_state_dict(opt.state_dict())  # its loss_scale holds the same tracker
    resumed_scaler.load_state_dict(scaler.state_dict())

    # torch grows only when tracker + 1 == interval: not again until an overflow resets it.
    expected = _iterate(torch_model, torch_opt, torch_scaler, range(4, 9))
    assert expected == [8.0] * 5
    assert _iterate(resumed_model, resumed_opt, resumed_scaler, range(4, 9)) == expected
    assert resumed_opt.scale.item() == 8.0


def test_a_tracker_past_the_interval_moves_as_torchs_in_the_own_protocol() -> None:
    """The optimizer's checkpoint of such a scaler, stepped by the optimizer's own protocol:
    torch's rule, no growth until an overflow resets the tracker (Note [growth tracker past the
    interval])."""
    _, opt, _ = _shortened(scaledoptim.GradScaler, scaledoptim.SGD)
    model = _model()
    resumed = scaledoptim.SGD(model.parameters())
    resumed.load_state_dict(opt.state_dict())
    assert resumed.scaling_state.loss_scale.growth_tracker.item() == CLEAN_BEFORE_SHORTENING
    scales = []
    for step in range(4, 9):
        resumed.zero_grad()
        scaledoptim.scale_outputs(_loss(model, step), resumed.scale).backward()
        _, _, scale = resumed.unscale_and_step(grads_scaled_by=resumed.scale)
        scales.append(scale.item())
    assert scales == [8.0] * 5


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_-step"])
def test_an_iteration_without_grads_asserts_as_torch_and_counts_nothing(unscale_first) -> None:
    model = _model()
    opt, scaler = (
        scaledoptim.AdamW(model.parameters()),
        scaledoptim.GradScaler("cpu", init_scale=8.0),
    )
    _iterate(model, opt, scaler, range(2))
    opt.zero_grad()
    scaler.scale(_loss(model, 2))  # no backward: no grads
    before, tracker = snapshot(opt), scaler._get_growth_tracker()
    if unscale_first:
        scaler.unscale_(opt)
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        scaler.step(opt)
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        scaler.update()
    assert_bit_identical(before, snapshot(opt))
    assert scaler._get_growth_tracker() == tracker and scaler.get_scale() == 8.0


@pytest.mark.parametrize(
    "outputs", [3.0, None, object(), "loss"], ids=["float", "None", "object", "str"]
)
def test_scaling_what_is_no_tensor_raises_as_torch(outputs) -> None:
    torch_message = "outputs must be a Tensor or an iterable of Tensors"
    if not isinstance(outputs, str):  # (torch recurses into a string's characters forever)
        with pytest.raises(ValueError, match=torch_message):
            torch.amp.GradScaler("cpu").scale(outputs)
    scaler = scaledoptim.GradScaler("cpu")
    with pytest.raises(ValueError, match=torch_message):
        scaler.scale(outputs)


def test_another_iterable_of_tensors_is_scaled_lazily_as_torch() -> None:
    tensors = [torch.ones(2), torch.full((3,), 2.0)]
    ours = scaledoptim.GradScaler("cpu", init_scale=4.0).scale(iter(tensors))
    theirs = torch.amp.GradScaler("cpu", init_scale=4.0).scale(iter(tensors))
    assert not isinstance(ours, (list, tuple))
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
