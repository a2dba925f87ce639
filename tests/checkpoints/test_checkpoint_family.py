"""The checkpoint family: a checkpoint the library writes resumes bit for bit, and state_dicts
cross between scaledoptim and torch.optim both ways.

* Round trip: every generic config of every fused row, once, through ``torch.save`` /
  ``torch.load``, mid hysteresis and mid growth interval, on param dtypes (fp32, bf16, bf16 with
  master weights, bf16 with stochastic rounding) and backends (our kernels in the emulator, the
  torch forms) that alternate over the rows, every one of them met by every optimizer.
* torch.optim -> scaledoptim: a plain ``torch.optim`` state_dict loads with the configured
  scale and steps as torch.optim does; scaledoptim -> torch.optim: ours loads into torch.optim's
  class (which ignores the ``loss_scale`` key) and steps as ours does.

The rest of the family lives with the code it checks: GradScaler state both ways
(tests/scale/test_gradscaler_state.py), older formats and load hooks
(tests/optim/test_fidelity.py), DCP (tests/distributed), the corruption fuzz
(tests/fused/test_load_state_dict_mutations.py); refused checkpoints are rows of the refusal
table (tests/refusals).
"""

from __future__ import annotations

import copy
import io
import itertools
from typing import Any

import pytest
import torch

import scaledoptim
from scaledoptim.testing.optim_db import Config, OptimInfo, rows
from tests.support.references import kernels_mode
from tests.support.training import assert_bit_identical, loss_of, make_model, snapshot

#: name: (param dtype, rounding options).
DTYPES: dict[str, tuple[torch.dtype, dict[str, bool]]] = {
    "fp32": (torch.float32, {}),
    "bf16": (torch.bfloat16, {}),
    "bf16+master": (torch.bfloat16, {"master_weights": True}),
    "bf16+sr": (torch.bfloat16, {"stochastic_rounding": True}),
}
OVERFLOWS = {2, 5, 6}


def _round_trips() -> list[Any]:
    cases = []
    for info in rows(fused=True):
        dtypes = [name for name, (_, options) in DTYPES.items() if info.rounding or not options]
        count = max(len(info.generic_configs), len(dtypes))
        for i, config, dtype in zip(range(count), itertools.cycle(info.generic_configs),
                                    itertools.cycle(dtypes)):
            backend = ("emulate", "torch")[i % 2]
            cases.append(pytest.param(info, config, dtype, backend,
                                      id=f"{info.name}-{config.name}-{dtype}-{backend}"))
    return cases


def _train(model: torch.nn.Module, opt: Any, steps: range) -> None:
    S = opt.scale
    for step in steps:
        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, step), S).backward()
        if step in OVERFLOWS:
            model[2].bias.grad[0] = float("inf")
        _, _, S = opt.unscale_and_step(grads_scaled_by=S)


@pytest.mark.parametrize(("info", "config", "dtype", "backend"), _round_trips())
def test_a_checkpoint_resumes_bit_for_bit(
    info: OptimInfo, config: Config, dtype: str, backend: str
) -> None:
    """Saved mid hysteresis (an overflow tolerated) and, later, mid growth interval (a clean
    step counted), through torch.save/torch.load; each resumes bit for bit."""
    param_dtype, options = DTYPES[dtype]

    def fresh() -> tuple[torch.nn.Module, Any]:
        model = make_model(param_dtype)
        opt = info.make(model.parameters(), config, **options)
        return model, opt.configure_scaling(init_scale=2.0**8, growth_interval=3, hysteresis=2)

    def saved(model: torch.nn.Module, opt: Any) -> io.BytesIO:
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
        buffer.seek(0)
        return buffer

    with kernels_mode(backend):
        model, opt = fresh()
        _train(model, opt, range(6))
        mid_hysteresis = saved(model, opt)
        _train(model, opt, range(6, 8))
        mid_growth = saved(model, opt)
        _train(model, opt, range(8, 12))
        for buffer, start, (key, value) in (
            (mid_hysteresis, 6, ("hysteresis_tracker", 1)),
            (mid_growth, 8, ("growth_tracker", 1)),
        ):
            checkpoint = torch.load(buffer)
            resumed_model, resumed_opt = fresh()
            resumed_model.load_state_dict(checkpoint["model"])
            resumed_opt.load_state_dict(checkpoint["opt"])
            assert resumed_opt.state_dict()["loss_scale"][key].item() == value, key
            _train(resumed_model, resumed_opt, range(start, 12))
            assert_bit_identical(snapshot(opt), snapshot(resumed_opt))


def _torch_configs() -> list[Any]:
    return [
        pytest.param(info, config, ("emulate", "torch")[i % 2],
                     id=f"{info.name}-{config.name}-{('emulate', 'torch')[i % 2]}")
        for info in rows(fused=True, reference=True)
        for i, config in enumerate(info.generic_configs)
    ]


def _steps_alike(info: OptimInfo, pairs: list[tuple[torch.nn.Module, Any]]) -> None:
    for step in range(3, 6):
        for model, opt in pairs:
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()
    (ref_model, _), (model, _) = pairs
    tolerance = info.tolerance
    for ref_p, p in zip(ref_model.parameters(), model.parameters()):
        torch.testing.assert_close(
            p, ref_p, rtol=tolerance.trajectory_rtol, atol=tolerance.trajectory_atol
        )


def _trained_plainly(opt: Any, model: torch.nn.Module) -> None:
    for step in range(3):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()


@pytest.mark.parametrize(("info", "config", "backend"), _torch_configs())
def test_a_torch_optim_state_dict_loads_with_the_configured_scale(info, config, backend) -> None:
    with kernels_mode(backend):
        ref_model, model = make_model(), make_model()
        ref_opt = info.reference_for(ref_model.parameters(), config)
        _trained_plainly(ref_opt, ref_model)
        model.load_state_dict(ref_model.state_dict())
        opt = info.make(model.parameters(), config).configure_scaling(init_scale=512.0)
        opt.load_state_dict(ref_opt.state_dict())
        assert opt.scale.item() == 512.0
        _steps_alike(info, [(ref_model, ref_opt), (model, opt)])


@pytest.mark.parametrize(("info", "config", "backend"), _torch_configs())
def test_our_state_dict_loads_into_torch_optim(info, config, backend) -> None:
    with kernels_mode(backend):
        model, ref_model = make_model(), make_model()
        opt = info.make(model.parameters(), config)
        _trained_plainly(opt, model)
        ref_model.load_state_dict(model.state_dict())
        ref_opt = info.reference_for(ref_model.parameters(), config)
        ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        _steps_alike(info, [(model, opt), (ref_model, ref_opt)])


def test_bf16_state_stays_fp32_through_a_load() -> None:
    model = make_model(torch.bfloat16)
    opt = scaledoptim.AdamW(model.parameters())
    _train(model, opt, range(2))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())


@pytest.mark.parametrize("name", ["LAMB", "Lion"])
def test_a_load_adds_no_option_the_optimizer_lacks(name) -> None:
    # torch.optim's __setstate__ gives every optimizer's defaults a `differentiable`, which LAMB
    # and Lion do not have; their groups would gain it (a DCP resume's groups then differ).
    model = make_model()
    opt = getattr(scaledoptim, name)(model.parameters())
    _train(model, opt, range(2))
    keys = set(opt.defaults), [set(group) for group in opt.param_groups]
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert (set(opt.defaults), [set(group) for group in opt.param_groups]) == keys
    copied = copy.deepcopy(opt)
    assert (set(copied.defaults), [set(group) for group in copied.param_groups]) == keys
