"""found_inf agreement across a process group: one on-device MAX all-reduce, no host read.

Note [found_inf agreement]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Under DDP every rank holds all grads, but under FSDP or any sharded optimizer each rank checks
only its own shard. If one rank overflows and skips while the others step, the replicas (or the
shards of one model) silently diverge, and the scale sequences drift apart too. So before the
scale moves or anything is stepped, ``found_inf`` is all-reduced with MAX over the group: every
rank then sees 1.0 if any rank overflowed, skips together and moves its scale identically.

The all-reduce is issued with ``async_op=True`` and its ``Work.wait()`` is called before
``found_inf`` is used (torch once read ``found_inf`` before an async all-reduce had finished).
On NCCL ``wait()`` makes the current CUDA stream wait for the collective: no host sync. On gloo
it blocks the calling thread until the result is in ``found_inf``, but reads no tensor either.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["agree_on_found_inf", "check_process_group"]


def check_process_group(process_group: Any) -> None:
    """Raises unless ``process_group`` is ``None`` or a usable
    :class:`torch.distributed.ProcessGroup`."""
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
