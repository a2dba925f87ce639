"""An optimizer's hyper-parameters declared once, as a frozen dataclass whose fields say their
default, their valid range and the values the tests sweep: the checks of a param group, the
values its update reads, and the tests' configs and error inputs all derive from it.

A field is declared with :func:`option`::

    @dataclasses.dataclass(frozen=True)
    class LionOptions:
        lr: float = option(1e-4, check="learning rate", draw=(1e-4, 1e-1))
        betas: tuple[float, float] = option((0.9, 0.99), check="beta parameter", high=1.0)
        maximize: bool = option(False, sweep=(False, True))

:func:`check_options` then raises torch's ``ValueError("Invalid learning rate: -1.0")`` for a
group's ``lr=-1.0``, and :func:`read_options` gives the update ``LionOptions`` with attributes
(a one-element CPU tensor read as its number).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import torch

from .plan import hyperparameter, read_options

__all__ = [
    "Check", "Options", "check_hyperparameter", "check_options", "check_tensor_hyperparameter",
    "option", "read_options",
]


class Options(Protocol):
    """A frozen dataclass of :func:`option` fields."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Check:
    """A hyper-parameter's valid range, ``low <= value (< high)``, and the name its error gives:
    ``ValueError(f"Invalid {label}: {value}")`` (a tuple option: ``f"{label} at index {i}"``).
    ``tensor``: a one-element tensor is accepted, as torch.optim accepts it."""

    label: str
    low: float = 0.0
    high: float | None = None
    tensor: bool = False

    def labels(self, name: str, value: Any) -> list[tuple[str, str, Any]]:
        """``(label, name, value)`` for each number ``value`` holds (each element of a tuple)."""
        if isinstance(value, (tuple, list)):
            return [
                (f"{self.label} at index {i}", f"{name}[{i}]", item) for i, item in enumerate(value)
            ]
        return [(self.label, name, value)]


def option(
    default: Any,
    *,
    check: str | None = None,
    low: float = 0.0,
    high: float | None = None,
    tensor: bool = False,
    sweep: tuple[Any, ...] = (),
    draw: tuple[Any, ...] | None = None,
) -> Any:
    """A field of an options dataclass.

    Args:
        default: the constructor's default.
        check: the name its ``ValueError`` gives (``"learning rate"``); ``None``: not checked
            (a flag, or an option with its own check).
        low, high: the valid range, ``low <= value (< high)``.
        tensor: torch.optim also takes it as a one-element tensor.
        sweep: the values the kernel-level tests sweep (their grid, over every option with
            some; one value fixes it in every swept config).
        draw: the ``(low, high)`` a property test may draw a value from (a tuple option: a
            tuple of them).
    """
    metadata = {
        "check": None if check is None else Check(check, low, high, tensor),
        "tensor": tensor,
        "sweep": sweep,
        "draw": draw,
    }
    return dataclasses.field(default=default, metadata=metadata)


def check_options(options: type[Options], group: Mapping[str, Any]) -> None:
    """Refuses a ``group`` option outside its declared range (torch's messages), in the order
    the fields are declared."""
    for field in dataclasses.fields(options):
        check: Check | None = field.metadata.get("check")
        if check is None:
            continue
        for label, name, value in check.labels(field.name, group[field.name]):
            if check.tensor:
                check_tensor_hyperparameter(label, name, value, check.low, check.high)
            else:
                check_hyperparameter(label, value, check.low, check.high)


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
