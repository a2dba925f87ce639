"""The batches and 0-dim hyper-parameters of the optimizers' in-place torch forms."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "BATCH",
    "Pieces",
    "batches",
    "elementwise_batches",
    "scalars",
    "split_large",
    "storage_flat",
]

_NUMEL = Tensor.numel
_DTYPE = operator.attrgetter("dtype")

#: Elements per batch of tensors of the in-place CPU forms: their temporaries are this large
#: (1 MB in float32; fresh 4 MB ones are page-faulted in at each allocation: 1.6x the step).
BATCH = 1 << 18


def batches(tensors: Sequence[Tensor], limit: int = BATCH) -> list[slice]:
    """Consecutive runs of ``tensors`` of at most ``limit`` elements (a larger tensor alone)."""
    return _runs(map(_NUMEL, tensors), limit)  # (map: ~1 ms a step less at 2000 tensors)


def scalars(like: Sequence[Tensor], *values: float) -> list[Any]:
    """``values`` as 0-dim tensors of the dtype and device of the CPU tensors ``like`` (Python
    floats when they mix dtypes or are not on a CPU). torch's CPU foreach ops loop over the
    tensors and wrap a Python scalar into a double tensor and convert it for each (~4 us a
    tensor: 9 ms a step over 2000 tensors); a 0-dim tensor of their dtype is used as it is,
    with the same value (the scalar rounded once to the dtype either way). Elsewhere a foreach
    kernel takes the Python scalar as an argument, where a tensor made from it would be a copy
    from the host."""
    dtype = like[0].dtype if like else None
    if (
        dtype is None
        or like[0].device.type != "cpu"
        or not all(map(dtype.__eq__, map(_DTYPE, like)))
    ):
        return list(values)
    return [torch.tensor(value, dtype=dtype, device=like[0].device) for value in values]


def split_large(lists: list[list[Tensor]], limit: int = BATCH) -> list[list[Tensor]]:
    """Lists of same-layout tensors (a param, its grad, its state), with each tensor of more
    than ``limit`` elements replaced by views of its storage in pieces of ``limit``: for an
    elementwise update, so that :func:`batches` bounds its temporaries for one large tensor too.
    An empty list (a state the update does not keep) stays empty."""
    if not lists[0] or max(map(_NUMEL, lists[0])) <= limit:
        return lists
    kept = [i for i, column in enumerate(lists) if column]
    out: list[list[Tensor]] = [[] for _ in lists]
    for row in zip(*(lists[i] for i in kept)):
        pieces = (
            [[t] for t in row]
            if row[0].numel() <= limit
            else [list(storage_flat(t).split(limit)) for t in row]
        )
        for i, piece in zip(kept, pieces):
            out[i] += piece
    return out


def elementwise_batches(lists: list[list[Tensor]]) -> Iterator[list[list[Tensor]]]:
    """The lists of an elementwise update (:func:`split_large`'s) in :func:`batches` of about
    ``BATCH`` elements: each batch's slice of every list (an empty list stays empty)."""
    lists = split_large(lists)
    for run in batches(lists[0]):
        yield [column[run] for column in lists]


def storage_flat(t: Tensor) -> Tensor:
    """A dense tensor's elements in storage order, as the kernels walk them."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


class Pieces:
    """Tensors of one layout cut into pieces of at most ``limit`` elements and grouped into
    :func:`batches`: each tensor of more than ``limit`` elements becomes views of its storage in
    storage order (as :func:`split_large` cuts it), the others stay as they are.

    Args:
        like: the tensors (dense: no gaps or overlaps in their storage) whose layout every
            list :meth:`cut` cuts has.
        limit: the most elements of a piece; a multiple of ``SR_CHUNK`` (a piece's first
            element is then where a chunk of stochastic rounding starts in its tensor).

    Attributes:
        runs: the batches, as slices of the pieces.
        owners, starts: per piece, the index of its tensor and the index of its first element
            in that tensor's storage order.
        owner_index, start_index: ``owners`` and ``starts`` as int64 tensors on the tensors'
            device, or ``None`` when no tensor is cut (each piece is its tensor, from 0).
    """

    def __init__(self, like: Sequence[Tensor], limit: int = BATCH) -> None:
        self.limit = limit
        self.cut_any = any(t.numel() > limit for t in like)
        sizes = [t.numel() for t in like]
        self.owners: list[int] = []
        self.starts: list[int] = []
        piece_sizes: list[int] = []
        for i, size in enumerate(sizes):
            firsts = range(0, size, limit) if size > limit else range(1)
            self.owners += [i] * len(firsts)
            self.starts += firsts
            piece_sizes += [min(limit, size - first) for first in firsts]
        self.sizes = piece_sizes
        self.runs = _runs(piece_sizes, limit)
        self.owner_index: Tensor | None = None
        self.start_index: Tensor | None = None
        if self.cut_any:
            # Made on the device from Python ints (kernel arguments), not copied from the host:
            # a copy from pageable memory would sync a GPU. Ops per cut tensor only.
            device, count = like[0].device, len(piece_sizes)
            owners = torch.arange(count, dtype=torch.int64, device=device)
            starts = torch.zeros(count, dtype=torch.int64, device=device)
            at = 0
            for i, size in enumerate(sizes):
                cut = -(-size // limit) if size > limit else 1
                if cut > 1:
                    owners[at : at + cut] = i
                    owners[at + cut :] -= cut - 1
                    starts[at : at + cut] = torch.arange(
                        0, size, limit, dtype=torch.int64, device=device
                    )
                at += cut
            self.owner_index, self.start_index = owners, starts

    def cut(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """``tensors`` (of the layout of ``like``) as the pieces."""
        if not self.cut_any:
            return list(tensors)
        limit = self.limit
        out: list[Tensor] = []
        for t in tensors:
            if t.numel() > limit:
                out += storage_flat(t).split(limit)
            else:
                out.append(t)
        return out


def _runs(sizes: Iterable[int], limit: int) -> list[slice]:
    """:func:`batches` over tensors of ``sizes``."""
    runs, start, total, count = [], 0, 0, 0
    for count, size in enumerate(sizes, 1):
        if total and total + size > limit:
            runs.append(slice(start, count - 1))
            start, total = count - 1, 0
        total += size
    runs.append(slice(start, count))
    return runs
