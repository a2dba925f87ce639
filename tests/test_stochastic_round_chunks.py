"""``torch_ops.stochastic_round_`` (int32 hash over chunks and runs of tensors) gives the bits of
the plain int64 formula, element by element, across chunk and tensor boundaries (the chunks
keep the transient memory a few chunks, whatever the params' size), in the form a CPU runs and in
the one of other devices; and one chunk's rounding is the kernels' formula, written in Python ints,
for any bits, key and index (hypothesis). The kernels' own bits are checked against the torch form
in tests/kernels/test_emulated_dtypes.py and tests/kernels/test_emulated_rounding.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaledoptim.doctor.sync_free import no_host_reads
from scaledoptim.torch_ops import (
    SR_CHUNK,
    initial_seed,
    rounding,
    stochastic_round_,
    storage_flat,
)

M = 0xFFFFFFFF


def _reference(value: torch.Tensor, seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The bf16 bits (int16) of ``value`` rounded with the noise of cuda/dtypes.cuh, in int64."""
    key = rounding._sr_key(seed.view(torch.int32).to(torch.int64) & M, step.to(torch.int64) & M)
    flat = storage_flat(value)
    index = torch.arange(flat.numel(), dtype=torch.int64)
    noise = rounding._fmix32(index ^ key) >> 16
    bits = flat.view(torch.int32).to(torch.int64) & M
    rounded = (bits + noise) >> 16
    rounded = torch.where((bits & 0x7FFFFFFF) > 0x7F800000, (bits >> 16) | 0x40, rounded) & 0xFFFF
    return torch.where(rounded >= 0x8000, rounded - 0x10000, rounded).to(torch.int16)


def _special() -> torch.Tensor:
    values = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.4e38, -3.4e38, 1e-40, 3.3895e38]
    )
    values.view(torch.int32)[0] = -1  # a negative NaN, all bits set
    return values


SHAPES = {
    "one large tensor": [(SR_CHUNK * 2 + 3,)],
    "equal small tensors": [(7, 5)] * 9,
    "a run of unequal sizes": [(3,), (SR_CHUNK - 2,), (5,), (0,), (11,), (SR_CHUNK + 1,), (9,)],
    "a few unequal sizes in a run, one past 2**16": [(3,), (2**16 + 7,), (5,)],
    # A run of many: its indices and keys from its sizes as a tensor, not an op per tensor.
    "many unequal small tensors, one past 2**16": [(1 + i % 7,) for i in range(100)]
    + [(2**16 + 5,)],
}


@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("step", [1.0, 123457.0])
def test_chunked_rounding_gives_the_reference_bits(shapes: str, step: float) -> None:
    torch.manual_seed(0)
    values = [torch.randn(shape) * 1e3 for shape in SHAPES[shapes]]
    values.append(_special())
    values.append(torch.randn(6, 4).t())  # a transposed param: storage order
    params = [torch.empty_like(v, dtype=torch.bfloat16) for v in values]
    seeds = [initial_seed(i) for i in range(len(values))]
    steps = [torch.tensor(step + i) for i in range(len(values))]
    stochastic_round_(params, values, seeds, steps, on_host=True)
    for param, value, seed, count in zip(params, values, seeds, steps):
        assert torch.equal(storage_flat(param).view(torch.int16), _reference(value, seed, count))


def _unequal_runs_with_specials() -> list[torch.Tensor]:
    torch.manual_seed(1)
    values = [torch.randn(n) * 1e3 for n in (3, 700, 5, 0, SR_CHUNK + 9, 11, 2)]
    return [*values, _special(), torch.randn(6, 4).t()]


def _rounded(values: list[torch.Tensor], on_host: bool) -> list[torch.Tensor]:
    params = [torch.empty_like(v, dtype=torch.bfloat16) for v in values]
    seeds = [initial_seed(i) for i in range(len(values))]
    stochastic_round_(params, values, seeds, [torch.tensor(7.0)] * len(values), on_host=on_host)
    return [storage_flat(p).view(torch.int16) for p in params]


def test_the_device_form_reads_nothing_on_the_host_and_gives_the_same_bits() -> None:
    """The form every device but a CPU runs (no NaN check on the host, a run's sizes not made a
    tensor; Note [host skip]), taken on a CPU: a host read would raise."""
    values = _unequal_runs_with_specials()
    with no_host_reads():
        on_device = _rounded(values, on_host=False)
    for ours, reference in zip(on_device, _rounded(values, on_host=True)):
        assert torch.equal(ours, reference)


# float32 bit patterns (uint32) where the rounding has edges: signed zeros, infinities, the
# subnormals' ends, the largest finite bf16 and the values within one bf16 ulp above it (which
# carry into inf), quiet and signaling NaNs of both signs and payloads.
EDGES = [
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001, 0x80000001, 0x0000FFFF,
    0x007FFFFF, 0x807FFFFF, 0x7F7F0000, 0xFF7F0000, 0x7F7F0001, 0x7F7F8000, 0x7F7FFFFF,
    0xFF7FFFFF, 0x7F800001, 0x7FBFFFFF, 0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0xFFC00000,
    0xFFFFFFFF, 0x3F80FFFF, 0xBF80FFFF,
]


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M
    return h ^ (h >> 16)


def _kernel_bits(bits: int, index: int, key: int) -> int:
    """``bfloat16_bits_from_float_sr(x, so_sr_noise(key, index))`` of cuda/dtypes.cuh, in
    Python ints, as an int16 value."""
    if bits & 0x7FFFFFFF > 0x7F800000:
        rounded = (bits >> 16) | 0x40
    else:
        rounded = ((bits + (_fmix32((index & M) ^ key) >> 16)) & M) >> 16
    return rounded - 0x10000 if rounded >= 0x8000 else rounded


@settings(max_examples=300, deadline=None)
@given(
    bits=st.lists(st.one_of(st.integers(0, M), st.sampled_from(EDGES)), min_size=1, max_size=48),
    key=st.integers(0, M),
    chunk=st.integers(0, 1 << 27),  # the chunk's start / SR_CHUNK: past 2**32 elements too
    first=st.integers(0, SR_CHUNK - 48),
    on_host=st.booleans(),
)
def test_a_chunk_rounds_to_the_kernels_bits(
    bits: list[int], key: int, chunk: int, first: int, on_host: bool
) -> None:
    """``_round_bits_`` over elements ``first...`` of the chunk starting at ``chunk *
    SR_CHUNK``, with the host's NaN check or the device's where, against the kernels' formula."""
    start, n = chunk * SR_CHUNK, len(bits)
    buffers = rounding._SrBuffers(SR_CHUNK, torch.device("cpu"), on_host)
    h = buffers.mixed[first : first + n] ^ rounding._chunk_key(torch.tensor(key), start)
    signed = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32)
    rounded = rounding._round_bits_(h, signed, buffers)
    expected = [_kernel_bits(b, start + first + i, key) for i, b in enumerate(bits)]
    assert rounded.tolist() == expected
