"""The param rounding lists of every optimizer kernel (Note [param rounding]): fp32 masters and
stochastic rounding, against an fp32-param run of the same kernel and the torch-native rounding."""

from __future__ import annotations

import pytest
import torch

import scaledoptim
from scaledoptim import kernels
from scaledoptim.torch_ops import initial_seed, stochastic_round_
from tests.kernels.kernel_reference import (
    adam_options,
    assert_bytes_unchanged,
    boundary_params_and_grads,
    sgd_options,
    snapshot,
)
from tests.kernels.kernel_reference_more import adagrad_options, lion_options


def _adam(params, grads, state, steps, **rounding):
    scaledoptim.optim.adam.adam_(params, grads, *state[:2], [], steps, **adam_options(lr=1e-2), **rounding)


def _sgd(params, grads, state, steps, **rounding):
    scaledoptim.optim.sgd.sgd_(params, grads, state[0], steps, **sgd_options(), **rounding)


def _adagrad(params, grads, state, steps, **rounding):
    scaledoptim.optim.adagrad.adagrad_(params, grads, state[0], steps, **adagrad_options(lr=0.1), **rounding)


def _lion(params, grads, state, steps, **rounding):
    scaledoptim.optim.lion.lion_(params, grads, state[0], steps, **lion_options(weight_decay=0.1), **rounding)


# Everything a kernel table row needs: each optimizer kernel, through its functional form.
CASE = dict(
    launches={"adam": _adam, "sgd": _sgd, "adagrad": _adagrad, "lion": _lion},
    options=["master", "stochastic"],
)


def _setup(seed=3):
    params, grads = boundary_params_and_grads(
        torch.bfloat16, torch.float32, torch.Generator().manual_seed(seed)
    )
    state = [[torch.zeros(p.shape) for p in params] for _ in range(2)]
    return params, grads, state, [torch.zeros(()) for _ in params]


def _fp32_twin(params, state, steps):
    return (
        [p.float() for p in params],
        [[t.clone() for t in s] for s in state],
        [s.clone() for s in steps],
    )


@pytest.mark.parametrize("name", CASE["launches"])
def test_master_weights_step_exactly_like_fp32_params(name):
    launch = CASE["launches"][name]
    params, grads, state, steps = _setup()
    masters = [p.float() for p in params]
    fp32_params, fp32_state, fp32_steps = _fp32_twin(params, state, steps)
    for _ in range(3):
        launch(
            params,
            grads,
            state,
            steps,
            found_inf=torch.zeros(()),
            inv_scale=None,
            master_params=masters,
        )
        launch(
            fp32_params, grads, fp32_state, fp32_steps, found_inf=torch.zeros(()), inv_scale=None
        )
        assert_bytes_unchanged(fp32_params, masters)
        assert_bytes_unchanged([m.to(torch.bfloat16) for m in masters], params)


@pytest.mark.parametrize("name", CASE["launches"])
def test_stochastic_rounding_is_the_torch_rounding_of_the_fp32_update(name):
    launch = CASE["launches"][name]
    params, grads, state, steps = _setup()
    seeds = [initial_seed(i) for i in range(len(params))]
    fp32_params, fp32_state, fp32_steps = _fp32_twin(params, state, steps)
    for _ in range(3):
        launch(
            params, grads, state, steps, found_inf=torch.zeros(()), inv_scale=None, sr_seeds=seeds
        )
        launch(
            fp32_params, grads, fp32_state, fp32_steps, found_inf=torch.zeros(()), inv_scale=None
        )
        expected = [torch.empty_like(p) for p in params]
        stochastic_round_(expected, fp32_params, seeds, fp32_steps)
        assert_bytes_unchanged(expected, params)
        for p, p32 in zip(params, fp32_params):  # one of the two neighbours of the fp32 value
            assert ((p.float() - p32).abs() <= p32.abs() * 2**-7).all()
        fp32_params = [p.float() for p in params]  # continue from the same bf16 values


@pytest.mark.parametrize("name", CASE["launches"])
@pytest.mark.parametrize("option", CASE["options"])
def test_a_skipped_step_changes_neither_param_nor_master(name, option):
    launch = CASE["launches"][name]
    params, grads, state, steps = _setup()
    rounding = (
        dict(master_params=[p.float() + 1e-3 for p in params])
        if option == "master"
        else dict(sr_seeds=[initial_seed(i) for i in range(len(params))])
    )
    before = snapshot(
        params + [t for s in state for t in s] + steps + rounding.get("master_params", [])
    )
    launch(params, grads, state, steps, found_inf=torch.ones(()), inv_scale=None, **rounding)
    assert_bytes_unchanged(
        before, params + [t for s in state for t in s] + steps + rounding.get("master_params", [])
    )


def test_stochastic_rounding_is_unbiased():
    """1 + 0.3 ulp rounds up in 30% of the elements (65536 of them: 0.3 +- 0.006 at 3 sigma)."""
    ulp = 2.0**-7
    params = [torch.ones(65536, dtype=torch.bfloat16)]
    grads = [torch.full((65536,), -0.3 * ulp)]
    scaledoptim.optim.sgd.sgd_(
        params, grads, [], [torch.zeros(())], **sgd_options(lr=1.0, momentum=0.0),
        found_inf=None, inv_scale=None, sr_seeds=[initial_seed(0)],
    )  # fmt: skip
    values = params[0].float()
    assert set(values.unique().tolist()) == {1.0, 1.0 + ulp}
    assert abs((values > 1).float().mean().item() - 0.3) < 0.006


def test_masters_and_seeds_are_exclusive_and_seeds_are_int32():
    params, grads, state, steps = _setup()
    with pytest.raises(ValueError, match="exclusive"):
        _lion(params, grads, state, steps, found_inf=None, inv_scale=None,
              master_params=[p.float() for p in params], sr_seeds=[initial_seed(0)] * len(params))  # fmt: skip
    with pytest.raises(ValueError, match="0-dim int32"):
        _lion(
            params,
            grads,
            state,
            steps,
            found_inf=None,
            inv_scale=None,
            sr_seeds=[torch.zeros(())] * len(params),
        )
