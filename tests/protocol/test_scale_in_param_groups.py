"""The loss scale state rides in every param group of ``opt.state_dict()``, the part of it that
torch.distributed.checkpoint's ``get_optimizer_state_dict`` keeps (Note [the scale through DCP],
protocol/optimizer.py); single process here, FSDP2 worlds in tests/distributed."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import scaledoptim
from tests.support.training import assert_bit_identical, loss_of, make_model, snapshot


def _trained(seed: int = 0, steps: int = 3) -> tuple[torch.nn.Module, scaledoptim.Optimizer]:
    """A model and AdamW whose scale and growth tracker differ from a fresh one's."""
    model = make_model(seed=seed)
    opt = scaledoptim.AdamW(model.parameters(), lr=1e-2)
    opt.configure_scaling(init_scale=2.0**10, growth_interval=2, hysteresis=2)
    for step in range(steps):
        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    return model, opt


def _scale_state(opt: scaledoptim.Optimizer) -> list[torch.Tensor]:
    return snapshot(opt)[-3:]


@pytest.mark.parametrize("full", [False, True])
def test_get_and_set_optimizer_state_dict_carry_the_scale(full) -> None:
    model, opt = _trained()
    assert opt.scale.item() == 2.0**11
    options = StateDictOptions(full_state_dict=full)
    saved = get_optimizer_state_dict(model, opt, options=options)
    resumed_model, resumed = _trained(seed=1, steps=0)
    set_optimizer_state_dict(resumed_model, resumed, saved, options=options)
    assert_bit_identical(_scale_state(opt), _scale_state(resumed))
    assert all("loss_scale" not in group for group in resumed.param_groups)


def test_each_optimizer_of_one_checkpoint_keeps_its_own_scale() -> None:
    model = make_model()
    first = scaledoptim.SGD(model[0].parameters(), lr=0.1).configure_scaling(init_scale=8.0)
    second = scaledoptim.SGD(model[2].parameters(), lr=0.1).configure_scaling(init_scale=32.0)
    saved = get_optimizer_state_dict(model, (first, second))
    again = [scaledoptim.SGD(model[i].parameters(), lr=0.1) for i in (0, 2)]
    set_optimizer_state_dict(model, tuple(again), saved)
    assert [opt.scale.item() for opt in again] == [8.0, 32.0]


def test_a_state_dict_with_the_scale_in_its_groups_only_loads_it() -> None:
    _, opt = _trained()
    state_dict = opt.state_dict()
    del state_dict["loss_scale"]  # what get_optimizer_state_dict keeps
    _, resumed = _trained(seed=1, steps=0)
    resumed.load_state_dict(state_dict)
    assert_bit_identical(_scale_state(opt), _scale_state(resumed))
    assert "loss_scale" not in resumed.param_groups[0]


def test_the_top_level_scale_wins_over_the_groups_copies() -> None:
    """The older DCP recipe loads the scale saved beside as the top-level key."""
    _, opt = _trained()
    _, resumed = _trained(seed=1, steps=0)
    resumed.load_state_dict({**resumed.state_dict(), "loss_scale": opt.state_dict()["loss_scale"]})
    assert_bit_identical(_scale_state(opt), _scale_state(resumed))


def _two_groups() -> scaledoptim.Optimizer:
    model = make_model()
    return scaledoptim.AdamW(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.1}]
    )


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda groups: groups[1].pop("loss_scale"), "carry the loss scale state"),
        (lambda groups: groups[1]["loss_scale"]["scale"].fill_(2.0), "differs from"),
        (lambda groups: groups[1]["loss_scale"]["config"].update(hysteresis=3), "differs from"),
    ],
    ids=["one-group-without", "another-scale", "another-config"],
)
def test_groups_that_disagree_on_the_scale_are_refused_and_nothing_changes(edit, match) -> None:
    opt = _two_groups()
    state_dict = opt.state_dict()
    del state_dict["loss_scale"]
    edit(state_dict["param_groups"])
    before = snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(state_dict)
    assert_bit_identical(before, snapshot(opt))
