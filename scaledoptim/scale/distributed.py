"""found_inf agreement across a process group: one on-device MAX all-reduce, no host read.

Note [found_inf agreement]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Under DDP every rank holds all grads, but under FSDP or any sharded optimizer each rank checks
only its own shard. If one rank overflows and skips while the others step, the replicas (or the
shards of one model) silently diverge, and the scale sequences drift apart too. So before the
scale moves or anything is stepped, ``found_inf`` is all-reduced with MAX over the group: every
rank then sees 1.0 if any rank overflowed, skips together and moves its scale identically.

DTensor params (FSDP2, tensor parallel) need no ``process_group`` for this: a rank sees only its
local shard's grads, so ``found_inf`` is also all-reduced over every group of each DTensor
param's device mesh (one per mesh dimension: MAX over each is MAX over the mesh), whatever
``process_group`` says; a group already reduced over (the mesh of several params, or the
``process_group`` itself) is not reduced over twice.

The all-reduce is issued with ``async_op=True`` and its ``Work.wait()`` is called before
``found_inf`` is used (torch once read ``found_inf`` before an async all-reduce had finished).
On NCCL ``wait()`` makes the current CUDA stream wait for the collective: no host sync. On gloo
it blocks the calling thread until the result is in ``found_inf``, but reads no tensor either.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["agree_on_found_inf", "check_process_group", "mesh_groups"]


def check_process_group(process_group: Any) -> None:
    """Raises unless ``process_group`` is ``None`` or a usable :class:`torch.distributed.ProcessGroup`."""
    if process_group is None:
        return
    if not dist.is_available():
        raise RuntimeError(
            "configure_scaling(process_group=...) needs torch.distributed, which this torch build "
            "lacks; drop process_group for single-process training"
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup or None, got "
            f"{type(process_group).__name__}; call dist.init_process_group() first and pass "
            "dist.group.WORLD (or a group from dist.new_group())"
        )


def agree_on_found_inf(found_inf: torch.Tensor, process_group: dist.ProcessGroup) -> None:
    """All-reduces ``found_inf`` in place with MAX over ``process_group``; no host read.

    Every rank of the group must call it once per unscale, in the same order as its other
    collectives (see Note [found_inf agreement]).
    """
    work = dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=process_group, async_op=True)
    work.wait()


def mesh_groups(params: Iterable[torch.Tensor]) -> list[dist.ProcessGroup]:
    """The process groups of the device meshes of the DTensors among ``params`` with more than
    one rank, each once, in the order the params list them (the same on every rank of a mesh);
    ``[]`` when there is none (see Note [found_inf agreement])."""
    if not dist.is_available() or not dist.is_initialized():
        return []
    from torch.distributed.tensor import DTensor

    groups: list[dist.ProcessGroup] = []
    seen_meshes: set[int] = set()
    for param in params:
        if not isinstance(param, DTensor) or id(param.device_mesh) in seen_meshes:
            continue
        seen_meshes.add(id(param.device_mesh))
        for group in param.device_mesh.get_all_groups():
            if dist.get_world_size(group) > 1 and all(group is not g for g in groups):
                groups.append(group)
    return groups
