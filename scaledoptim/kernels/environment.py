"""The ``SCALEDOPTIM_*`` environment variables: which exist, and a warning for any other.

A misspelt variable (``KERNEL`` for ``KERNELS``, say) would otherwise be ignored in silence and
the run would use the defaults it meant to change.
"""

from __future__ import annotations

import difflib
import os
import warnings

__all__ = ["KNOWN_VARIABLES", "warn_unknown_variables"]

#: Every ``SCALEDOPTIM_*`` variable scaledoptim reads (tests/kernels/test_disk_cache.py checks
#: the list against the package's source).
KNOWN_VARIABLES = (
    "SCALEDOPTIM_CACHE_DIR",  # the kernel cache folder (kernels/disk_cache.py)
    "SCALEDOPTIM_EMULATOR_SANITIZE",  # the emulator's sanitizer (kernels/emulator.py)
    "SCALEDOPTIM_KERNELS",  # which backend runs fused updates (fused/backends)
)

_warned: set[str] = set()


def warn_unknown_variables() -> None:
    """Warns once per name about each ``SCALEDOPTIM_*`` environment variable scaledoptim does
    not read, listing those it does."""
    unknown = [
        name
        for name in os.environ
        if name.startswith("SCALEDOPTIM_") and name not in KNOWN_VARIABLES and name not in _warned
    ]
    for name in sorted(unknown):
        _warned.add(name)
        close = difflib.get_close_matches(name, KNOWN_VARIABLES, n=1)
        hint = f" Did you mean {close[0]}?" if close else ""
        warnings.warn(
            f"The environment variable {name} is not one scaledoptim reads, so it has no "
            f"effect.{hint} The variables scaledoptim reads are {', '.join(KNOWN_VARIABLES)}.",
            RuntimeWarning,
            stacklevel=2,
        )
