"""The version of the edited policies, and frozen copies of them.

Note [policy version]: every change of an op's edit bumps one process-wide counter. Compiled
code traced through scaledoptim's kernels is guarded on it (Note [regions under
torch.compile]), and a ``Snapshot`` taken for an activation checkpoint keeps the edits its
forward ran with, so the recomputation in backward applies them even if policies were
edited in between (see ``scaledoptim.amp.checkpoint``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cast_kernels import PolicySlot

# Bumped under registry._lock; read without it (an int read is atomic).
version = 0


def bump() -> None:
    """Record that an op's edit changed (call with the registry's lock held)."""
    global version
    version += 1


class Snapshot:
    """The edits in force at one policy version: ``edits[slot]`` is a slot's edit or ``None``."""

    __slots__ = ("edits", "version")

    def __init__(self, version: int, edits: dict[PolicySlot, Any]) -> None:
        self.version = version
        self.edits = edits
