"""``torch_ops.stochastic_round_`` (int32 hash over chunks and runs of tensors) gives the bits of
the plain int64 formula, element by element, across chunk and tensor boundaries (issue 22,
item 2; the kernels' bits are checked against it in tests/kernels/test_emulated_rounding.py)."""

from __future__ import annotations

import pytest
import torch

from scaledoptim import torch_ops
from scaledoptim.torch_ops import SR_CHUNK, initial_seed, stochastic_round_, storage_flat

M = 0xFFFFFFFF


def _reference(value: torch.Tensor, seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The bf16 bits (int16) of ``value`` rounded with the noise of cuda/dtypes.cuh, in int64."""
    key = torch_ops._sr_key(seed.view(torch.int32).to(torch.int64) & M, step.to(torch.int64) & M)
    flat = storage_flat(value)
    index = torch.arange(flat.numel(), dtype=torch.int64)
    noise = torch_ops._fmix32(index ^ key) >> 16
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
    stochastic_round_(params, values, seeds, steps)
    for param, value, seed, count in zip(params, values, seeds, steps):
        assert torch.equal(storage_flat(param).view(torch.int16), _reference(value, seed, count))
