"""What a check function returns, and the helpers the checks share."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import torch

from ..fused.backends import KERNELS, select

__all__ = ["Outcome", "backend_label", "kernels_env", "same_bits", "snapshot"]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """Whether a check passed, and what it measured or found (one line).

    ``skipped``: the check does not apply to this machine (``detail`` says why, and how to
    enable it); it neither passes nor fails.
    """

    passed: bool
    detail: str
    skipped: bool = False

    @classmethod
    def skip(cls, detail: str) -> Outcome:
        """A check that does not apply here, and why."""
        return cls(True, detail, skipped=True)


@contextlib.contextmanager
def kernels_env(mode: str | None) -> Iterator[None]:
    """``SCALEDOPTIM_KERNELS=mode`` inside the block, restored after; ``None`` leaves it as the
    user set it."""
    saved = os.environ.get("SCALEDOPTIM_KERNELS")
    try:
        if mode is not None:
            os.environ["SCALEDOPTIM_KERNELS"] = mode
        yield
    finally:
        if saved is None:
            os.environ.pop("SCALEDOPTIM_KERNELS", None)
        else:
            os.environ["SCALEDOPTIM_KERNELS"] = saved


def backend_label(device: torch.device) -> str:
    """What runs the fused steps on ``device``, in the doctor's words: our kernels are the
    "CUDA kernels" on a GPU and the "CPU emulator" (``SCALEDOPTIM_KERNELS=emulate``) elsewhere."""
    name = select(device).name
    if name == KERNELS.name:
        return "CUDA kernels" if device.type == "cuda" else "CPU emulator"
    return f"{name} backend"


def snapshot(opt: torch.optim.Optimizer, scale: bool = True) -> dict[str, torch.Tensor]:
    """Copies of every tensor a step may change: params, per-param state and, unless ``scale``
    is false (a skipped step backs it off), the loss scale and its trackers (through the
    public ``state_dict``), keyed by a readable name."""
    tensors = {}
    params = [p for group in opt.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        tensors[f"param[{i}]"] = p.detach().clone()
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[f"state[{i}][{key!r}]"] = value.detach().clone()
    for key, value in (opt.state_dict().get("loss_scale", {}) if scale else {}).items():
        if isinstance(value, torch.Tensor):
            tensors[f"loss_scale[{key!r}]"] = value.detach().clone()
    return tensors


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str | None:
    """``None`` when ``a`` and ``b`` hold the same names and bit-identical tensors, else the first
    difference."""
    if a.keys() != b.keys():
        return f"different tensors: {sorted(a.keys() ^ b.keys())}"
    for name, x in a.items():
        y = b[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return f"{name} differs"
    return None
