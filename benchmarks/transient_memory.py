"""The transient CPU memory of one call, as the benchmarks report it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile


def peak_transient_bytes(call: Callable[[], Any]) -> int:
    """The peak of the CPU allocations alive during ``call()`` over what was alive before it
    (torch's profiler: every allocation and free, in order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    alive = peak = 0
    for event in events:
        alive += event.nbytes()
        peak = max(peak, alive)
    return peak
