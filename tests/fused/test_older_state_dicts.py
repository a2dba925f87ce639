"""A state_dict of an older release, whose param groups lack options added since (torch's
``foreach``, ``fused``, ``maximize``, ...), loads as torch.optim loads it: the missing options take
torch's legacy values (``None`` for ``foreach`` and ``fused``: "let the implementation choose"),
whatever the loading optimizer was built with, and the next step is torch.optim's."""

from __future__ import annotations

import copy

import pytest
import torch

import scaledoptim
from scaledoptim.testing import torch_optim_db
from tests.support.training import assert_bit_identical, loss_of, make_model, snapshot

pytestmark = pytest.mark.usefixtures("kernel_backend")

#: The fused drop-ins of torch's classes, with the flags each takes.
FLAGS = {
    "Adam": ("foreach", "fused"),
    "AdamW": ("foreach", "fused"),
    "SGD": ("foreach", "fused"),
    "Adagrad": ("foreach", "fused"),
    "RMSprop": ("foreach",),
}
#: Options torch's table says the first releases lacked.
NEWER = {info.name: info.not_og_supported_flags for info in torch_optim_db.rows(FLAGS)}


def _cases():
    for name, flags in FLAGS.items():
        for flag in flags:
            for value in (True, False, None):
                yield pytest.param(name, {flag: value}, id=f"{name}-{flag}={value}")


def _stepped(cls, kwargs):
    model = make_model()
    opt = cls(model.parameters(), lr=1e-2, **kwargs)
    for step in range(2):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("name, kwargs", list(_cases()))
def test_groups_without_newer_options_load_and_step_as_torch_optim(name, kwargs) -> None:
    model, opt = _stepped(getattr(scaledoptim, name), kwargs)
    ref_model, ref = _stepped(getattr(torch.optim, name), kwargs)
    old = copy.deepcopy(ref.state_dict())
    for group in old["param_groups"]:
        for option in NEWER[name]:
            group.pop(option, None)

    opt.load_state_dict(copy.deepcopy(old))
    ref.load_state_dict(copy.deepcopy(old))

    for ours, theirs in zip(opt.param_groups, ref.param_groups, strict=True):
        assert {k: ours[k] for k in theirs if k != "params"} == {
            k: v for k, v in theirs.items() if k != "params"
        }
    for m, o in ((model, opt), (ref_model, ref)):
        o.zero_grad()
        loss_of(m, 2).backward()
        o.step()
    for ours, theirs in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("name", [n for n, flags in FLAGS.items() if "fused" in flags])
def test_a_group_saved_with_fused_none_loads_into_a_fused_true_optimizer(name) -> None:
    """``fused=None`` is what an optimizer built without the flag saves."""
    _, saved = _stepped(getattr(scaledoptim, name), {})
    model, opt = _stepped(getattr(scaledoptim, name), {"fused": True})
    opt.load_state_dict(saved.state_dict())
    assert opt.param_groups[0]["fused"] is None
    opt.zero_grad()
    loss_of(model, 2).backward()
    opt.step()


def test_a_flag_that_is_no_bool_nor_none_is_refused_naming_it_changing_nothing() -> None:
    _, opt = _stepped(scaledoptim.AdamW, {"fused": True})
    state_dict = opt.state_dict()
    state_dict["param_groups"][0]["foreach"] = "yes"
    before, groups = snapshot(opt), _options(opt)
    with pytest.raises(
        TypeError,
        match=r"param_groups\[0\]\['foreach'\] must be a bool \(True, False or None\), got 'yes'",
    ):
        opt.load_state_dict(state_dict)
    assert_bit_identical(before, snapshot(opt))
    assert _options(opt) == groups


def _options(opt):
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
