"""The 8-bit codes of low-bit states and block-wise quantization with torch ops (Note
[block-wise codes], Note [dithered rounding] in scaledoptim/fused/lowbit/codes.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaledoptim.fused.lowbit import (
    SIGNED,
    UNSIGNED,
    Code,
    block_count,
    dequantize_blockwise,
    quantize_blockwise,
)

CODES = [pytest.param(SIGNED, id="signed"), pytest.param(UNSIGNED, id="unsigned")]


def nearest(code: Code, y: torch.Tensor) -> torch.Tensor:
    """The distance from each element of ``y`` to the nearest value of ``code`` (float64)."""
    values = code.values().double()
    return (values[None, :] - y.double()[:, None]).abs().min(dim=1).values


@pytest.mark.parametrize("code", CODES)
def test_every_code_decodes_and_encodes_back(code: Code) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(code.encode(code.decode(codes)), codes.int())


@pytest.mark.parametrize("code", CODES)
def test_values_are_relative_steps_up_to_the_max(code: Code) -> None:
    magnitudes = code.values()[: 2**code.magnitude_bits].double()
    assert magnitudes.max().item() == code.max_value
    assert torch.all(magnitudes[1:] > magnitudes[:-1])
    steps = magnitudes[2:] / magnitudes[1:-1] - 1  # relative spacing: at most 2**-mantissa_bits
    assert steps.max().item() <= 2.0**-code.mantissa_bits
    if code.signed:  # magnitude 0 is zero, and the sign bit mirrors every value
        assert magnitudes[0].item() == 0.0
        assert torch.equal(code.values()[128:], -code.values()[:128])
    else:  # no zero: a second moment never reads as 0 (Note [block-wise codes])
        assert magnitudes[0].item() == 2.0**-15


@pytest.mark.parametrize("code", CODES)
@settings(max_examples=30, deadline=None)
@given(exponents=st.lists(st.floats(-20.0, 0.9), min_size=1, max_size=64), seed=st.integers(0, 99))
def test_encoding_is_the_nearest_code(code: Code, exponents: list[float], seed: int) -> None:
    signs = torch.randint(0, 2, (len(exponents),), generator=torch.Generator().manual_seed(seed))
    y = torch.exp2(torch.tensor(exponents))
    if code.signed:
        y = torch.where(signs.bool(), -y, y)
    got = code.decode(code.encode(y).to(torch.uint8)).double()
    error = (got - y.double()).abs()
    # Documented exception: a signed magnitude below 1.0625 * 2**-15 is zero.
    flushed = code.signed & (y.abs() < 1.0625 * 2.0**-15)
    assert torch.all(error[~flushed] <= nearest(code, y)[~flushed])
    assert torch.all(got[flushed] == 0)


@pytest.mark.parametrize("code", CODES)
def test_dithered_rounding_is_unbiased(code: Code) -> None:
    """Over every dither value the mean of the decoded values is the value itself."""
    y = torch.tensor([0.3, 0.71, 1.01, 1.85, 0.0123]) * (1 if not code.signed else -1)
    noise = torch.arange(-(1 << 13), 1 << 13, dtype=torch.int64) << 18  # dithers, evenly
    dither = noise.to(torch.int32)[:, None].expand(-1, len(y)).contiguous()
    values = code.decode(code.encode(y.expand_as(dither).contiguous(), dither).to(torch.uint8))
    mean = values.double().mean(dim=0)
    torch.testing.assert_close(mean, y.double(), rtol=1e-4, atol=0)
    # and each value rounds to one of its two neighbours only
    assert len(torch.unique(values[:, 0])) == 2


def _every_kind_of_float32(count: int, seed: int) -> torch.Tensor:
    """Random float32 bit patterns (NaNs of either sign and any payload, infinities, subnormals,
    zeros of either sign), and values around the codes' range."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31 - 1, (count,), dtype=torch.int32, generator=generator)
    values = bits.view(torch.float32).clone()
    exponents = torch.empty(count // 2).uniform_(-20, 2, generator=generator)
    values[: count // 2] = torch.randn(count // 2, generator=generator) * torch.exp2(exponents)
    specials = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.9375, 1.875, 2.0**-15]
    values[: len(specials)] = torch.tensor(specials)
    return values


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("dithered", [True, False], ids=["dithered", "nearest"])
def test_the_in_place_encode_is_the_definition(code: Code, dithered: bool) -> None:
    """Code.encode_ (what a step runs) gives encode's bytes for every float32, dithered or not
    (Note [block-wise codes])."""
    values = _every_kind_of_float32(1 << 14, seed=int(dithered))
    generator = torch.Generator().manual_seed(7)
    dither = torch.randint(-(2**31), 2**31 - 1, values.shape, generator=generator).int()
    if not dithered:
        dither.zero_()  # no noise: the nearest code
    terms = code.rounding_terms_(dither, torch.empty_like(dither))
    got = torch.empty_like(values, dtype=torch.uint8)
    code.encode_(values.clone(), terms, got, torch.empty_like(dither))
    expected = code.encode(values.clone(), dither if dithered else None)
    assert torch.equal(got, expected.to(torch.uint8))


@pytest.mark.parametrize("code", CODES)
def test_the_in_place_decode_is_the_definition(code: Code) -> None:
    """Code.decode_ gives decode's float32 bits for every code (the signed code's 128: -0.0)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(3)
    out = torch.full(codes.shape, float("nan"))
    code.decode_(codes, out, torch.empty(codes.shape, dtype=torch.int32))
    assert torch.equal(out.view(torch.int32), code.decode(codes).view(torch.int32))


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("block_size", [1, 7, 64, 256])
def test_blockwise_round_trip_error_is_bounded(code: Code, block_size: int) -> None:
    generator = torch.Generator().manual_seed(block_size)
    x = torch.randn(37, 29, generator=generator) * torch.exp2(
        torch.rand(37, 29, generator=generator) * -12
    )
    if not code.signed:
        x = x.square()
    codes, scales = quantize_blockwise(x, code, block_size)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (block_count(x.numel(), block_size),)
    blocks = torch.nn.functional.pad(x.flatten(), (0, len(scales) * block_size - x.numel()))
    torch.testing.assert_close(scales, blocks.view(-1, block_size).abs().amax(1) / code.max_value)
    back = dequantize_blockwise(codes, scales, code, block_size)
    scale = scales.repeat_interleave(block_size)[: x.numel()].view_as(x)
    # half a step of the code (relative), or below its smallest magnitude (absolute)
    bound = torch.maximum(x.abs() * 2.0 ** -(code.mantissa_bits + 1), scale * 2.0**-14) * 1.0001
    assert torch.all((back - x).abs() <= bound)


@pytest.mark.parametrize("code", CODES)
def test_a_block_of_zeros_reads_as_zeros(code: Code) -> None:
    codes, scales = quantize_blockwise(torch.zeros(300), code, 256)
    assert torch.equal(scales, torch.zeros(2))
    assert torch.equal(dequantize_blockwise(codes, scales, code, 256), torch.zeros(300))


def test_blocks_follow_the_storage_order() -> None:
    """A channels_last state's blocks are runs of its storage (as the kernels walk it)."""
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    codes, scales = quantize_blockwise(x, SIGNED, 24)
    assert codes.stride() == x.stride()
    flat, _ = quantize_blockwise(x.permute(0, 2, 3, 1).contiguous(), SIGNED, 24)
    assert torch.equal(codes.permute(0, 2, 3, 1).contiguous(), flat)
    assert dequantize_blockwise(codes, scales, SIGNED, 24).stride() == x.stride()
