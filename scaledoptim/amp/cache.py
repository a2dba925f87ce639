"""The cast cache of scaledoptim's autocast kernels.

Note [cast cache]
~~~~~~~~~~~~~~~~~
Like ATen's ``cached_cast``, a cast of an fp32 leaf tensor that requires
grad and is not a view (a parameter, in practice) to the region's lower precision dtype is
made once per outermost region and reused, so a weight used three times is cast once and
autograd sees one cast node. The cache is thread-local (autocast state is thread-local),
holds its keys weakly (``id`` plus a weak reference that must still point at the same
tensor), is reset when an outermost ``scaledoptim.amp.autocast`` region is entered and
emptied when it exits (parameters change between iterations). It is separate from torch's
C++ cache, which serves the ops left on torch's kernels.
"""

from __future__ import annotations

import threading
import weakref

import torch


class CastCache:
    """Casts of parameter-like tensors, keyed weakly by the source tensor."""

    __slots__ = ("_entries", "hits", "misses")

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self.hits = 0
        self.misses = 0

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Return ``tensor.to(dtype)``, made at most once per region for each tensor."""
        entry = self._entries.get(id(tensor))
        # The weak reference guards against a dead tensor whose id was reused; the dtype
        # check against a nested region that asks for another lower precision dtype.
        if entry is not None and entry[0]() is tensor and entry[1].dtype is dtype:
            self.hits += 1
            return entry[1]
        self.misses += 1
        cast = tensor.to(dtype)
        self._entries[id(tensor)] = (weakref.ref(tensor), cast)
        return cast

    def clear(self) -> None:
        """Drop every cached cast; the hit and miss counts stay readable."""
        self._entries.clear()

    def reset(self) -> None:
        """Drop every cached cast and zero the hit and miss counts."""
        self._entries.clear()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)


_local = threading.local()


def thread_cache() -> CastCache:
    """Return the calling thread's cast cache."""
    try:
        return _local.cache
    except AttributeError:
        _local.cache = CastCache()
        return _local.cache


def cache_stats() -> dict[str, int]:
    """Return the calling thread's cast cache statistics.

    The counts cover the current outermost ``scaledoptim.amp.autocast`` region, or the last
    one after it exited (its ``size`` is then 0: the cache is emptied on exit).

    Returns:
        ``{"hits": int, "misses": int, "size": int}``: casts served from the cache, casts
        made and stored, and the number of cached casts held now.
    """
    cache = thread_cache()
    return {"hits": cache.hits, "misses": cache.misses, "size": len(cache)}
