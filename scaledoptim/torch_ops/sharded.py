"""Per-tensor sums over whole sharded tensors: each rank's partial over its local shards, added
up over the mesh dimensions that shard the tensor."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# Note [sums over the mesh]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A reduction over a whole tensor (LAMB's trust ratio and global grad norm) of a DTensor (FSDP2's
# Shard(0), tensor parallel's Shard(0) / Shard(1) / Replicate) runs on each rank's local shard,
# giving a partial sum of squares; the partials are then summed with one all_reduce per mesh
# dimension that shards the tensor, over that dimension's process group. A Replicate dimension
# holds the whole tensor already and is not summed over (it would count it once per rank). The
# partials of the tensors sharded alike travel in one all_reduce. The sum stays on device: no
# host read, so a GPU step stays sync-free. Every rank of the mesh must run it, which they do:
# they agree on every skip (the inf/nan check is reduced over the mesh, Note [tensor
# subclasses] in fused/backends/torch_native.py) and the reduction runs on skipped steps too.
# Plain tensors are whole on every rank: their sums are not reduced.

_PLAIN = frozenset((Tensor, torch.nn.Parameter))


def local_tensors(tensors: list[Tensor]) -> list[Tensor]:
    """Each DTensor's local tensor (a view of its storage), every other tensor as it is (a
    ``__torch_dispatch__`` wrapper subclass is a whole tensor: its ops see all of it)."""
    return [
        t if type(t) in _PLAIN or not hasattr(t, "to_local") else t.to_local()
        for t in tensors
    ]


class MeshSums:
    """Sums per tensor of ``tensors`` over the whole tensor: :meth:`local` gives the tensors to
    compute partial sums on, :meth:`reduce_` adds the partials up over the mesh.

    Args:
        tensors: plain tensors, DTensors and other tensor subclasses (whole tensors, summed as
            they are); a DTensor may not have a ``Partial`` placement.

    Raises:
        ValueError: for a ``Partial`` placement, naming the tensor's index.
    """

    def __init__(self, tensors: list[Tensor]) -> None:
        self.sharded = any(type(t) not in _PLAIN for t in tensors)
        #: The process groups to sum over, and the indices of the tensors summed over them.
        self.groups: list[tuple[list[Any], list[int]]] = []
        if not self.sharded:
            return
        from torch.distributed.tensor import DTensor

        by_sharding: dict[tuple[Any, tuple[int, ...]], list[int]] = {}
        for index, tensor in enumerate(tensors):
            if not isinstance(tensor, DTensor):
                continue
            if any(p.is_partial() for p in tensor.placements):
                raise ValueError(
                    f"tensor {index} is a DTensor with a Partial placement "
                    f"({tensor.placements}): its values are not summed yet; redistribute it to "
                    "Shard or Replicate placements first"
                )
            dims = tuple(d for d, p in enumerate(tensor.placements) if p.is_shard())
            if dims:
                by_sharding.setdefault((tensor.device_mesh, dims), []).append(index)
        self.groups = [
            ([mesh.get_group(d) for d in dims], indices)
            for (mesh, dims), indices in by_sharding.items()
        ]

    def local(self, tensors: list[Tensor]) -> list[Tensor]:
        """Each DTensor's local tensor (a view of its storage), every other tensor as it is."""
        return local_tensors(tensors) if self.sharded else tensors


    def reduce_(self, partials: Tensor) -> Tensor:
        """``partials`` (last dimension: one per tensor, in order) with each sharded tensor's
        entries summed over its mesh, in place and on device; returns it."""
        for process_groups, indices in self.groups:
            if len(indices) == partials.shape[-1]:  # all sharded alike: no gather, no scatter
                for group in process_groups:
                    torch.distributed.all_reduce(partials, group=group)
                continue
            where = torch.tensor(indices, device=partials.device)
            picked = partials.index_select(-1, where)
            for group in process_groups:
                torch.distributed.all_reduce(picked, group=group)
            partials.index_copy_(-1, where, picked)
        return partials
