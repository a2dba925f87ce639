"""A step told another scale than the one its grads' backward was scaled by is refused (Note [the
scale a backward was scaled by] in protocol/outputs.py), before anything changes; a backward
scaled by hand is never refused."""

from __future__ import annotations

import pytest
import torch

import scaledoptim
from tests.support.tensors import clones

pytestmark = pytest.mark.usefixtures("kernel_backend")  # our kernels (emulated) and torch's ops

MAKERS = [
    pytest.param(lambda params: scaledoptim.AdamW(params, lr=0.01), id="AdamW"),
    pytest.param(lambda params: scaledoptim.SGD(params, lr=0.01, momentum=0.9), id="SGD"),
    pytest.param(
        lambda params: scaledoptim.with_scaling(torch.optim.RMSprop)(params, lr=0.01),
        id="with_scaling(RMSprop)",
    ),
]
FORMS = ("unscale_and_step", "unscale")


def _model() -> torch.nn.Linear:
    return torch.nn.Linear(4, 3)


def _loss(model: torch.nn.Module) -> torch.Tensor:
    x = torch.arange(8.0).view(2, 4) / 8
    return model(x).pow(2).sum()


def _everything(model: torch.nn.Module, opt) -> list[torch.Tensor]:
    state = [
        v for p in model.parameters() for v in opt.state.get(p, {}).values() if torch.is_tensor(v)
    ]
    return clones([*(p.detach() for p in model.parameters()), *state, opt.scale])


def _unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(after, before))


def _call(opt, form: str, grads_scaled_by) -> None:
    if form == "unscale":
        opt.unscale(grads_scaled_by=grads_scaled_by)
        opt.step_after_unscale()
    else:
        opt.unscale_and_step(grads_scaled_by=grads_scaled_by)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("make", MAKERS)
@pytest.mark.parametrize("told", ["a number", "another tensor"])
def test_another_scale_than_the_backwards_is_refused(make, form: str, told: str) -> None:
    model = _model()
    opt = make(model.parameters())
    scaledoptim.scale_outputs(_loss(model), opt.scale).backward()
    wrong = 1024.0 if told == "a number" else opt.scale * 2
    before = _everything(model, opt)
    expected = "grads_scaled_by=1024.0" if told == "a number" else "a tensor that is not opt.scale"
    with pytest.raises(RuntimeError, match=rf"{expected}.*scaled by opt.scale \(= 65536\)"):
        _call(opt, form, wrong)
    assert _unchanged(before, _everything(model, opt))
    _call(opt, form, opt.scale)  # still usable, and the right call steps
    assert not _unchanged(before, _everything(model, opt))


@pytest.mark.parametrize("make", MAKERS)
@pytest.mark.parametrize("told", ["a number", "another tensor"])
def test_the_backwards_scale_by_value_steps_on_the_cpu(make, told: str) -> None:
    # On the CPU the values compare for free: an equal number or tensor is the same scale.
    model = _model()
    opt = make(model.parameters())
    scaledoptim.scale_outputs(_loss(model), opt.scale).backward()
    before = _everything(model, opt)
    opt.unscale_and_step(grads_scaled_by=65536.0 if told == "a number" else opt.scale.double())
    assert not _unchanged(before, _everything(model, opt))


@pytest.mark.parametrize("make", MAKERS)
def test_a_backward_scaled_by_hand_is_never_refused(make) -> None:
    by_hand, told = _model(), _model()
    told.load_state_dict(by_hand.state_dict())
    opt_by_hand, opt_told = make(by_hand.parameters()), make(told.parameters())
    for _ in range(3):
        opt_by_hand.zero_grad()
        opt_told.zero_grad()
        S = opt_by_hand.scale
        (_loss(by_hand) * S).backward()
        opt_by_hand.unscale_and_step(grads_scaled_by=S)
        scaledoptim.scale_outputs(_loss(told), opt_told.scale).backward()
        opt_told.unscale_and_step(grads_scaled_by=opt_told.scale)
    assert _unchanged(_everything(told, opt_told), _everything(by_hand, opt_by_hand))


def test_accumulated_scaled_backwards_step() -> None:
    model = _model()
    opt = scaledoptim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        for _ in range(3):  # three micro-batches, one step
            scaledoptim.scale_outputs(_loss(model), opt.scale).backward()
        _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
        assert found_inf.item() == 0.0
        opt.zero_grad()
