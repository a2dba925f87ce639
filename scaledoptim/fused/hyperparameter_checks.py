"""A fused optimizer's hyper-parameters validated as ``torch.optim`` validates them (its
``check_options``): ``ValueError`` naming the value, ``TypeError`` for a tensor where torch takes
none; an option torch also takes as a one-element tensor is read as the update reads it
(:func:`~scaledoptim.fused.plan.hyperparameter`)."""

from __future__ import annotations

from typing import Any

import torch

from .plan import hyperparameter

__all__ = ["check_hyperparameter", "check_tensor_hyperparameter"]


def check_hyperparameter(
    name: str, value: Any, low: float = 0.0, high: float | None = None
) -> None:
    """``ValueError(f"Invalid {name}: {value}")`` unless ``low <= value (< high)``, torch's
    style."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a Python float, not a tensor (got {value!r})")
    if not (low <= value and (high is None or value < high)):
        raise ValueError(f"Invalid {name}: {value}")


def check_tensor_hyperparameter(
    label: str, name: str, value: object, low: float = 0.0, high: float | None = None
) -> None:
    """:func:`check_hyperparameter` for an option torch.optim also takes as a one-element tensor
    (``name``: the option, as torch's ``"Tensor lr must be 1-element"`` names it). A tensor on an
    accelerator is not read: a check at every step would sync the device."""
    value = hyperparameter(name, value)
    if not isinstance(value, torch.Tensor):
        check_hyperparameter(label, value, low, high)
