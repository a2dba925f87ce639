"""Nesting, threads and the autocast decorator."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaledoptim import amp
from scaledoptim.amp.regions import in_scaledoptim_region

LOW = st.sampled_from([torch.bfloat16, torch.float16])


def _mm_and_exp_dtypes():
    x = torch.randn(2, 2)
    return torch.mm(x, x).dtype, torch.exp(x).dtype


@settings(max_examples=4, deadline=None)
@given(outer=LOW, inner=LOW)
def test_nesting_disable_and_redtype(outer, inner):
    amp.set_policy("aten::exp", "lower_precision_fp", "cpu")
    with amp.autocast("cpu", dtype=outer):
        assert _mm_and_exp_dtypes() == (outer, outer)
        with amp.autocast("cpu", enabled=False):
            assert _mm_and_exp_dtypes() == (torch.float32, torch.float32)
            assert not torch.is_autocast_enabled("cpu")
        with amp.autocast("cpu", dtype=inner):
            assert _mm_and_exp_dtypes() == (inner, inner)
        assert _mm_and_exp_dtypes() == (outer, outer)
    assert _mm_and_exp_dtypes() == (torch.float32, torch.float32)
    assert not in_scaledoptim_region("cpu")


def test_region_state_is_restored_after_an_exception():
    with pytest.raises(ZeroDivisionError), amp.autocast("cpu"):
        _ = 1 / 0
    assert not torch.is_autocast_enabled("cpu")
    assert not in_scaledoptim_region("cpu")


def test_a_second_thread_is_not_autocast():
    amp.set_policy("aten::exp", "lower_precision_fp", "cpu")
    seen = {}

    def worker():
        seen["dtypes"] = _mm_and_exp_dtypes()
        seen["ours"] = in_scaledoptim_region("cpu")
        with amp.autocast("cpu", dtype=torch.float16):  # its own region, own cache
            seen["inside"] = _mm_and_exp_dtypes()

    with amp.autocast("cpu", dtype=torch.bfloat16):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert _mm_and_exp_dtypes() == (torch.bfloat16, torch.bfloat16)
    assert seen == {
        "dtypes": (torch.float32, torch.float32),
        "ours": False,
        "inside": (torch.float16, torch.float16),
    }


def test_decorator_runs_the_function_in_a_region():
    amp.set_policy("aten::exp", "lower_precision_fp", "cpu")

    @amp.autocast("cpu", dtype=torch.bfloat16)
    def forward():
        return _mm_and_exp_dtypes(), in_scaledoptim_region("cpu")

    assert forward() == ((torch.bfloat16, torch.bfloat16), True)
    assert forward.__name__ == "forward"
    assert not torch.is_autocast_enabled("cpu")


def test_cast_outputs_makes_a_self_cleaning_region():
    @amp.autocast("cpu", dtype=torch.bfloat16, cast_outputs=torch.float32)
    def forward(x, w):
        y = x @ w
        return {"y": y, "pair": (y, torch.arange(3)), "double": y.double()}

    out = forward(torch.randn(2, 3), torch.randn(3, 2))
    assert out["y"].dtype == torch.float32
    assert out["pair"][0].dtype == torch.float32
    assert out["pair"][1].dtype == torch.int64
    assert out["double"].dtype == torch.float64


def test_cast_outputs_in_a_with_block_is_an_error():
    refused = pytest.raises(RuntimeError, match="decorated function")
    with refused, amp.autocast("cpu", cast_outputs=torch.float32):
        pass


def test_decorating_a_non_callable_is_an_error():
    with pytest.raises(TypeError, match="callable"):
        amp.autocast("cpu")(3)
