"""Loads of 8-bit states: a corrupt entry is refused before anything changes; float32 states
(torch.optim's, or state_bits=32's) load encoded; sharded params are refused, naming why."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import scaledoptim
from scaledoptim.fused.lowbit import SIGNED, UNSIGNED, quantize_blockwise
from tests.support.training import assert_bit_identical, loss_of, make_model, snapshot


def _stepped(state_bits: int = 8, cls: Any = scaledoptim.AdamW) -> tuple[torch.nn.Module, Any]:
    model = make_model()
    opt = cls(model.parameters(), lr=1e-2, state_bits=state_bits, block_size=16)
    for step in range(2):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
    return model, opt


def _set(key: str, value: Callable[[torch.Tensor], Any]) -> Callable[[dict], None]:
    def corrupt(state_dict: dict) -> None:
        entry = state_dict["state"][0]
        entry[key] = value(entry[key])

    return corrupt


CORRUPTIONS = {
    "float codes": (_set("exp_avg_codes", lambda t: t.float()), ValueError, "uint8"),
    "int8 codes": (_set("exp_avg_codes", lambda t: t.to(torch.int8)), ValueError, "uint8"),
    "codes of another shape": (_set("exp_avg_codes", lambda t: t[:1]), ValueError, "shape"),
    "transposed codes": (_set("exp_avg_codes", lambda t: t.t().contiguous().t()), ValueError,
                         "strides"),
    "a scale too few": (_set("exp_avg_sq_scales", lambda t: t[1:]), ValueError, "per block"),
    "float64 scales": (_set("exp_avg_scales", lambda t: t.double()), ValueError, "float32"),
    "a negative scale": (_set("exp_avg_scales", lambda t: -t), ValueError, "negative"),
    "a nan scale": (_set("exp_avg_sq_scales", lambda t: t * float("nan")), ValueError,
                    "non-finite"),
    "scales as a list": (_set("exp_avg_scales", lambda t: t.tolist()), TypeError, "not a tensor"),
    "no codes": (lambda sd: sd["state"][0].pop("exp_avg_sq_codes"), ValueError,
                 "exp_avg_sq_codes"),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_a_corrupt_entry_is_refused_and_changes_nothing(name: str) -> None:
    corrupt, error, match = CORRUPTIONS[name]
    _, source = _stepped()
    state_dict = source.state_dict()
    corrupt(state_dict)
    _, opt = _stepped()
    before = snapshot(opt)
    with pytest.raises(error, match=match):
        opt.load_state_dict(state_dict)
    assert_bit_identical(before, snapshot(opt))


@pytest.mark.parametrize("source", ["torch.optim", "state_bits=32"])
def test_float32_states_load_as_their_nearest_codes(source: str) -> None:
    model = make_model()
    if source == "torch.optim":
        float32: Any = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        float32 = scaledoptim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        float32.zero_grad()
        loss_of(model, step).backward()
        float32.step()
    opt = scaledoptim.AdamW(model.parameters(), lr=1e-2, state_bits=8, block_size=16)
    opt.load_state_dict(float32.state_dict())
    assert opt.param_groups[0]["state_bits"] == 8 and opt.param_groups[0]["block_size"] == 16
    for param in model.parameters():
        state = opt.state[param]
        for key, code in (("exp_avg", SIGNED), ("exp_avg_sq", UNSIGNED)):
            codes, scales = quantize_blockwise(float32.state[param][key], code, 16)
            assert torch.equal(state[f"{key}_codes"], codes)
            assert torch.equal(state[f"{key}_scales"], scales)
        assert state["step"].item() == 2.0
    opt.zero_grad()
    loss_of(model, 2).backward()
    opt.step()  # and it steps on


@pytest.fixture
def one_rank_mesh():
    """A DeviceMesh of this process alone (a gloo group of one)."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_sharded_params_are_refused_naming_why(one_rank_mesh) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    weight = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), one_rank_mesh, [Shard(0)]))
    with pytest.raises(ValueError, match=r"DTensor.*state_bits=32"):
        scaledoptim.AdamW([weight], state_bits=8)
    plain = torch.nn.Parameter(torch.randn(8, 4))
    opt = scaledoptim.AdamW([plain], state_bits=8)
    opt.param_groups[0]["params"] = [weight]  # (a model sharded after the optimizer was made)
    weight.grad = distribute_tensor(torch.ones(8, 4), one_rank_mesh, [Shard(0)])
    with pytest.raises(ValueError, match="DTensor"):
        opt.step()
    assert not opt.state
