"""Ops that write into an argument: refused when their schema says so, and batch_norm's
running statistics, which it writes without saying so, are never cast.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from scaledoptim import amp


@pytest.mark.parametrize(
    "op, instead",
    [
        ("aten::add_.Tensor", "'aten::add.Tensor'"),
        (torch.ops.aten.add_.Tensor, "'aten::add.Tensor'"),
        ("aten::add_", "'aten::add.Tensor'"),  # a packet of in-place overloads only
        ("aten::mm.out", "'aten::mm'"),
        ("aten::sum.IntList_out", "'aten::sum.dim_IntList'"),
        ("aten::_native_batch_norm_legit", "functional overload"),  # running_mean(a!)
    ],
)
@pytest.mark.parametrize("policy", ["lower_precision_fp", "fp32", None])
def test_policy_on_a_mutating_overload_is_refused_and_changes_nothing(op, instead, policy):
    amp.set_policy("aten::exp", "fp32", "cpu")
    before = amp.edited_policies()
    with pytest.raises(ValueError, match="writes into its argument") as error:
        amp.set_policy(op, policy, "cpu")
    assert "write would be lost" in str(error.value) and instead in str(error.value)
    assert amp.edited_policies() == before
    assert amp.get_policy(op, "cpu") is None


def test_in_place_add_under_a_functional_policy_writes_its_result():
    # The functional overload's policy does not reach the in-place one: x += y still lands.
    amp.set_policy("aten::add.Tensor", "lower_precision_fp", "cpu")
    x, y = torch.zeros(3), torch.ones(3)
    with amp.autocast("cpu", dtype=torch.bfloat16):
        x.add_(y)
        assert (x + y).dtype == torch.bfloat16
    assert torch.equal(x, torch.ones(3))


def _batch_norm_inputs(shape, generator, input_dtype):
    channels = shape[1]
    x = torch.randn(*shape, generator=generator).to(input_dtype)
    weight = torch.rand(channels, generator=generator) + 0.5
    bias = torch.randn(channels, generator=generator)
    running = (
        torch.randn(channels, generator=generator),
        torch.rand(channels, generator=generator) + 0.5,
    )
    return x, weight, bias, running


@settings(max_examples=12, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=2, max_size=4).filter(
        lambda s: s[0] * (s[2:] or [1])[0] > 1
    ),
    low=st.sampled_from([torch.bfloat16, torch.float16]),
    policy=st.sampled_from(["lower_precision_fp", "fp32", "promote"]),
    momentum=st.sampled_from([0.1, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_batch_norm_running_stats_update_as_without_autocast(shape, low, policy, momentum, seed):
    # fp32 statistics and parameters (a float32 module); the input arrives in the dtype a
    # policy would not give it, so every policy casts it.
    input_dtype = torch.float32 if policy == "lower_precision_fp" else low
    computes_in = low if policy == "lower_precision_fp" else torch.float32
    x, weight, bias, (mean, var) = _batch_norm_inputs(
        shape, torch.Generator().manual_seed(seed), input_dtype
    )
    ours_mean, ours_var, ref_mean, ref_var = mean.clone(), var.clone(), mean.clone(), var.clone()

    amp.set_policy("aten::batch_norm", policy, "cpu")
    with amp.autocast("cpu", dtype=low):
        out = F.batch_norm(x, ours_mean, ours_var, weight, bias, training=True, momentum=momentum)
    # The reference runs without autocast on the input the policy computes with; torch's
    # own autocast has no batch_norm kernel, so a plain region gives the same.
    expected = F.batch_norm(
        x.to(computes_in), ref_mean, ref_var, weight, bias, training=True, momentum=momentum
    )
    assert not torch.equal(ref_mean, mean)  # the statistics did move
    assert torch.equal(ours_mean, ref_mean) and torch.equal(ours_var, ref_var)
    assert ours_mean.dtype == torch.float32 and ours_var.dtype == torch.float32
    assert out.dtype == expected.dtype == computes_in
    assert torch.equal(out, expected)
    torch_mean, torch_var = mean.clone(), var.clone()
    with torch.autocast("cpu", dtype=low):
        F.batch_norm(
            x.to(computes_in), torch_mean, torch_var, weight, bias, training=True, momentum=momentum
        )
    assert torch.equal(torch_mean, ours_mean) and torch.equal(torch_var, ours_var)


@pytest.mark.parametrize("policy", ["lower_precision_fp", "fp32"])
def test_batch_norm_module_updates_its_buffers_and_gets_grads(policy):
    amp.set_policy("aten::batch_norm", policy, "cpu")
    module, reference = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    computes_in = torch.bfloat16 if policy == "lower_precision_fp" else torch.float32
    given = x.bfloat16() if policy == "fp32" else x  # an input the policy must cast
    with amp.autocast("cpu", dtype=torch.bfloat16):
        out = module(given)
    expected = reference(given.to(computes_in))
    assert torch.equal(module.running_mean, reference.running_mean)
    assert torch.equal(module.running_var, reference.running_var)
    assert int(module.num_batches_tracked) == 1
    out.float().sum().backward()
    expected.float().sum().backward()
    assert module.weight.grad.dtype == torch.float32
    assert torch.equal(module.weight.grad, reference.weight.grad)
