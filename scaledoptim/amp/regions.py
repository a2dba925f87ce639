"""Which autocast region governs each device type on this thread, and whether it is ours.

Note [telling regions apart]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch keeps autocast state per thread in C++: an enabled flag
and a dtype per device type, and one nesting counter shared by all device types. Nothing in
that state says which region set it, and nothing tells a ``torch.autocast("cuda")`` region
from a ``torch.autocast("cpu")`` one with the same settings. So every region is recorded
here, in entry order, with its device type: scaledoptim's regions by ``enter_region``, and,
once a scaledoptim region has been entered in the process, ``torch.autocast`` regions by two
hooks on ``torch.autocast.__enter__``/``__exit__`` (``_install_torch_autocast_hooks``; they
call torch's methods unchanged and only record; installed by the first scaledoptim region,
not on import, so importing scaledoptim changes nothing in torch). Regions opened before the
hooks cannot be inside a scaledoptim region, so missing them changes nothing. An op on a device is
governed by the innermost recorded region *of that device*: a region of another device type entered
inside a scaledoptim region leaves its policies in force, and a plain ``torch.autocast`` region of
the same device type gets torch's policies. Each record also keeps torch's nesting level
after its entry; when the counter has moved past the last record, a region was entered
without ``torch.autocast`` (``torch.set_autocast_enabled``, TorchScript) and nobody knows
its device, so scaledoptim's policies stand down and torch's apply, as they would in a plain
region.

Note [regions under torch.compile]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
While dynamo or AOTAutograd traces a function, regions
entered by the traced code are recorded on a copy of the thread's records owned by the
trace (``TracingContext``), never on the thread's own: a trace that is abandoned halfway
leaves nothing behind. ``enter_region``/``exit_region`` are placed in the graph
(``allow_in_graph``), so a region entered in compiled code is entered when the graph runs and
when AOTAutograd traces it. A trace that runs a scaledoptim kernel guards the compiled code
on the policy version and on the regions open when it is called (``signature``), and bypasses
AOTAutograd's cache, whose key does not show scaledoptim's state (``compile_support``).
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch
import torch.compiler as _compiler
from torch._guards import TracingContext

from .. import compile_boundary
from . import compile_support, edits, policies
from .cache import thread_cache

DEVICE_TYPES: tuple[str, ...] = tuple(policies.AUTOCAST_DISPATCH_KEYS)
# Frames of these modules are scaledoptim's or contextlib's: a region's entry frame is the
# first frame outside them (the code whose ``with`` block the region is).
_OWN_MODULES = ("scaledoptim.amp.", "contextlib")


class Entry:
    """One open region: its device type, whether it is scaledoptim's and torch's nesting
    level after it was entered. A scaledoptim region entered outside a trace also keeps
    what ``torch_checkpoint.refuse_torch_checkpoint`` compares with: the frame whose ``with``
    block it is, grad mode and the innermost saved-tensor hooks at entry."""

    __slots__ = ("device_type", "frame", "grad_enabled", "hooks", "level", "ours", "snapshot",
                 "token")

    def __init__(
        self,
        device_type: str,
        ours: bool,
        level: int,
        token: Any = None,
        snapshot: edits.Snapshot | None = None,
        frame: Any = None,
    ) -> None:
        self.device_type = device_type
        self.ours = ours
        self.level = level
        self.token = token  # the torch.autocast object of a plain region
        self.snapshot = snapshot  # the frozen edits of a checkpoint's recomputation
        self.frame = frame
        self.grad_enabled = frame is not None and torch.is_grad_enabled()
        self.hooks = (
            torch._C._autograd._top_saved_tensors_default_hooks(True) if frame is not None else None
        )


class Regions:
    """The open regions of one thread, or of one trace (Note [regions under torch.compile])."""

    __slots__ = ("by_device", "entries", "entry_signature", "guarded", "ours_open", "traced")

    def __init__(self, traced: bool = False) -> None:
        self.entries: list[Entry] = []
        self.by_device: dict[str, list[Entry]] = {}
        self.ours_open = 0
        self.traced = traced
        self.guarded = False
        self.entry_signature: tuple[Any, ...] | None = None

    def copy_for_trace(self) -> Regions:
        regions = Regions(traced=True)
        regions.entries = list(self.entries)
        regions.by_device = {device: list(stack) for device, stack in self.by_device.items()}
        regions.ours_open = self.ours_open
        # What the compiled code is guarded on: the state when it is called, i.e. before
        # the trace entered anything (the records are copied before any region the trace
        # enters changes torch's nesting level, see _install_torch_autocast_hooks).
        regions.entry_signature = signature()
        return regions

    def push(self, entry: Entry) -> None:
        self.entries.append(entry)
        self.by_device.setdefault(entry.device_type, []).append(entry)
        self.ours_open += entry.ours

    def remove(self, entry: Entry) -> None:
        # Regions exit in reverse order of entry, so this is the last entry in practice;
        # the search keeps the records right if a caller exits them out of order.
        _remove_last(self.entries, entry)
        _remove_last(self.by_device[entry.device_type], entry)
        self.ours_open -= entry.ours

    def governing(self, device_type: str) -> Entry | None:
        """Return the scaledoptim region governing ``device_type`` now, or ``None``."""
        stack = self.by_device.get(device_type)
        if not stack or not stack[-1].ours:
            return None
        if self.entries[-1].level != current_nesting():
            return None  # a region entered without torch.autocast (Note [telling regions apart])
        return stack[-1]


def _remove_last(entries: list[Entry], entry: Entry) -> None:
    for index in range(len(entries) - 1, -1, -1):
        if entries[index] is entry:
            del entries[index]
            return


_local = threading.local()
# The records of each trace in progress, dropped with its TracingContext.
_traces: weakref.WeakKeyDictionary[TracingContext, Regions] = weakref.WeakKeyDictionary()


def thread_regions() -> Regions:
    """Return the calling thread's own records (never a trace's)."""
    try:
        return _local.regions
    except AttributeError:
        _local.regions = Regions()
        return _local.regions


def current() -> Regions:
    """Return the records that the code running now enters regions on and reads."""
    if _compiler._is_compiling_flag:  # set while anything compiles, on any thread
        context = TracingContext.try_get()
        if context is not None:
            regions = _traces.get(context)
            if regions is None:
                regions = _traces[context] = thread_regions().copy_for_trace()
            return regions
    return thread_regions()


_increment_nesting = torch.autocast_increment_nesting
_decrement_nesting = torch.autocast_decrement_nesting


def current_nesting() -> int:
    """Return torch's autocast nesting level on this thread, leaving it unchanged."""
    _increment_nesting()
    return _decrement_nesting()


def _entry_frame() -> Any:
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_OWN_MODULES):
        frame = frame.f_back
    return frame


@compile_boundary.assume_constant_result
def install() -> bool:
    """Prepare for a scaledoptim region: call before entering its ``torch.autocast``.

    Under ``torch.compile`` dynamo runs it while tracing instead of tracing it, before it
    meets ``enter_region``: so the region functions are made nodes of dynamo's graph here,
    once dynamo is loaded, not with the package
    (Note [lazy compile boundary]).
    """
    if compile_boundary.dynamo_loaded():
        compile_support.put_in_graph((enter_region, exit_region))

    _install_torch_autocast_hooks()
    return True


def enter_region(device_type: str, snapshot_version: int | None = None) -> None:
    """Record that a scaledoptim region for ``device_type`` was just entered.

    Call it after entering ``torch.autocast`` for the region. It is a node of the graph under
    ``torch.compile`` (Note [regions under torch.compile]).

    Args:
        device_type: the region's device type.
        snapshot_version: apply the edits of this policy version, kept by
            ``edits.keep_snapshot`` (a checkpoint's recomputation); ``None``: the
            current edits.
    """
    snapshot = None if snapshot_version is None else edits.kept_snapshot(snapshot_version)
    regions = current()
    if regions.traced:
        entry = Entry(device_type, True, current_nesting(), snapshot=snapshot)
        compile_support.note_trace_depends_on_policies(regions, signature)
    else:
        if not regions.ours_open:
            thread_cache().reset()
        entry = Entry(device_type, True, current_nesting(), snapshot=snapshot,
                      frame=_entry_frame())
    regions.push(entry)


def exit_region(device_type: str) -> None:
    """Record that the innermost scaledoptim region for ``device_type`` is being exited."""
    regions = current()
    for entry in reversed(regions.by_device.get(device_type, ())):
        if entry.ours:
            regions.remove(entry)
            break
    if not regions.traced and not regions.ours_open:
        thread_cache().clear()


def governing(device_type: str) -> tuple[Entry | None, Regions]:
    """Return the scaledoptim region governing ``device_type`` (or ``None``) and its records.

    Called by scaledoptim's kernels on every call (hence written out): under a trace it also
    makes the compiled code depend on the policies and regions it was traced with (Note
    [regions under torch.compile]).
    """
    if _compiler._is_compiling_flag:
        regions = current()
        if regions.traced and not regions.guarded:
            compile_support.note_trace_depends_on_policies(regions, signature)
    else:
        try:
            regions = _local.regions
        except AttributeError:
            return None, thread_regions()
    stack = regions.by_device.get(device_type)
    if not stack:
        return None, regions
    entry = stack[-1]
    if not entry.ours:
        return None, regions
    _increment_nesting()
    if regions.entries[-1].level != _decrement_nesting():
        return None, regions  # a region entered without torch.autocast
    return entry, regions


def in_scaledoptim_region(device_type: str) -> bool:
    """Return True when the innermost autocast region for ``device_type`` is scaledoptim's."""
    return current().governing(device_type) is not None


def signature() -> tuple[Any, ...]:
    """What a kernel's choices depend on, as seen by code called now on this thread.

    The policy version, and for each device type whether a scaledoptim region governs it,
    with the version of the edits it applies (-1: the current ones).
    """
    regions = thread_regions()
    devices: list[int | None] = []
    for device_type in DEVICE_TYPES:
        entry = regions.governing(device_type)
        if entry is None:
            devices.append(None)
        elif entry.snapshot is None or entry.snapshot.version == edits.version:
            devices.append(-1)
        else:
            devices.append(entry.snapshot.version)
    return (edits.version, tuple(devices))


def governed_devices() -> list[str]:
    """Return the device types that a scaledoptim region governs now."""
    regions = current()
    if regions.traced:
        compile_support.note_trace_depends_on_policies(regions, signature)
    return [device for device in DEVICE_TYPES if regions.governing(device) is not None]


# Recording torch.autocast regions (Note [telling regions apart]).

_hooks_lock = threading.Lock()
_hooks_installed = False


def _note_torch_exit(mode: Any) -> None:
    regions = current()
    for entry in reversed(regions.entries):
        if entry.token is mode:
            regions.remove(entry)
            return
    # A region entered before the hooks were installed was never recorded.


def _install_torch_autocast_hooks() -> None:
    """Make ``torch.autocast`` record its regions (once per process, on first use)."""
    global _hooks_installed
    if _hooks_installed:
        return
    with _hooks_lock:
        if _hooks_installed:
            return
        mode_class = torch.amp.autocast_mode.autocast
        torch_enter, torch_exit = mode_class.__enter__, mode_class.__exit__

        # TorchScript compiles these methods when a scripted function uses torch.autocast;
        # the scripting branches are torch's own (autocast is handled by the JIT there).
        def __enter__(self):
            if torch._jit_internal.is_scripting():
                assert self.fast_dtype is not None
                return self
            # Records first: a trace copies the thread's before the nesting level moves.
            regions = current()
            result = torch_enter(self)
            regions.push(Entry(self.device, False, current_nesting(), token=self))
            return result

        def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any):
            if torch._jit_internal.is_scripting():
                return
            try:
                return torch_exit(self, exc_type, exc_val, exc_tb)
            finally:
                _note_torch_exit(self)

        # dynamo traces a torch.autocast region itself and never these methods, except for a
        # graph break inside the region, where its resume code calls them: it must then
        # skip them, as it skips torch's own (inlining them fails on its stand-in object).
        # skip() marks the code objects and leaves the functions as they are.
        from torch._dynamo.decorators import skip

        skip(__enter__)
        skip(__exit__)
        __enter__.__wrapped__ = torch_enter  # type: ignore[attr-defined]
        __exit__.__wrapped__ = torch_exit  # type: ignore[attr-defined]
        __enter__.__doc__, __exit__.__doc__ = torch_enter.__doc__, torch_exit.__doc__
        mode_class.__enter__ = __enter__  # type: ignore[method-assign]
        mode_class.__exit__ = __exit__  # type: ignore[method-assign]
        _hooks_installed = True
