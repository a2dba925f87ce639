"""CUDA-graph capture guards."""

from __future__ import annotations

import torch

__all__ = ["capturing", "refuse_during_capture"]


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def refuse_during_capture(what: str) -> None:
    """Raises if a CUDA graph is being captured: ``what`` would be recorded once and replayed
    wrong, or would sync."""
    if capturing():
        raise RuntimeError(
            f"{what} cannot happen inside CUDA graph capture. Take one eager step first (it "
            "creates the optimizer state and compiles the kernels), pass opt.scale (or a Python "
            "float) as the scale, then capture."
        )
