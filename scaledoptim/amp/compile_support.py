"""scaledoptim's regions and policies under torch.compile (Note [regions under torch.compile]).

A scaledoptim kernel decides while dynamo and AOTAutograd trace: AOTAutograd bakes the casts
it chose into the graph, and later calls run that graph without asking the kernel again.
So a trace that runs one gets:

* a guard: the compiled code is reused only while ``regions.signature()`` (the policy
  version, and which device types a scaledoptim region governs at the call) is what it was
  when traced; otherwise dynamo traces again, as it does when torch's own autocast state
  changed;
* a call of ``policies_in_effect`` in dynamo's graph, which does nothing when it runs but
  makes AOTAutograd bypass its cache: that cache (on disk, shared between processes) keys
  a graph by dynamo's graph and torch's autocast state, and would hand back a graph traced
  under other policies.

``enter_region``/``exit_region`` are graph nodes, so a region entered inside compiled code is
entered when AOTAutograd traces the graph and when the ``eager`` backend runs it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch._dynamo
from torch._dynamo.source import GlobalStateSource
from torch._guards import Guard, TracingContext
from torch.fx.node import has_side_effect

from . import regions


def policies_in_effect() -> None:
    """Marks a dynamo graph that scaledoptim's kernels were traced in; does nothing."""


for _function in (regions.enter_region, regions.exit_region, policies_in_effect):
    torch._dynamo.allow_in_graph(_function)
    has_side_effect(_function)  # no output: without this, dead code elimination drops it


def _make_guard(expected: tuple[Any, ...], builder: Any, guard: Guard) -> None:
    def check(_: Any) -> bool:
        return regions.signature() == expected

    builder.guard_manager.root.add_lambda_guard(
        check, [f"scaledoptim.amp.regions.signature() == {expected!r}"], guard.user_stack
    )


def note_trace_depends_on_policies(trace_regions: regions.Regions) -> None:
    """Guard the code being traced on scaledoptim's state and keep it out of AOT's cache."""
    if trace_regions.guarded:
        return
    trace_regions.guarded = True
    context = TracingContext.try_get()
    if context is None:
        return
    expected = trace_regions.entry_signature
    assert expected is not None  # a trace's records are copied with the signature at entry
    guard = Guard(GlobalStateSource(), functools.partial(_make_guard, expected))
    context.guards_context.dynamo_guards.add(guard)
    from torch._dynamo.symbolic_convert import tls

    # None outside dynamo (AOTAutograd called directly traces no dynamo graph to mark).
    tx = getattr(tls, "current_tx", None)
    if tx is not None and not tx.export:
        tx.output.root_tracer.create_node("call_function", policies_in_effect, (), {})
