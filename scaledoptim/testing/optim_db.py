"""One row per optimizer: what every generic test, the doctor and the benchmarks run over.

Like torch's ``torch.testing._internal.common_optimizers.optim_db``: a generic test takes
:data:`optim_db` (or :func:`rows` of a property) and runs over every row, so adding an optimizer
is adding a row. Rows are chosen by name or property (:func:`row`, :func:`rows`), never by
position.

Each row names its reference: the ``torch.optim`` class of the same math, or ``None`` when torch
has none (Lion, LAMB); then the reference is the optimizer's own torch form run in float64
(:meth:`OptimInfo.reference_for`), so the math is written once, in the optimizer's file.

This module needs only torch and scaledoptim: tests build their strategies from the plain
ranges it gives.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from scaledoptim.fused import FusedOptimizer
from scaledoptim.kernels import MultiTensorKernel
from scaledoptim.optim import LAMB, SGD, Adagrad, Adam, AdamW, Lion
from scaledoptim.protocol import LBFGS

__all__ = ["Config", "ErrorInput", "OptimInfo", "Tolerance", "grid", "optim_db", "row", "rows"]

#: The param dtypes of mixed-precision training; the fused kernels take each of them.
LOW_AND_FULL = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Config:
    """Constructor options that exercise a branch of an optimizer's update."""

    name: str
    kwargs: dict[str, Any]

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
    """Of an fp32 step against the fp32 reference (16-bit params are held to one ulp)."""

    param_rtol: float = 1e-6
    param_atol: float = 1e-6
    state_rtol: float = 1e-6
    state_atol: float = 1e-7


@dataclasses.dataclass(frozen=True)
class OptimInfo:
    """One optimizer as the generic tests, the doctor and the benchmarks see it.

    Args:
        name: the class's name in :mod:`scaledoptim`.
        cls: the class.
        reference: the ``torch.optim`` class with the same options, math and state names, or
            ``None``: the optimizer's own torch form in float64 (see :meth:`reference_for`).
        configs: option sets that, together, exercise every branch of the update; the first
            is the row's default for tests that need one.
        error_inputs: options the constructor must refuse.
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
    configs: tuple[Config, ...]
    error_inputs: tuple[ErrorInput, ...] = ()
    ranges: dict[str, Any] = dataclasses.field(default_factory=dict)
    dtypes: tuple[torch.dtype, ...] = LOW_AND_FULL
    tolerance: Tolerance = Tolerance()
    mixed_param_dtypes: tuple[torch.dtype, ...] = LOW_AND_FULL
    needs_closure: bool = False

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
    def default(self) -> Config:
        return self.configs[0]

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


def grid(
    name: Callable[[dict[str, Any]], str] | None = None, **choices: Iterable[Any]
) -> tuple[Config, ...]:
    """A :class:`Config` for every combination of ``choices``, named after its values."""
    configs = []
    for values in itertools.product(*choices.values()):
        kwargs = dict(zip(choices, values))
        label = name(kwargs) if name else "-".join(f"{k}={v}" for k, v in kwargs.items())
        configs.append(Config(label, kwargs))
    return tuple(configs)


def _adam_configs(lr: float) -> tuple[Config, ...]:
    return (
        *grid(amsgrad=(False, True), maximize=(False, True), weight_decay=(0.0, 0.1), lr=(lr,)),
        Config("betas-0.8-0.99", dict(lr=lr, betas=(0.8, 0.99))),
    )


_ADAM_ERRORS = (
    ErrorInput("negative lr", dict(lr=-1.0), ValueError, "Invalid learning rate"),
    ErrorInput("beta1 of 1", dict(betas=(1.0, 0.999)), ValueError, "beta parameter at index 0"),
    ErrorInput("negative eps", dict(eps=-1e-8), ValueError, "Invalid epsilon value"),
    ErrorInput(
        "negative weight_decay", dict(weight_decay=-0.1), ValueError, "Invalid weight_decay"
    ),
)
_ADAM_RANGES = {"lr": (1e-4, 1e-1), "betas": ((0.0, 0.99), (0.9, 0.9999)), "eps": (1e-10, 1e-3)}

optim_db: tuple[OptimInfo, ...] = (
    OptimInfo(
        "AdamW",
        AdamW,
        torch.optim.AdamW,
        (Config("default", dict(lr=1e-2, weight_decay=0.1)), *_adam_configs(1e-2)),
        _ADAM_ERRORS,
        _ADAM_RANGES,
    ),
    OptimInfo(
        "Adam",
        Adam,
        torch.optim.Adam,
        (Config("default", dict(lr=1e-2, weight_decay=0.1)), *_adam_configs(1e-2)),
        _ADAM_ERRORS,
        _ADAM_RANGES,
    ),
    OptimInfo(
        "SGD",
        SGD,
        torch.optim.SGD,
        (
            Config(
                "momentum-nesterov-wd",
                dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True),
            ),
            Config("plain", dict(lr=0.05)),
            Config("momentum-wd", dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
            Config(
                "dampening-maximize",
                dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01, maximize=True),
            ),
            Config("nesterov-maximize", dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True)),
        ),
        (
            ErrorInput("negative lr", dict(lr=-1.0), ValueError, "Invalid learning rate"),
            ErrorInput(
                "negative momentum", dict(lr=0.1, momentum=-0.5), ValueError, "Invalid momentum"
            ),
            ErrorInput(
                "nesterov without momentum", dict(lr=0.1, nesterov=True), ValueError, "Nesterov"
            ),
        ),
        {"lr": (1e-4, 1.0)},
    ),
    OptimInfo(
        "Adagrad",
        Adagrad,
        torch.optim.Adagrad,
        (
            Config("lr_decay-wd", dict(lr=0.1, lr_decay=0.01, weight_decay=0.01)),
            Config("default", dict(lr=0.1)),
            Config(
                "every-option",
                dict(
                    lr=0.1,
                    lr_decay=0.05,
                    weight_decay=0.1,
                    initial_accumulator_value=0.2,
                    eps=1e-3,
                    maximize=True,
                ),
            ),
        ),
        (
            ErrorInput("negative lr", dict(lr=-1.0), ValueError, "Invalid learning rate"),
            ErrorInput("negative lr_decay", dict(lr_decay=-0.1), ValueError, "Invalid lr_decay"),
            ErrorInput(
                "negative initial_accumulator_value",
                dict(initial_accumulator_value=-0.1),
                ValueError,
                "Invalid initial_accumulator_value",
            ),
        ),
        {"lr": (1e-4, 1e-1), "eps": (1e-10, 1e-3)},
    ),
    OptimInfo(
        "Lion",
        Lion,
        None,
        (
            Config("default", dict(lr=1e-3)),
            Config(
                "wd-maximize", dict(lr=1e-3, betas=(0.8, 0.95), weight_decay=0.5, maximize=True)
            ),
        ),
        (
            ErrorInput("negative lr", dict(lr=-1.0), ValueError, "Invalid learning rate"),
            ErrorInput(
                "beta2 of 1", dict(betas=(0.9, 1.0)), ValueError, "beta parameter at index 1"
            ),
        ),
        {"lr": (1e-4, 1e-1), "betas": ((0.0, 0.99), (0.9, 0.999))},
    ),
    OptimInfo(
        "LAMB",
        LAMB,
        None,
        (
            Config("default", dict(lr=1e-2)),
            Config(
                "nvlamb-l2-no-averaging",
                dict(
                    lr=1e-2,
                    weight_decay=0.0,
                    use_nvlamb=True,
                    grad_averaging=False,
                    max_grad_norm=0.5,
                ),
            ),
            Config(
                "l2-no-clip-no-bias-correction",
                dict(
                    lr=1e-2,
                    weight_decay=0.1,
                    adam_w_mode=False,
                    max_grad_norm=0.0,
                    bias_correction=False,
                ),
            ),
            Config("no-trust-ratio", dict(lr=1e-2, weight_decay=0.0)),
            Config(
                "norm-below-the-clip",
                dict(lr=1e-2, weight_decay=0.1, use_nvlamb=True, max_grad_norm=100.0),
            ),
        ),
        (
            ErrorInput("negative lr", dict(lr=-1.0), ValueError, "Invalid learning rate"),
            ErrorInput("negative eps", dict(eps=-1.0), ValueError, "Invalid epsilon value"),
        ),
        {"lr": (1e-4, 1e-1)},
        # The trust ratio divides norms summed in another order than float64's.
        tolerance=Tolerance(param_rtol=2e-6, param_atol=2e-6, state_rtol=1e-5),
        mixed_param_dtypes=(torch.float32,),
    ),
    OptimInfo(
        "LBFGS",
        LBFGS,
        torch.optim.LBFGS,
        (
            Config("default", dict(lr=1.0)),
            Config("strong-wolfe", dict(lr=1.0, line_search_fn="strong_wolfe")),
        ),
        (ErrorInput("negative lr", dict(lr=-1.0), ValueError, "Invalid learning rate"),),
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
    *, fused: bool | None = None, reference: bool | None = None, closure: bool | None = None
) -> tuple[OptimInfo, ...]:
    """The rows with these properties (``None``: either): ``fused`` (our kernels),
    ``reference`` (a torch.optim reference), ``closure`` (``step()`` needs a closure)."""
    return tuple(
        info
        for info in optim_db
        if (fused is None or info.fused == fused)
        and (reference is None or (info.reference is not None) == reference)
        and (closure is None or info.needs_closure == closure)
    )
