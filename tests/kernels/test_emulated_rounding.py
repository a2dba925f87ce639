"""The param rounding lists of every fused row's kernel (Note [param rounding]): fp32 masters and
stochastic rounding, against an fp32-param run of the same update and the torch-native
rounding. Each row runs its default config, launched as the kernel backend launches it."""

from __future__ import annotations

import pytest
import torch

from scaledoptim import kernels
from scaledoptim.testing.optim_db import OptimInfo, row, rows
from scaledoptim.torch_ops import initial_seed, stochastic_round_
from tests.support.launches import RowUpdate, row_update
from tests.support.tensors import assert_bytes_unchanged, boundary_params_and_grads, clones

ROUNDING = rows(fused=True, rounding=True)


def _bf16_params_and_grads(seed: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return boundary_params_and_grads(
        torch.bfloat16, torch.float32, torch.Generator().manual_seed(seed)
    )


def _fp32_twin(info: OptimInfo, params: list[torch.Tensor], grads) -> RowUpdate:
    """The same update over fp32 copies of ``params``, rounding nothing."""
    return row_update(info, [p.float() for p in params], grads)


def _step(*updates: RowUpdate) -> None:
    for update in updates:
        update.launch(torch.zeros(()), None)


@pytest.mark.parametrize("info", ROUNDING, ids=str)
def test_master_weights_step_exactly_like_fp32_params(info):
    params, grads = _bf16_params_and_grads()
    masters = [p.float() for p in params]
    ours = row_update(info, params, grads, master_params=masters)
    twin = _fp32_twin(info, params, grads)
    for _ in range(3):
        _step(ours, twin)
        assert_bytes_unchanged(twin.params, masters)
        assert_bytes_unchanged([m.to(torch.bfloat16) for m in masters], params)


@pytest.mark.parametrize("info", ROUNDING, ids=str)
def test_stochastic_rounding_is_the_torch_rounding_of_the_fp32_update(info):
    params, grads = _bf16_params_and_grads()
    seeds = [initial_seed(i) for i in range(len(params))]
    ours = row_update(info, params, grads, sr_seeds=seeds)
    twin = _fp32_twin(info, params, grads)
    for _ in range(3):
        _step(ours, twin)
        expected = [torch.empty_like(p) for p in params]
        stochastic_round_(expected, twin.params, seeds, twin.steps, on_host=True)
        assert_bytes_unchanged(expected, params)
        for p, p32 in zip(params, twin.params):  # one of the two neighbours of the fp32 value
            assert ((p.float() - p32).abs() <= p32.abs() * 2**-7).all()
        for p, p32 in zip(params, twin.params):  # continue from the same bf16 values
            p32.copy_(p)


@pytest.mark.parametrize("info", ROUNDING, ids=str)
@pytest.mark.parametrize("option", ["master", "stochastic"])
def test_a_skipped_step_changes_neither_param_nor_master(info, option):
    params, grads = _bf16_params_and_grads()
    if option == "master":
        update = row_update(info, params, grads, master_params=[p.float() + 1e-3 for p in params])
    else:
        update = row_update(
            info, params, grads, sr_seeds=[initial_seed(i) for i in range(len(params))]
        )
    before = clones(update.tensors)
    update.launch(torch.ones(()), None)
    assert_bytes_unchanged(before, update.tensors)


def test_stochastic_rounding_is_unbiased():
    """1 + 0.3 ulp rounds up in 30% of the elements (65536 of them: 0.3 +- 0.006 at 3 sigma)."""
    sgd = row("SGD")
    ulp = 2.0**-7
    params = [torch.ones(65536, dtype=torch.bfloat16)]
    grads = [torch.full((65536,), -0.3 * ulp)]
    update = row_update(sgd, params, grads, sgd.config("plain"), lr=1.0, sr_seeds=[initial_seed(0)])
    update.launch(None, None)
    values = params[0].float()
    assert set(values.unique().tolist()) == {1.0, 1.0 + ulp}
    assert abs((values > 1).float().mean().item() - 0.3) < 0.006


def test_masters_and_seeds_are_exclusive_and_seeds_are_int32():
    params, _ = _bf16_params_and_grads()
    masters, seeds = [p.float() for p in params], [initial_seed(i) for i in range(len(params))]
    with pytest.raises(ValueError, match="exclusive"):
        kernels.rounding_lists(masters, seeds)
    with pytest.raises(ValueError, match="0-dim int32"):
        kernels.rounding_lists([], [torch.zeros(())] * len(params))
