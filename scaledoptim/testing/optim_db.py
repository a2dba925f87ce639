"""One row per optimizer: what every generic test, the doctor and the benchmarks run over.

Like torch's ``torch.testing._internal.common_optimizers.optim_db``: a generic test takes
:data:`optim_db` (or :func:`rows` of a property) and runs over every row, so adding an optimizer
is adding a row. Rows are chosen by name or property (:func:`row`, :func:`rows`), never by
position. A row is written by keyword and names its configs and error inputs by function (in
``optim_inputs.py``), as torch's ``OptimizerInfo`` names its ``optim_inputs_func`` and
``optim_error_inputs_func``; it reads no private of the optimizer.

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
from collections.abc import Callable, Iterable
from typing import Any

import torch

from scaledoptim.fused import FusedOptimizer
from scaledoptim.kernels import MultiTensorKernel
from scaledoptim.optim import (
    LAMB,
    SGD,
    Adagrad,
    Adam,
    AdamW,
    Lion,
    RMSprop,
)
from scaledoptim.protocol import LBFGS

from .optim_inputs import (
    Config,
    ErrorInput,
    configs_adagrad,
    configs_adam,
    configs_adamw,
    configs_lamb,
    configs_lbfgs,
    configs_lion,
    configs_rmsprop,
    configs_sgd,
    error_inputs_adagrad,
    error_inputs_adam,
    error_inputs_lamb,
    error_inputs_lbfgs,
    error_inputs_lion,
    error_inputs_rmsprop,
    error_inputs_sgd,
    grid,
    no_error_inputs,
    sweep,
)

__all__ = [
    "Config", "ErrorInput", "OptimInfo", "Tolerance", "grid", "optim_db", "row",
    "rows", "sweep",
]

#: The param dtypes of mixed-precision training; the fused kernels take each of them.
LOW_AND_FULL = (torch.float32, torch.float16, torch.bfloat16)


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimInfo:
    """One optimizer as the generic tests, the doctor and the benchmarks see it; a row is built
    by keyword, its configs and error inputs by named functions (as torch's ``OptimizerInfo``
    with ``optim_inputs_func`` and ``optim_error_inputs_func``).

    Args:
        name: the class's name in :mod:`scaledoptim`.
        cls: the class.
        reference: the ``torch.optim`` class with the same options, math and state names, or
            ``None``: the optimizer's own torch form in float64 (see :meth:`reference_for`).
        configs_func: returns the option sets that, together, exercise every branch of the
            update (:attr:`configs`); the first is the row's default (what the protocol tests
            and the doctor run).
        error_inputs_func: returns the options the constructor must refuse
            (:attr:`error_inputs`).
        ranges: float options a property test may draw, as ``(low, high)``; a tuple option
            (``betas``) as a tuple of ranges.
        dtypes: the param dtypes it updates on our kernels.
        tolerance: of an fp32 step against the reference.
        mixed_param_dtypes: the param dtypes a test may mix in one launch (a float64 reference
            can hold a 16-bit param that nearly cancels its update to more than an ulp).
        needs_closure: ``step()`` evaluates a closure (LBFGS).
    """

    name: str
    cls: type[torch.optim.Optimizer]
    reference: type[torch.optim.Optimizer] | None
    configs_func: Callable[[], tuple[Config, ...]]
    error_inputs_func: Callable[[], tuple[ErrorInput, ...]] = no_error_inputs
    ranges: dict[str, Any] = dataclasses.field(default_factory=dict)
    dtypes: tuple[torch.dtype, ...] = LOW_AND_FULL
    tolerance: Tolerance = Tolerance()
    mixed_param_dtypes: tuple[torch.dtype, ...] = LOW_AND_FULL
    needs_closure: bool = False
    #: ``configs_func()``, called once.
    configs: tuple[Config, ...] = dataclasses.field(init=False)
    #: ``error_inputs_func()``, called once.
    error_inputs: tuple[ErrorInput, ...] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "configs", self.configs_func())
        object.__setattr__(self, "error_inputs", self.error_inputs_func())

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
        kernels = self.kernels
        return bool(kernels) and kernels[-1].lists[-3:-1] == ("master_params", "sr_seeds")

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


_ADAM_RANGES = {"lr": (1e-4, 1e-1), "betas": ((0.0, 0.99), (0.9, 0.9999)), "eps": (1e-10, 1e-3)}

optim_db: tuple[OptimInfo, ...] = (
    OptimInfo(
        name="AdamW",
        cls=AdamW,
        reference=torch.optim.AdamW,
        configs_func=configs_adamw,
        error_inputs_func=error_inputs_adam,
        ranges=_ADAM_RANGES,
    ),
    OptimInfo(
        name="Adam",
        cls=Adam,
        reference=torch.optim.Adam,
        configs_func=configs_adam,
        error_inputs_func=error_inputs_adam,
        ranges=_ADAM_RANGES,
    ),
    OptimInfo(
        name="SGD",
        cls=SGD,
        reference=torch.optim.SGD,
        configs_func=configs_sgd,
        error_inputs_func=error_inputs_sgd,
        ranges={"lr": (1e-4, 1.0)},
    ),
    OptimInfo(
        name="Adagrad",
        cls=Adagrad,
        reference=torch.optim.Adagrad,
        configs_func=configs_adagrad,
        error_inputs_func=error_inputs_adagrad,
        ranges={"lr": (1e-4, 1e-1), "eps": (1e-10, 1e-3)},
    ),
    OptimInfo(
        name="RMSprop",
        cls=RMSprop,
        reference=torch.optim.RMSprop,
        configs_func=configs_rmsprop,
        error_inputs_func=error_inputs_rmsprop,
        ranges={"lr": (1e-4, 1e-1), "alpha": (0.5, 0.999), "eps": (1e-10, 1e-3)},
        # torch's CPU sqrt of a float32 tensor is off by one ulp in ~17% of elements (our kernels'
        # sqrtf is correctly rounded, as CUDA's), and RMSprop divides by it: an ulp or two in
        # every update, amplified where a momentum buffer cancels or a grad is near zero.
        tolerance=Tolerance(
            param_rtol=1e-5, state_rtol=1e-5, state_atol=1e-5, trajectory_atol=1e-6
        ),
    ),
    OptimInfo(
        name="Lion",
        cls=Lion,
        reference=None,
        configs_func=configs_lion,
        error_inputs_func=error_inputs_lion,
        ranges={"lr": (1e-4, 1e-1), "betas": ((0.0, 0.99), (0.9, 0.999))},
    ),
    OptimInfo(
        name="LAMB",
        cls=LAMB,
        reference=None,
        configs_func=configs_lamb,
        error_inputs_func=error_inputs_lamb,
        ranges={"lr": (1e-4, 1e-1)},
        # The trust ratio divides norms summed in another order than float64's.
        tolerance=Tolerance(param_rtol=2e-6, param_atol=2e-6, state_rtol=1e-5),
        # Against a float64 reference, a 16-bit param that nearly cancels its update is off by
        # more than an ulp (the every-dtype tests hold them to one ulp at boundary sizes).
        mixed_param_dtypes=(torch.float32,),
    ),
    OptimInfo(
        name="LBFGS",
        cls=LBFGS,
        reference=torch.optim.LBFGS,
        configs_func=configs_lbfgs,
        error_inputs_func=error_inputs_lbfgs,
        needs_closure=True,
    ),
)


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
