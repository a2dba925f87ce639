"""Multi-tensor argument tables: the ctypes mirror of ``TensorTable<N>`` and the chunking.

See Note [multi-tensor table layout] in cuda/multi_tensor_apply.cuh.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MAX_CHUNKS", "PlannedLaunch", "max_tensors", "plan_launches", "table_type"]

# Mirrors of the constants in cuda/multi_tensor_apply.cuh.
MAX_CHUNKS = 320
_KERNEL_PARAM_BYTES = 4096
_ARGS_RESERVE_BYTES = 256


def max_tensors(n_lists: int) -> int:
    """Tensor slots of one ``TensorTable<n_lists>`` (``kMaxTensors``)."""
    by_bytes = (_KERNEL_PARAM_BYTES - _ARGS_RESERVE_BYTES - MAX_CHUNKS * 5 - 8) // (
        8 * (n_lists + 1)
    )
    return min(by_bytes, 255)


@functools.cache
def table_type(n_lists: int) -> type[ctypes.Structure]:
    """The ctypes mirror of ``TensorTable<n_lists>``."""
    slots = max_tensors(n_lists)
    return type(
        f"TensorTable{n_lists}",
        (ctypes.Structure,),
        {
            "_fields_": [
                ("ptrs", ctypes.c_void_p * slots * n_lists),
                ("sizes", ctypes.c_int64 * slots),
                ("chunk_size", ctypes.c_int64),
                ("chunk_index", ctypes.c_int32 * MAX_CHUNKS),
                ("chunk_tensor", ctypes.c_uint8 * MAX_CHUNKS),
            ]
        },
    )


@dataclass(frozen=True)
class PlannedLaunch:
    """One launch: the table (kept alive here, passed by address), its grid size, and which
    tensor (its index in the ``pointers`` given to :func:`plan_launches`) each slot holds."""

    table: ctypes.Structure
    n_chunks: int
    slot_tensors: tuple[int, ...]


def plan_launches(
    pointers: Sequence[Sequence[int]], sizes: Sequence[int], n_lists: int, chunk_size: int
) -> list[PlannedLaunch]:
    """Splits tensors into chunks and chunks into as many tables as needed.

    Args:
        pointers: per tensor, its data pointer in each list (0 for lists the kernel skips).
        sizes: per tensor, its element count; empty tensors get no chunk.
        n_lists: lists per table.
        chunk_size: elements per chunk.
    """
    slots = max_tensors(n_lists)
    make = table_type(n_lists)
    launches: list[PlannedLaunch] = []
    table, n_tensors, n_chunks, slot_tensors = make(chunk_size=chunk_size), 0, 0, []

    for index, (tensor_ptrs, size) in enumerate(zip(pointers, sizes)):
        chunks_of_tensor = -(-size // chunk_size)
        slot = None
        for chunk in range(chunks_of_tensor):
            if slot is None:  # first chunk in this table: give the tensor a slot
                slot = n_tensors
                for i, ptr in enumerate(tensor_ptrs):
                    table.ptrs[i][slot] = ptr
                table.sizes[slot] = size
                slot_tensors.append(index)
                n_tensors += 1
            table.chunk_tensor[n_chunks] = slot
            table.chunk_index[n_chunks] = chunk
            n_chunks += 1
            last_chunk = chunk == chunks_of_tensor - 1
            if n_chunks == MAX_CHUNKS or (n_tensors == slots and last_chunk):
                launches.append(PlannedLaunch(table, n_chunks, tuple(slot_tensors)))
                table, n_tensors, n_chunks, slot_tensors = make(chunk_size=chunk_size), 0, 0, []
                slot = None  # remaining chunks continue in the next table
    if n_chunks:
        launches.append(PlannedLaunch(table, n_chunks, tuple(slot_tensors)))
    return launches
