"""The host 16-bit conversions of cuda/dtypes.cuh against torch's casts, and its stochastic
rounding against the torch form's (``torch_ops.stochastic_round_``), bit for bit."""

from __future__ import annotations

import ctypes

import pytest
import torch

from scaledoptim.kernels import NON_FINITE_CHECK
from scaledoptim.kernels.emulator import emulator_library
from scaledoptim.torch_ops import initial_seed, stochastic_round_

DTYPES = {"half": torch.float16, "bfloat16": torch.bfloat16}


def convert(
    function: str, source: torch.Tensor, out_dtype: torch.dtype, *args: ctypes._SimpleCData
) -> torch.Tensor:
    out = torch.empty(source.shape, dtype=out_dtype)
    emulator_library(NON_FINITE_CHECK).function(function)(
        ctypes.c_void_p(source.data_ptr()),
        ctypes.c_void_p(out.data_ptr()),
        ctypes.c_longlong(source.numel()),
        *args,
    )
    return out


def float_inputs() -> torch.Tensor:
    """Random bit patterns, every rounding boundary of both 16-bit formats, and edge values."""
    generator = torch.Generator().manual_seed(0)
    random_bits = torch.randint(
        -(2**31), 2**31 - 1, (1 << 20,), generator=generator, dtype=torch.int64
    )
    all_16 = torch.arange(-(2**15), 2**15, dtype=torch.int32)
    # For both formats: each representable value, the midpoints above it, and one float ulp around.
    boundaries = []
    for shift in (16, 13):  # bfloat16 keeps the top 16 bits of a float, half (mostly) 19
        base = all_16 << shift
        for offset in (0, 1 << (shift - 1), (1 << (shift - 1)) - 1, (1 << (shift - 1)) + 1):
            boundaries.append(base + offset)
    edges = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            float("-inf"),
            float("nan"),
            65504.0,
            65519.99,
            65520.0,
            2.0**-24,
            2.0**-25,
            2.0**-25 * 1.0000001,
            2.0**-14,
            3.4e38,
            1e-45,
        ]
    )
    bits = torch.cat([random_bits.to(torch.int32), *[b.to(torch.int32) for b in boundaries]])
    return torch.cat([bits.view(torch.float32), edges])


@pytest.mark.parametrize("name", DTYPES)
def test_from_float_rounds_like_torch(name):
    values = float_inputs()
    ours = convert(f"so_emulator_{name}_from_float", values, torch.int16)
    theirs = values.to(DTYPES[name]).view(torch.int16)
    nan = values.isnan()
    assert torch.equal(ours[~nan], theirs[~nan])
    assert ours[nan].view(DTYPES[name]).isnan().all()  # payload and sign of NaN are not specified


@pytest.mark.parametrize("name", DTYPES)
def test_to_float_is_exact_for_every_bit_pattern(name):
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    ours = convert(f"so_emulator_float_from_{name}", patterns, torch.float32)
    theirs = patterns.view(DTYPES[name]).float()
    nan = theirs.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours[~nan].view(torch.int32), theirs[~nan].view(torch.int32))


@pytest.mark.parametrize("on_device", [False, True], ids=["host form", "device form"])
def test_stochastic_rounding_of_the_torch_form_is_the_kernels(on_device):
    """Every input of ``float_inputs`` (NaN payloads too) as one tensor of many chunks and as a
    run of small ones; the torch form a CPU runs and the one of every other device."""
    values = float_inputs()
    tensors = [values, *values[:3000].split([7, 993, 2000])]
    seeds = [initial_seed(i) for i in range(len(tensors))]
    step = 123457
    params = [torch.empty_like(t, dtype=torch.bfloat16) for t in tensors]
    steps = [torch.tensor(float(step))] * len(tensors)
    stochastic_round_(params, tensors, seeds, steps, on_host=not on_device)
    for param, tensor, seed in zip(params, tensors, seeds):
        kernels = convert(
            "so_emulator_bfloat16_from_float_sr",
            tensor,
            torch.int16,
            ctypes.c_uint(seed.item() & 0xFFFFFFFF),
            ctypes.c_uint(step),
            ctypes.c_longlong(0),
        )
        assert torch.equal(param.view(torch.int16), kernels)
