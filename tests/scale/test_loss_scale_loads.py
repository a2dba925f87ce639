"""A ``loss_scale`` state (in an optimizer's state_dict) or a GradScaler state that is not what
the library or torch.amp.GradScaler writes is refused before anything changes, with an error
naming the key and the fix: an unknown key, a config missing a setting (which would silently take
its default), a container of the wrong type."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

import scaledoptim
from tests.support.training import assert_bit_identical, loss_of, make_model, snapshot


def _stepped() -> scaledoptim.Adam:
    model = make_model()
    opt = scaledoptim.Adam(model.parameters(), lr=1e-2)
    opt.configure_scaling(init_scale=2.0**10, growth_factor=4.0, growth_interval=3)
    for step in range(2):
        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    return opt


def _put(path: tuple[str, ...], value: Any) -> Callable[[dict], None]:
    def edit(state_dict: dict) -> None:
        container = state_dict
        for key in path[:-1]:
            container = container[key]
        container[path[-1]] = value

    return edit


def _drop(path: tuple[str, ...]) -> Callable[[dict], None]:
    def edit(state_dict: dict) -> None:
        container = state_dict
        for key in path[:-1]:
            container = container[key]
        del container[path[-1]]

    return edit


FIX = "delete the key to start from the configured init_scale"
CASES = {
    "extra key": (_put(("loss_scale", "bogus"), 1), ValueError, r"unknown \['bogus'\]"),
    "extra config key": (
        _put(("loss_scale", "config", "bogus"), 1), ValueError, r"unknown config keys \['bogus'\]"
    ),
    "config without growth_factor": (
        _drop(("loss_scale", "config", "growth_factor")),
        ValueError,
        r"missing config keys \['growth_factor'\]",
    ),
    "config without every key": (
        _put(("loss_scale", "config"), {}), ValueError, r"missing config keys \['backoff_factor'"
    ),
    "loss_scale a list": (_put(("loss_scale",), []), TypeError, r"'loss_scale' must be a dict"),
    "loss_scale an int": (_put(("loss_scale",), 3), TypeError, r"'loss_scale' must be a dict"),
    "config a list": (_put(("loss_scale", "config"), []), TypeError, r"'config' must be a dict"),
    "config None": (_put(("loss_scale", "config"), None), TypeError, r"'config' must be a dict"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_loss_scale_state_not_as_written_is_refused_naming_the_fix(case) -> None:
    edit, error, names = CASES[case]
    opt = _stepped()
    state_dict = copy.deepcopy(opt.state_dict())
    edit(state_dict)
    before, config = snapshot(opt), dataclasses.asdict(opt.scaling_state.loss_scale.config)
    with pytest.raises(error, match=names) as raised:
        opt.load_state_dict(state_dict)
    assert FIX in str(raised.value)
    assert_bit_identical(before, snapshot(opt))
    assert dataclasses.asdict(opt.scaling_state.loss_scale.config) == config


@pytest.mark.parametrize("bad", [[], None, 3], ids=repr)
def test_a_state_dict_that_is_no_dict_is_refused_naming_the_fix(bad) -> None:
    opt = _stepped()
    before = snapshot(opt)
    with pytest.raises(TypeError, match=r"got a (list|NoneType|int): pass what opt.state_dict"):
        opt.load_state_dict(bad)
    with pytest.raises(
        TypeError, match=r"load_gradscaler_state_dict\(\) takes the dict GradScaler.state_dict"
    ):
        opt.load_gradscaler_state_dict(bad)
    assert_bit_identical(before, snapshot(opt))


@pytest.mark.parametrize("bad", [[], None], ids=repr)
def test_the_facade_names_its_own_method(bad) -> None:
    scaler = scaledoptim.GradScaler("cpu", init_scale=8.0)
    with pytest.raises(TypeError, match=r"^GradScaler.load_state_dict\(\) takes the dict"):
        scaler.load_state_dict(bad)
    assert scaler.state_dict()["scale"] == 8.0


LOADS_ONTO_MOVED_PARAMS: dict[str, Callable[[Any, dict], None]] = {
    "load_state_dict": lambda opt, saved: opt.load_state_dict(saved),
    "load_gradscaler_state_dict": lambda opt, saved: opt.load_gradscaler_state_dict(
        {"scale": 1024.0, "growth_factor": 4.0, "backoff_factor": 0.5, "growth_interval": 3,
         "_growth_tracker": 2}
    ),
    "configure_scaling": lambda opt, saved: opt.configure_scaling(
        init_scale=1024.0, growth_factor=4.0, growth_interval=3
    ),
}


@pytest.mark.parametrize("load", list(LOADS_ONTO_MOVED_PARAMS))
def test_a_scale_loaded_after_the_params_moved_lives_on_their_device(load) -> None:
    """The params moved to another device after ``S = opt.scale`` was taken (``model.cuda()``
    on a GPU; here the optimizer's params re-pointed to the model moved to ``meta``): a load
    puts the scale where the params are now, with the loaded values and config, and the old
    handle, on the old device, is never copied over: it keeps its value, and passing it is
    refused naming both devices and the fix (Note [scale handles])."""
    opt = _stepped()
    S, saved = opt.scale, copy.deepcopy(opt.state_dict())
    S.mul_(4.0)  # the old handle's value, to tell it from the loaded 1024
    model = make_model().to("meta")
    opt.param_groups[0]["params"] = list(model.parameters())
    LOADS_ONTO_MOVED_PARAMS[load](opt, saved)
    loss_scale = opt.scaling_state.loss_scale
    assert opt.scale is not S and opt.scale.device.type == "meta"
    assert loss_scale.growth_tracker.device.type == "meta"
    assert (loss_scale.config.growth_factor, loss_scale.config.growth_interval) == (4.0, 3)
    assert S.device.type == "cpu" and S.item() == 4096.0
    refusal = r"lived on cpu, but the optimizer's params moved to meta.*pass opt.scale as it is"
    with pytest.raises(RuntimeError, match=refusal):
        opt.unscale_and_step(grads_scaled_by=S)
    with pytest.raises(RuntimeError, match=refusal):
        scaledoptim.scale_outputs(loss_of(make_model(), 0), S)
