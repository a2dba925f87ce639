"""An optimizer declared once: :class:`OptimizerSpec`, one per optimizer, in the optimizer's
own file, and the registry that the package exports, the optimizer table of the tests
(``scaledoptim.testing.optim_db``) and the docs site's list of optimizers derive from.

The class holds what runs (its kernels, its ``rounds`` flag, its torch form, its options
dataclass, Note [an optimizer declared once]); the spec adds what the tables and the docs read:
the ``torch.optim`` reference, the configs beyond the declared sweep, the refusals beyond the
declared ranges, the tolerance of its tests and the docs fragment. Declaring a spec registers
it, so importing the optimizer's module (its one line in ``optim/__init__.py``) is the whole
registration.
"""

# Note [an optimizer declared once]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each fact about an optimizer is written in one place, its file in optim/: the kernel and the
# `rounds` flag (read by the engine: planning, loading, routes), the options dataclass (read by
# the group checks, the kernel's arguments and the torch form; its ranges and sweeps give the
# tests their error inputs and configs), and this spec. Everything else derives: the package's
# exports, optim_db's rows, the docs site's nav and list (docs/optimizer_pages.py), and
# tests/optim/test_registry.py fails when a derivation misses one.

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable
from typing import Any

import torch

from ..fused.options import Check, Options

__all__ = [
    "Config", "ErrorInput", "OptimizerSpec", "Tolerance", "grid", "registered", "sweep",
]

#: The param dtypes of mixed-precision training; the fused kernels take each of them.
LOW_AND_FULL = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Config:
    """Constructor options that exercise a branch of an optimizer's update.

    ``generic``: the optimizer-level tests that compare numbers run it too; ``False`` (a
    :func:`sweep` config): only the kernel-level tests, which run every config.
    """

    name: str
    kwargs: dict[str, Any]
    generic: bool = True

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class ErrorInput:
    """Constructor options that must be refused: ``error`` whose message matches ``match``."""

    name: str
    kwargs: dict[str, Any]
    error: type[Exception]
    match: str

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Of an fp32 step against the fp32 reference (16-bit params are held to one ulp), and of
    the params after a few training steps (``trajectory_*``)."""

    param_rtol: float = 1e-6
    param_atol: float = 1e-6
    state_rtol: float = 1e-6
    state_atol: float = 1e-7
    trajectory_rtol: float = 1e-5
    trajectory_atol: float = 1e-7


def grid(**choices: Iterable[Any]) -> tuple[Config, ...]:
    """A :class:`Config` for every combination of ``choices``, named after the options that vary
    (a flag by its name when set, another value as ``key=value``)."""
    options = {key: tuple(values) for key, values in choices.items()}
    varying = [key for key, values in options.items() if len(values) > 1]
    configs = []
    for values in itertools.product(*options.values()):
        kwargs = dict(zip(options, values))
        labels = [
            key if kwargs[key] is True else f"{key}={kwargs[key]}"
            for key in varying
            if kwargs[key] is not False
        ]
        configs.append(Config("-".join(labels) or "base", kwargs))
    return tuple(configs)


def sweep(*configs: Config) -> tuple[Config, ...]:
    """``configs`` for the kernel-level tests only (see :class:`Config`)."""
    return tuple(dataclasses.replace(config, generic=False) for config in configs)


_registry: dict[str, OptimizerSpec] = {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """One optimizer as the tables and the docs see it; declaring it registers it.

    Args:
        cls: the optimizer (its kernels, ``rounds`` flag, torch form and ``options`` are
            attributes of the class).
        summary: the docs fragment: what the docs site's list of optimizers says of it.
        reference: the ``torch.optim`` class with the same options, math and state names, or
            ``None``: the optimizer's own torch form in float64 is the reference.
        configs: option sets that exercise its branches beyond the declared sweep; the first
            is its default (what the protocol tests and the doctor run).
        refusals: options its constructor refuses beyond the declared ranges.
        tolerance: of an fp32 step against the reference.
        mixed_param_dtypes: the param dtypes a test may mix in one launch.
        needs_closure: ``step()`` evaluates a closure (LBFGS).
    """

    cls: type[torch.optim.Optimizer]
    summary: str
    reference: type[torch.optim.Optimizer] | None
    configs: tuple[Config, ...]
    refusals: tuple[ErrorInput, ...] = ()
    tolerance: Tolerance = Tolerance()
    mixed_param_dtypes: tuple[torch.dtype, ...] = LOW_AND_FULL
    needs_closure: bool = False

    def __post_init__(self) -> None:
        _registry[self.name] = self

    @property
    def name(self) -> str:
        """The class's name, as :mod:`scaledoptim` exports it."""
        return self.cls.__name__

    @property
    def page(self) -> str:
        """Its page of the API reference: ``docs/api/<page>.md``."""
        return self.name.lower()

    @property
    def options(self) -> type[Options] | None:
        """The class's options dataclass (``fused/options.py``), if it declares one."""
        return getattr(self.cls, "options", None)

    def _fields(self) -> list[dataclasses.Field[Any]]:
        return [] if self.options is None else list(dataclasses.fields(self.options))

    def swept(self) -> tuple[Config, ...]:
        """The grid of every option's declared ``sweep`` values, less what the constructor
        refuses (Nesterov without momentum), as :func:`sweep` configs."""
        choices = {f.name: f.metadata["sweep"] for f in self._fields() if f.metadata["sweep"]}
        if not choices:
            return ()
        return sweep(*(config for config in grid(**choices) if not self._refuses(config)))

    def _refuses(self, config: Config) -> bool:
        try:
            self.cls([torch.zeros(1, requires_grad=True)], **config.kwargs)
        except ValueError:
            return True
        return False

    def error_inputs(self) -> tuple[ErrorInput, ...]:
        """For each checked option, a value just outside its range (each element of a tuple
        option), then :attr:`refusals`."""
        derived = []
        for field in self._fields():
            check: Check | None = field.metadata["check"]
            if check is None:
                continue
            edges = [
                *([(f"below {check.low:g}", check.low - 1)] if check.low > -float("inf") else []),
                *([(f"of {check.high:g}", check.high)] if check.high is not None else []),
            ]
            default = field.default
            for index, (label, name, _) in enumerate(check.labels(field.name, default)):
                for edge, bad in edges:
                    value: Any = bad
                    if isinstance(default, tuple):  # the element at `index` out of range
                        value = tuple(bad if i == index else x for i, x in enumerate(default))
                    derived.append(ErrorInput(
                        f"{name} {edge}", {field.name: value}, ValueError,
                        re.escape(f"Invalid {label}"),
                    ))
        return (*derived, *self.refusals)

    def ranges(self) -> dict[str, Any]:
        """The options a property test may draw, with their declared ``draw`` ranges."""
        return {f.name: f.metadata["draw"] for f in self._fields() if f.metadata["draw"]}


def registered() -> tuple[OptimizerSpec, ...]:
    """Every declared spec, in the order the package registers them (``optim/__init__.py``)."""
    return tuple(_registry.values())
