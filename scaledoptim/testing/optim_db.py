"""One row per optimizer: what every generic test, the doctor and the benchmarks run over.

Like torch's ``torch.testing._internal.common_optimizers.optim_db``: a generic test takes
:data:`optim_db` (or :func:`rows` of a property) and runs over every row, so adding an optimizer
adds a row. Rows are chosen by name or property (:func:`row`, :func:`rows`), never by position.
No row is written here: each is derived from the optimizer's
:class:`~scaledoptim.optim.spec.OptimizerSpec`, declared in its own file (Note [an optimizer
declared once] in optim/spec.py): its reference, its configs (those the spec names, then the
grid of its options' declared sweep values), its error inputs (a value just outside each
option's declared range, then the spec's other refusals) and the ranges a property test draws.

Each row names its reference: the ``torch.optim`` class of the same math, or ``None`` when torch
has none (Lion, LAMB); then the reference is the optimizer's own torch form run in float64
(:meth:`OptimInfo.reference_for`), so the math is written once, in the optimizer's file.

A row's configs together exercise every branch of its update. Most are a *sweep*
(:func:`sweep`): the grid of options the kernel branches on, which the kernel-level tests (parity
in every dtype pair, found_inf, AddressSanitizer, GPU) run config by config, cheaply; the
optimizer-level tests that compare numbers (trajectories against GradScaler, every dtype and path,
layouts, resume, no host reads) run the row's :attr:`OptimInfo.generic_configs`, and the tests of
the protocol, which does not branch on the update's options, run its :attr:`OptimInfo.default`.

This module needs only torch and scaledoptim: tests build their strategies from the plain
ranges it gives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

import scaledoptim.optim  # noqa: F401  (registers every optimizer's spec)
from scaledoptim.fused import FusedOptimizer
from scaledoptim.kernels import MultiTensorKernel
from scaledoptim.optim.spec import (
    LOW_AND_FULL,
    Config,
    ErrorInput,
    OptimizerSpec,
    Tolerance,
    grid,
    registered,
    sweep,
)

__all__ = [
    "LOW_AND_FULL", "Config", "ErrorInput", "OptimInfo", "Tolerance", "grid", "optim_db", "row",
    "rows", "sweep",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimInfo:
    """One optimizer as the generic tests, the doctor and the benchmarks see it, derived from its
    :class:`~scaledoptim.optim.spec.OptimizerSpec` (as torch's ``OptimizerInfo``, whose
    ``optim_inputs_func`` and ``optim_error_inputs_func`` are the spec's configs and ranges).

    Args:
        spec: the optimizer's declaration, which every field derives from.
    """

    spec: OptimizerSpec
    #: The class's name in :mod:`scaledoptim`.
    name: str = dataclasses.field(init=False)
    #: The class.
    cls: type[torch.optim.Optimizer] = dataclasses.field(init=False)
    #: The ``torch.optim`` class with the same options, math and state names, or ``None``: the
    #: optimizer's own torch form in float64 (see :meth:`reference_for`).
    reference: type[torch.optim.Optimizer] | None = dataclasses.field(init=False)
    #: The option sets that, together, exercise every branch of the update: the spec's, then
    #: the declared sweep; the first is the row's default (what the protocol tests and the
    #: doctor run).
    configs: tuple[Config, ...] = dataclasses.field(init=False)
    #: The options the constructor must refuse.
    error_inputs: tuple[ErrorInput, ...] = dataclasses.field(init=False)
    #: Float options a property test may draw, as ``(low, high)``; a tuple option (``betas``)
    #: as a tuple of ranges.
    ranges: dict[str, Any] = dataclasses.field(init=False)
    #: The param dtypes it updates on our kernels.
    dtypes: tuple[torch.dtype, ...] = LOW_AND_FULL
    #: Of an fp32 step against the reference.
    tolerance: Tolerance = dataclasses.field(init=False)
    #: The param dtypes a test may mix in one launch (a float64 reference can hold a 16-bit
    #: param that nearly cancels its update to more than an ulp).
    mixed_param_dtypes: tuple[torch.dtype, ...] = dataclasses.field(init=False)
    #: ``step()`` evaluates a closure (LBFGS).
    needs_closure: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        spec = self.spec
        for key, value in dict(
            name=spec.name, cls=spec.cls, reference=spec.reference,
            configs=(*spec.configs, *spec.swept()), error_inputs=spec.error_inputs(),
            ranges=spec.ranges(), tolerance=spec.tolerance,
            mixed_param_dtypes=spec.mixed_param_dtypes, needs_closure=spec.needs_closure,
        ).items():
            object.__setattr__(self, key, value)

    def __str__(self) -> str:
        return self.name

    @property
    def fused(self) -> bool:
        """Whether its update is one of our kernels (a :class:`~scaledoptim.FusedOptimizer`)."""
        return issubclass(self.cls, FusedOptimizer)

    @property
    def kernels(self) -> tuple[MultiTensorKernel, ...]:
        """Its update's kernels, in launch order (none for a generic optimizer)."""
        cls = self.cls
        if not issubclass(cls, FusedOptimizer):
            return ()
        return (*cls.kernels_before, cls.kernel)

    @property
    def rounding(self) -> bool:
        """Whether it takes ``master_weights`` and ``stochastic_rounding``."""
        return issubclass(self.cls, FusedOptimizer) and self.cls.rounds

    @property
    def launched_kernels(self) -> tuple[MultiTensorKernel, ...]:
        """Every kernel a step of it launches besides the check and the epilogue: its grad
        reduction's (asked of an instance over one param) and :attr:`kernels`."""
        cls = self.cls
        if not issubclass(cls, FusedOptimizer):
            return ()
        param = torch.zeros(1)
        opt = cls([param], **self.default.kwargs)
        reduction = opt.grad_reduction([param])
        return (*([] if reduction is None else [reduction.kernel]), *self.kernels)

    @property
    def lowbit_kernels(self) -> tuple[MultiTensorKernel, ...]:
        """The kernel of its 8-bit states (``state_bits=8``), if it has them (Note [low-bit
        variants] in fused/lowbit/states.py)."""
        kernel = getattr(self.cls, "lowbit_kernel", None)
        return () if kernel is None else (kernel,)

    @property
    def default(self) -> Config:
        return self.configs[0]

    @property
    def generic_configs(self) -> tuple[Config, ...]:
        """The configs the optimizer-level tests that compare numbers run (not the sweep)."""
        return tuple(config for config in self.configs if config.generic)

    def config(self, name: str) -> Config:
        """The config called ``name``."""
        for config in self.configs:
            if config.name == name:
                return config
        raise KeyError(
            f"{self.name} has no config {name!r}; it has {[c.name for c in self.configs]}"
        )

    def make(
        self, params: Iterable[Any], config: Config | None = None, **changes: Any
    ) -> torch.optim.Optimizer:
        """The optimizer over ``params`` with ``config`` (the default) and ``changes``."""
        return self.cls(params, **{**(config or self.default).kwargs, **changes})

    def reference_for(
        self, params: Iterable[Any], config: Config | None = None, **changes: Any
    ) -> torch.optim.Optimizer:
        """The reference over ``params`` (give float64 params when :attr:`reference` is
        ``None``: the optimizer itself then runs its torch form in float64, our kernels taking
        no float64 params)."""
        cls = self.reference or self.cls
        return cls(params, **{**(config or self.default).kwargs, **changes})

    @property
    def reference_dtype(self) -> torch.dtype | None:
        """The dtype the reference's params must have (``None``: the dtype under test)."""
        return torch.float64 if self.reference is None else None


#: Every registered optimizer's row, in the order of registration.
optim_db: tuple[OptimInfo, ...] = tuple(OptimInfo(spec=spec) for spec in registered())


def row(name: str) -> OptimInfo:
    """The row of the optimizer called ``name``."""
    for info in optim_db:
        if info.name == name:
            return info
    raise KeyError(f"optim_db has no row {name!r}; it has {[info.name for info in optim_db]}")


def rows(
    *,
    fused: bool | None = None,
    reference: bool | None = None,
    closure: bool | None = None,
    rounding: bool | None = None,
) -> tuple[OptimInfo, ...]:
    """The rows with these properties (``None``: either): ``fused`` (our kernels),
    ``reference`` (a torch.optim reference), ``closure`` (``step()`` needs a closure),
    ``rounding`` (takes ``master_weights`` and ``stochastic_rounding``)."""
    return tuple(
        info
        for info in optim_db
        if (fused is None or info.fused == fused)
        and (reference is None or (info.reference is not None) == reference)
        and (closure is None or info.needs_closure == closure)
        and (rounding is None or info.rounding == rounding)
    )
