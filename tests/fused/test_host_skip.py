"""The CPU torch forms that skip on the host and update in place (Note [host skip]) compute what
the sync-free form computes, and the CPU step counters are packed (Note [packed counters])."""

from __future__ import annotations

import importlib

import pytest
import torch

import scaledoptim
from scaledoptim.fused.backends.torch_native import TORCH_NATIVE, decide_skips_on_device
from scaledoptim.testing.optim_db import row
from scaledoptim.torch_ops import PackedSteps

CONFIGS = {
    "Lion": [{}, {"weight_decay": 0.1}, {"maximize": True, "weight_decay": 0.1}],
    "LAMB": [
        {},
        {"weight_decay": 0.0},
        {"adam_w_mode": False},
        {"use_nvlamb": True, "weight_decay": 0.0},
        {"max_grad_norm": 0.0},
        {"bias_correction": False, "grad_averaging": False},
    ],
    "RMSprop": [
        {},
        {"centered": True},
        {"momentum": 0.9},
        {"weight_decay": 0.1},
        {"centered": True, "momentum": 0.9, "weight_decay": 0.1},
        {"maximize": True, "centered": True, "momentum": 0.9},
        {"maximize": True, "weight_decay": 0.1},
    ],
}


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch) -> None:
    monkeypatch.delenv("SCALEDOPTIM_KERNELS", raising=False)  # a CPU's default: torch's ops


CASES = [(name, kwargs) for name, configs in CONFIGS.items() for kwargs in configs]


def _run(name: str, kwargs: dict, on_device: bool) -> tuple[list[torch.Tensor], dict]:
    torch.manual_seed(0)
    # Tensors of a few sizes, one over a batch of the in-place form (torch_ops.BATCH).
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 1000, 4096, (1 << 18) + 5)]
    opt = row(name).make(params, lr=1e-2, **kwargs)
    S = opt.scale
    for step in range(4):
        for p in params:
            p.grad = torch.randn(p.shape) * S
        if step == 2:
            params[1].grad[0] = float("inf")
        if on_device:
            with decide_skips_on_device():
                opt.unscale_and_step(grads_scaled_by=S)
        else:
            opt.unscale_and_step(grads_scaled_by=S)
        S = opt.scale
    return [p.detach().clone() for p in params], opt.state_dict()["state"]


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=str)
def test_the_in_place_cpu_form_matches_the_sync_free_form(name, kwargs) -> None:
    (params, state), (ref_params, ref_state) = _run(name, kwargs, False), _run(name, kwargs, True)
    # Both drivers run the optimizer's one torch form (Note [one torch form]): the same bits by
    # construction, LAMB's too (its form batches itself the same way on both).
    for p, ref in zip(params, ref_params):
        assert torch.equal(p, ref)
    for i, entries in ref_state.items():
        for key, ref in entries.items():
            torch.testing.assert_close(state[i][key], ref, rtol=0, atol=0)
    assert all(state[i]["step"].item() == 3.0 for i in state)  # the overflowed step is not counted


@pytest.mark.parametrize("kwargs", [{}, {"use_nvlamb": True, "weight_decay": 0.0}], ids=str)
def test_lamb_computes_a_large_tensors_direction_again_to_the_same_bits(
    kwargs, monkeypatch
) -> None:
    # A tensor over BATCH is updated by pieces; its direction is kept for the trust ratio up to
    # KEPT_DIRECTION elements, else computed again: the same ops, so the same bits.
    kept_params, kept_state = _run("LAMB", kwargs, False)
    monkeypatch.setattr(
        importlib.import_module("scaledoptim.fused.backends.in_place"), "KEPT_DIRECTION", 0
    )
    params, state = _run("LAMB", kwargs, False)
    assert all(map(torch.equal, params, kept_params))
    assert all(torch.equal(state[i]["exp_avg"], kept_state[i]["exp_avg"]) for i in state)


def test_cpu_counters_are_packed_and_survive_a_state_dict_round_trip() -> None:
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 5, 7)]
    opt = scaledoptim.SGD(params, lr=0.1, momentum=0.9)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.unscale_and_step()
    counters = [opt.state[p]["step"] for p in params]
    flat = counters[0]._base
    assert flat is not None and all(c._base is flat for c in counters)
    assert flat.tolist() == [3.0, 3.0, 3.0]
    copy = scaledoptim.SGD(
        [torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.1, momentum=0.9
    )
    copy.load_state_dict(opt.state_dict())
    torch.optim.SGD(params, lr=0.1, momentum=0.9).load_state_dict(opt.state_dict())
    for p in copy.param_groups[0]["params"]:
        p.grad = torch.randn(p.shape)
    copy.unscale_and_step()
    assert [copy.state[p]["step"].item() for p in copy.param_groups[0]["params"]] == [4.0] * 3
    assert isinstance(PackedSteps(torch.zeros(2)), list)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_whether_a_cpu_step_skips_on_the_host_is_the_engines_parameter(name, monkeypatch) -> None:
    # See Note [host skip]: the one switch (the torch-native engine's host_skip) decides, passed
    # down to the torch form that reads found_inf.
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(t) or item(t))
    results = []
    for host_skip in (True, False):
        monkeypatch.setattr(TORCH_NATIVE, "host_skip", host_skip)
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 1000)]
        opt = row(name).make(params, lr=1e-2)
        for p in params:
            p.grad = torch.randn(p.shape) * opt.scale
        reads.clear()
        opt.unscale_and_step(grads_scaled_by=opt.scale)
        assert bool(reads) == host_skip, reads
        results.append([p.detach().clone() for p in params])
    for ours, reference in zip(*results):
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
