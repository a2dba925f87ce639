"""The test oracle: torch.optim's single-tensor (foreach=False) math on fp32 copies.

Each reference step starts from the kernel's current state (params upcast from their 16-bit
storage), so a 16-bit param is compared with the fp32 result rounded once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.optim.adam import adam as torch_adam
from torch.optim.sgd import sgd as torch_sgd

# Chunk size of the kernel tests (set by conftest.py): 3 * CHUNK + 7 elements span four chunks.
CHUNK = 64
SIZES_IN_CHUNKS = (0, 1, 3, 4, 5, "c-1", "c", "c+1", "3c+7")


def test_sizes(chunk: int) -> list[int]:
    """0, 1, 3, 4, 5, chunk-1, chunk, chunk+1, 3*chunk+7."""
    named = {"c-1": chunk - 1, "c": chunk, "c+1": chunk + 1, "3c+7": 3 * chunk + 7}
    return [named.get(s, s) for s in SIZES_IN_CHUNKS]


test_sizes.__test__ = False  # a helper, not a test


def misaligned(t: Tensor) -> Tensor:
    """A copy of ``t`` viewed at storage offset 1, so no 16-byte vector load is aligned."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = storage[1:].view(t.shape)
    view.copy_(t)
    return view


def make_tensors(
    sizes: list[int], dtype: torch.dtype, generator: torch.Generator, scale: float = 1.0
) -> list[Tensor]:
    """Random tensors of ``sizes``; the last size is also added as a misaligned view."""
    tensors = [(torch.randn(n, generator=generator) * scale).to(dtype) for n in sizes]
    tensors.append(misaligned((torch.randn(sizes[-1], generator=generator) * scale).to(dtype)))
    return tensors


@dataclass
class AdamState:
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    max_exp_avg_sqs: list[Tensor]
    steps: list[Tensor] = field(default_factory=list)


def reference_adam(
    params: list[Tensor],
    grads: list[Tensor],
    state: AdamState,
    inv_scale: float | None,
    options: dict,
) -> tuple[list[Tensor], AdamState]:
    """One torch Adam/AdamW step on fp32 copies; returns the new fp32 params and state."""
    p32 = [p.float().clone() for p in params]
    g32 = [g.float() * inv_scale if inv_scale is not None else g.float() for g in grads]
    new = AdamState(
        [t.clone() for t in state.exp_avgs],
        [t.clone() for t in state.exp_avg_sqs],
        [t.clone() for t in state.max_exp_avg_sqs],
        [t.clone() for t in state.steps],
    )
    torch_adam(
        p32,
        g32,
        new.exp_avgs,
        new.exp_avg_sqs,
        new.max_exp_avg_sqs,
        new.steps,
        foreach=False,
        fused=False,
        **options,
    )
    return p32, new


def reference_sgd(
    params: list[Tensor],
    grads: list[Tensor],
    buffers: list[Tensor],
    steps: list[Tensor],
    inv_scale: float | None,
    options: dict,
) -> tuple[list[Tensor], list[Tensor]]:
    """One torch SGD step on fp32 copies; a param whose step is 0 gets its buffer created."""
    p32 = [p.float().clone() for p in params]
    g32 = [g.float() * inv_scale if inv_scale is not None else g.float() for g in grads]
    torch_buffers: list[Tensor | None] = (
        [None if s.item() == 0 else b.clone() for b, s in zip(buffers, steps)]
        if options["momentum"] != 0
        else [None] * len(params)
    )
    torch_sgd(p32, g32, torch_buffers, foreach=False, fused=False, **options)
    return p32, torch_buffers


def ulp_distance(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise distance in units in the last place between two 16-bit float tensors."""

    def ordered(t: Tensor) -> Tensor:
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -32768 - bits, bits)  # sign-magnitude -> monotonic integers

    return (ordered(a) - ordered(b)).abs()


def assert_param_close(actual: Tensor, expected32: Tensor) -> None:
    """fp32: 1e-6 relative; 16-bit: within one ulp of the fp32 reference rounded once."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected32, rtol=1e-6, atol=1e-6)
    else:
        expected = expected32.to(actual.dtype)
        distance = ulp_distance(actual, expected)
        assert (
            distance.numel() == 0 or distance.max().item() <= 1
        ), f"{actual.dtype} param off by {distance.max().item()} ulp: {actual} vs {expected}"


def assert_state_close(actual: Tensor, expected: Tensor) -> None:
    """fp32 state: 1e-6 relative, plus 1e-7 absolute for values that cancel to near zero
    (torch's vectorised CPU lerp uses FMA, the emulator does not; gradients are O(1))."""
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-7)
