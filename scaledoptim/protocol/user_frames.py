"""Where a warning should point: the user's line, not ours or torch's.

A fixed ``stacklevel`` names the right line only while the call path keeps its depth; the
GradScaler facade, the protocol's step and torch's GradScaler (whose ``step`` runs under
``torch.utils._contextlib``'s decorators) each add frames. :func:`user_stacklevel` counts them.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["user_stacklevel"]

# scaledoptim's folder (this file is scaledoptim/protocol/user_frames.py) and torch's.
_LIBRARIES = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the calling function name the first
    frame outside scaledoptim and torch (the line of the user's script that called into them)."""
    frame = sys._getframe(1)  # the function that warns: stacklevel=1
    level = 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        _LIBRARIES
    ):
        frame = frame.f_back
        level += 1
    return level
