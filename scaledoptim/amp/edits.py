"""The version of the edited policies, the slot a kernel reads its edit from, and frozen copies
of the edits.

Note [policy version]
~~~~~~~~~~~~~~~~~~~~~
Every change of an op's edit bumps one process-wide counter. Compiled
code traced through scaledoptim's kernels is guarded on it (Note [regions under
torch.compile]), and a ``Snapshot`` taken for an activation checkpoint keeps the edits its
forward ran with, so the recomputation in backward applies them even if policies were
edited in between (see ``scaledoptim.amp.checkpoint``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cache import CastCache

Args = tuple[Any, ...]
Kwargs = dict[str, Any]
Preparer = Callable[[Args, Kwargs, "CastCache | None"], tuple[Callable[..., Any], Args, Kwargs]]

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


class PolicySlot:
    """The edited policy an installed kernel reads on every call (Note [policy slots]).

    ``edit`` is ``None`` (torch's default applies) or ``(policy, preparer)``; it is replaced
    as a whole, so a kernel reading it on another thread sees the old or the new edit.
    """

    __slots__ = ("edit",)

    def __init__(self, edit: tuple[str | None, Preparer] | None = None) -> None:
        self.edit = edit


# Snapshots of recent policy versions, for checkpoints' recomputations (Note [policy
# version]); a recomputation normally runs before the policies change again. Kept here, below
# both the registry (which freezes them) and the regions (which apply them).
_KEPT_SNAPSHOTS = 64
_kept: dict[int, Snapshot] = {}


def keep_snapshot(edits_now: Callable[[], dict[PolicySlot, Any]]) -> int:
    """Freeze the edits in force now, ``edits_now()``, unless this version's are kept already,
    and return the version (call with the registry's lock held; see ``kept_snapshot``)."""
    if version not in _kept:
        _kept[version] = Snapshot(version, edits_now())
        while len(_kept) > _KEPT_SNAPSHOTS:
            del _kept[next(iter(_kept))]  # the oldest version
    return version


def kept_snapshot(version: int) -> Snapshot:
    """Return the edits frozen by ``keep_snapshot`` at ``version``.

    Raises:
        RuntimeError: checkpointed functions ran under 64 other policy versions since (the
            snapshot was dropped), before this checkpointed forward was recomputed.
    """
    snapshot = _kept.get(version)
    if snapshot is None:
        raise RuntimeError(
            f"The autocast policies in force when this checkpointed function ran (version "
            f"{version}) are no longer kept: checkpointed functions ran under "
            f"{_KEPT_SNAPSHOTS} other policy versions before backward recomputed it. Edit "
            "policies between iterations, not between a forward pass and its backward"
        )
    return snapshot
