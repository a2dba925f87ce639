"""Tensors for the kernel tests: sizes that cross every chunk boundary, misaligned views, dtype
mixes; and byte-level comparisons.

It needs no hypothesis (the benchmarks, which lack it, use the GPU marks next door).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "CHUNK",
    "DTYPES",
    "EMULATOR_THREADS",
    "assert_bytes_unchanged",
    "boundary_params_and_grads",
    "boundary_sizes",
    "clones",
    "make_tensors",
    "misaligned",
    "mixed_params_and_grads",
]

#: Chunk size of the kernel tests (tests/kernels/conftest.py sets it): 3 * CHUNK + 7 elements
#: span four chunks.
CHUNK = 64
#: Emulated threads per block: 2 vector iterations per chunk of CHUNK.
EMULATOR_THREADS = 8
#: The param and grad dtypes of our kernels.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SIZES_IN_CHUNKS = (0, 1, 3, 4, 5, "c-1", "c", "c+1", "3c+7")


def boundary_sizes(chunk: int) -> list[int]:
    """0, 1, 3, 4, 5, chunk-1, chunk, chunk+1, 3*chunk+7."""
    named = {"c-1": chunk - 1, "c": chunk, "c+1": chunk + 1, "3c+7": 3 * chunk + 7}
    return [named.get(s, s) for s in _SIZES_IN_CHUNKS]  # type: ignore[misc]


def misaligned(t: Tensor) -> Tensor:
    """A copy of ``t`` viewed at storage offset 1, so no 16-byte vector load is aligned."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
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


def boundary_params_and_grads(
    param_dtype: torch.dtype, grad_dtype: torch.dtype, generator: torch.Generator
) -> tuple[list[Tensor], list[Tensor]]:
    """Params and grads of every size of ``boundary_sizes(CHUNK)``, plus a misaligned view each."""
    sizes = boundary_sizes(CHUNK)
    return make_tensors(sizes, param_dtype, generator), make_tensors(sizes, grad_dtype, generator)


def mixed_params_and_grads(
    sizes: Sequence[int], dtypes: Sequence[tuple[torch.dtype, torch.dtype]], seed: int
) -> tuple[list[Tensor], list[Tensor]]:
    """A param and a grad per ``(param_dtype, grad_dtype)`` of ``dtypes``, sized by ``sizes``."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=generator).to(p) for n, (p, _) in zip(sizes, dtypes)]
    grads = [torch.randn(n, generator=generator).to(g) for n, (_, g) in zip(sizes, dtypes)]
    return params, grads


def clones(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [t.clone() for t in tensors]


def assert_bytes_unchanged(before: Sequence[Tensor], after: Sequence[Tensor]) -> None:
    """Pairwise the same bytes."""
    assert len(before) == len(after)
    for b, a in zip(before, after):
        assert torch.equal(b.reshape(-1).view(torch.uint8), a.reshape(-1).view(torch.uint8))
