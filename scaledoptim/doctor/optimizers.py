"""The fused optimizers the doctor checks: one row each, in one tuple.

To check a new optimizer, add a row: its name in ``scaledoptim``, hyper-parameters that exercise
its options, and the reference it must match (``torch.optim``'s class of the same name unless
given).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import scaledoptim

__all__ = ["OPTIMIZERS", "OptimizerRow"]


@dataclasses.dataclass(frozen=True)
class OptimizerRow:
    """One fused optimizer, its options, and its reference.

    Args:
        name: the class's name in :mod:`scaledoptim` (looked up when a check runs).
        kwargs: constructor options (turn on what the kernel branches on: momentum, amsgrad).
        reference: a ``torch.optim.Optimizer`` class with the same options and state names;
            ``None``: ``torch.optim``'s class called ``name``.
    """

    name: str
    kwargs: dict[str, Any]
    reference: type[torch.optim.Optimizer] | None = None

    def ours(self, params: Any) -> scaledoptim.Optimizer:
        """A scaledoptim optimizer over ``params``."""
        return getattr(scaledoptim, self.name)(params, **self.kwargs)

    def theirs(self, params: Any) -> torch.optim.Optimizer:
        """The reference optimizer over ``params``."""
        reference = self.reference or getattr(torch.optim, self.name)
        return reference(params, **self.kwargs)


OPTIMIZERS: tuple[OptimizerRow, ...] = (
    OptimizerRow("AdamW", {"lr": 1e-2, "weight_decay": 0.1}),
    OptimizerRow("Adam", {"lr": 1e-2, "betas": (0.8, 0.99), "weight_decay": 0.1, "amsgrad": True}),
    OptimizerRow("SGD", {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01, "nesterov": True}),
    OptimizerRow("Adagrad", {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.01}),
)
