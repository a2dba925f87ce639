"""The cast cache: parameters are cast once per outermost region."""

from __future__ import annotations

import weakref

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaledoptim import amp


@settings(max_examples=5, deadline=None)
@given(uses=st.integers(1, 5), low=st.sampled_from([torch.bfloat16, torch.float16]))
def test_parameter_used_repeatedly_is_cast_once(uses, low):
    amp.set_policy("aten::mul.Tensor", "lower_precision_fp", "cpu")
    weight = torch.nn.Parameter(torch.randn(4))
    x = torch.randn(4, requires_grad=True) * 1.0  # not a leaf: never cached
    with amp.autocast("cpu", dtype=low):
        outputs = [x * weight for _ in range(uses)]
        assert amp.cache_stats() == {"hits": uses - 1, "misses": 1, "size": 1}
    assert amp.cache_stats() == {"hits": uses - 1, "misses": 1, "size": 0}
    for output in outputs:  # autograd saved the low precision inputs
        assert output.grad_fn._saved_other.dtype == low
        assert output.grad_fn._saved_self.dtype == low
    torch.stack(outputs).sum().backward()
    assert weight.grad.dtype == torch.float32
    # The uses' grads are summed in low precision at the one cached cast.
    expected = uses * x.detach().to(low).float()
    torch.testing.assert_close(weight.grad, expected, rtol=2e-2, atol=2e-2)


def test_views_non_leaves_and_plain_tensors_are_not_cached():
    amp.set_policy("aten::mul.Tensor", "lower_precision_fp", "cpu")
    weight = torch.nn.Parameter(torch.randn(4, 4))
    hidden = weight.exp()  # a non-leaf
    with amp.autocast("cpu"):
        weight[0] * weight[1]  # views
        hidden * 2.0
        torch.randn(4) * torch.randn(4)  # not requiring grad
        assert amp.cache_stats() == {"hits": 0, "misses": 0, "size": 0}


def test_cache_disabled_or_no_grad_caches_nothing():
    amp.set_policy("aten::mul.Tensor", "lower_precision_fp", "cpu")
    weight = torch.nn.Parameter(torch.randn(4))
    with amp.autocast("cpu", cache_enabled=False):
        weight * weight
        assert amp.cache_stats()["size"] == 0
    with amp.autocast("cpu"), torch.no_grad():
        weight * weight
        assert amp.cache_stats()["size"] == 0


def test_cache_lives_until_the_outermost_region_exits():
    amp.set_policy("aten::mul.Tensor", "lower_precision_fp", "cpu")
    weight = torch.nn.Parameter(torch.randn(4))
    with amp.autocast("cpu"):
        with amp.autocast("cpu"):
            weight * 2.0
        assert amp.cache_stats()["size"] == 1
        weight * 3.0
        assert amp.cache_stats() == {"hits": 1, "misses": 1, "size": 1}
    assert amp.cache_stats()["size"] == 0
    with amp.autocast("cpu"):  # a new outermost region starts counting afresh
        assert amp.cache_stats() == {"hits": 0, "misses": 0, "size": 0}


def test_nested_region_with_another_dtype_does_not_reuse_a_cast():
    amp.set_policy("aten::mul.Tensor", "lower_precision_fp", "cpu")
    weight = torch.nn.Parameter(torch.randn(4))
    with amp.autocast("cpu", dtype=torch.bfloat16):
        assert (weight * 2.0).dtype == torch.bfloat16
        with amp.autocast("cpu", dtype=torch.float16):
            assert (weight * 2.0).dtype == torch.float16


def test_cache_releases_tensors_after_the_region():
    # A cached cast keeps its source alive through autograd (as in ATen) until the
    # outermost region exits; the key itself is weak.
    amp.set_policy("aten::mul.Tensor", "lower_precision_fp", "cpu")
    with amp.autocast("cpu"):
        weight = torch.nn.Parameter(torch.randn(4))
        alive = weakref.ref(weight)
        weight * 2.0
        del weight
    assert alive() is None
