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

It imports no other module of ``amp``: ``regions`` imports it and passes in what it needs (its
region functions, its ``signature``), and it imports dynamo only once dynamo is loaded (Note
[lazy compile boundary]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

from torch._guards import Guard, TracingContext

Signature = Callable[[], tuple[Any, ...]]


class TraceRecords(Protocol):
    """What a guard needs of a trace's region records (``regions.Regions``)."""

    guarded: bool
    entry_signature: tuple[Any, ...] | None


def policies_in_effect() -> None:
    """Marks a dynamo graph that scaledoptim's kernels were traced in; does nothing."""


_in_graph: list[bool] = []


def put_in_graph(functions: tuple[Callable[..., Any], ...]) -> None:
    """Make ``functions`` (the region functions) and :func:`policies_in_effect` nodes of
    dynamo's graph, once; call only when dynamo is loaded."""
    if _in_graph:
        return
    import torch._dynamo
    from torch.fx.node import has_side_effect

    for function in (*functions, policies_in_effect):
        torch._dynamo.allow_in_graph(function)
        has_side_effect(function)  # no output: without this, dead code elimination drops it
    _in_graph.append(True)


def _make_guard(
    expected: tuple[Any, ...], signature: Signature, builder: Any, guard: Guard
) -> None:
    def check(_: Any) -> bool:
        return signature() == expected

    builder.guard_manager.root.add_lambda_guard(
        check, [f"scaledoptim.amp.regions.signature() == {expected!r}"], guard.user_stack
    )


def note_trace_depends_on_policies(trace_regions: TraceRecords, signature: Signature) -> None:
    """Guard the code being traced on scaledoptim's state (``signature()``, as it was at the
    trace's entry) and keep it out of AOT's cache."""
    if trace_regions.guarded:
        return
    trace_regions.guarded = True
    context = TracingContext.try_get()
    if context is None:
        return
    expected = trace_regions.entry_signature
    assert expected is not None  # a trace's records are copied with the signature at entry
    from torch._dynamo.source import GlobalStateSource  # loaded: a trace is running

    guard = Guard(GlobalStateSource(), functools.partial(_make_guard, expected, signature))
    context.guards_context.dynamo_guards.add(guard)
    from torch._dynamo.symbolic_convert import tls

    # None outside dynamo (AOTAutograd called directly traces no dynamo graph to mark).
    tx = getattr(tls, "current_tx", None)
    if tx is not None and not tx.export:
        tx.output.root_tracer.create_node("call_function", policies_in_effect, (), {})
