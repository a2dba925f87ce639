"""What the state-dict fuzz (test_state_dict_fuzz.py) found, one deterministic case each: a load
torch.optim's step would fail on is refused before anything changes (or, where torch's loader
fails halfway, leaves the optimizer as it was); what torch takes, loads."""

from __future__ import annotations

import copy

import pytest
import torch

import scaledoptim
from tests.support.training import assert_bit_identical, loss_of, make_model, snapshot

pytestmark = pytest.mark.usefixtures("kernel_backend")


def _stepped(make, steps: int = 2):
    model = make_model()
    opt = make(model.parameters())
    for step in range(steps):

        def closure(step: int = step) -> torch.Tensor:
            opt.zero_grad()
            loss = loss_of(model, step)
            loss.backward()
            return loss

        if isinstance(opt, torch.optim.LBFGS):
            opt.step(closure)
        else:
            closure()
            opt.step()
    return model, opt


def _assert_refused(opt, state_dict, error, match) -> None:
    before = snapshot(opt)
    options = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with pytest.raises(error, match=match):
        opt.load_state_dict(state_dict)
    assert_bit_identical(before, snapshot(opt))
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == options


@pytest.mark.parametrize("name, moment", [("Adagrad", "sum"), ("Adam", "exp_avg")])
def test_a_state_of_only_a_step_is_refused_where_torchs_step_fails(name, moment) -> None:
    _, opt = _stepped(lambda p: getattr(scaledoptim, name)(p, lr=0.1))
    state_dict = copy.deepcopy(opt.state_dict())
    state_dict["state"][0] = {"step": state_dict["state"][0]["step"]}
    _assert_refused(opt, state_dict, ValueError, rf"state\[0\].*holds \['step'\] but no '{moment}'")

    _, reference = _stepped(lambda p: getattr(torch.optim, name)(p, lr=0.1))
    reference.load_state_dict(copy.deepcopy(state_dict))
    with pytest.raises(KeyError, match=moment):
        reference.step()


def test_sgd_starts_the_momentum_of_a_state_of_only_a_step_as_torch() -> None:
    model, opt = _stepped(lambda p: scaledoptim.SGD(p, lr=0.1, momentum=0.9))
    ref_model, reference = _stepped(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    state_dict = copy.deepcopy(opt.state_dict())
    state_dict["state"][0] = {"step": state_dict["state"][0]["step"]}
    opt.load_state_dict(copy.deepcopy(state_dict))
    reference.load_state_dict(copy.deepcopy(state_dict))
    for m, o in ((model, opt), (ref_model, reference)):
        o.zero_grad()
        loss_of(m, 5).backward()
        o.step()
    for ours, theirs in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs)


def test_a_group_with_fused_and_differentiable_is_refused_before_any_group_steps() -> None:
    model = make_model()
    weights, biases = model[0].weight, model[2].bias
    opt = scaledoptim.AdamW([{"params": [weights]}, {"params": [biases]}], lr=0.1, fused=True)
    state_dict = copy.deepcopy(opt.state_dict())
    state_dict["param_groups"][1]["differentiable"] = True
    _assert_refused(opt, state_dict, RuntimeError, r"param_groups\[1\].*does not support")

    opt.param_groups[1]["differentiable"] = True  # edited in place: refused at the step
    loss_of(model, 0).backward()
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match="`fused` does not support `differentiable`"):
        opt.step()
    assert_bit_identical(before, snapshot(opt))


@pytest.mark.parametrize("kind", ["LBFGS", "fused"])
def test_a_meta_tensor_in_a_params_state_is_refused_naming_it(kind) -> None:
    if kind == "LBFGS":
        _, opt = _stepped(lambda p: scaledoptim.LBFGS(p, max_iter=4))
        state_dict = copy.deepcopy(opt.state_dict())
        state_dict["state"][0]["old_dirs"][0] = state_dict["state"][0]["old_dirs"][0].to("meta")
        where = r"state\[0\]\['old_dirs'\]\[0\]"
    else:
        _, opt = _stepped(lambda p: scaledoptim.Adam(p))
        state_dict = copy.deepcopy(opt.state_dict())
        state_dict["state"][1]["exp_avg"] = state_dict["state"][1]["exp_avg"].to("meta")
        where = r"state\[1\]\['exp_avg'\]"
    _assert_refused(opt, state_dict, ValueError, where + r" is a meta tensor.*map_location")


def test_a_generic_optimizer_whose_torch_loader_fails_keeps_its_state() -> None:
    _, opt = _stepped(lambda p: scaledoptim.with_scaling(torch.optim.Adamax)(p, lr=0.1))
    state, groups = opt.state, opt.param_groups
    state_dict = copy.deepcopy(opt.state_dict())
    del state_dict["state"][0]["step"]  # torch.optim.Adamax.__setstate__: KeyError, halfway
    _assert_refused(opt, state_dict, ValueError, r"loader \(torch.optim's\) failed on it")
    assert opt.state is state and opt.param_groups is groups
