"""One row per optimizer: what every generic test, the doctor and the benchmarks run over.

Like torch's ``torch.testing._internal.common_optimizers.optim_db``: a generic test takes
:data:`optim_db` (or :func:`rows` of a property) and runs over every row, so adding an optimizer
is adding a row. Rows are chosen by name or property (:func:`row`, :func:`rows`), never by
position.

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
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

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
    adagrad,
    adam,
    lamb,
    lion,
    rmsprop,
    sgd,
)
from scaledoptim.protocol import LBFGS

__all__ = [
    "Config", "ErrorInput", "Functional", "OptimInfo", "Tolerance", "grid", "optim_db", "row",
    "rows", "sweep",
]  # fmt: skip

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


#: ``functional(group, lists, found_inf, inv_scale)``: an optimizer's public functional entry point
#: (``scaledoptim.optim.x.x_``) called on its kernel's tensor lists, in the kernel's order (the
#: stochastic-rounding seeds as the int32 tensors a caller passes), with ``group``'s options.
Functional = Callable[[dict[str, Any], list[list[Tensor]], Tensor | None, Tensor | None], None]


@dataclasses.dataclass(frozen=True)
class OptimInfo:
    """One optimizer as the generic tests, the doctor and the benchmarks see it.

    Args:
        name: the class's name in :mod:`scaledoptim`.
        cls: the class.
        reference: the ``torch.optim`` class with the same options, math and state names, or
            ``None``: the optimizer's own torch form in float64 (see :meth:`reference_for`).
        configs: option sets that, together, exercise every branch of the update; the first
            is the row's default (what the protocol tests and the doctor run).
        error_inputs: options the constructor must refuse.
        ranges: float options a property test may draw, as ``(low, high)``; a tuple option
            (``betas``) as a tuple of ranges.
        dtypes: the param dtypes it updates on our kernels.
        tolerance: of an fp32 step against the reference.
        mixed_param_dtypes: the param dtypes a test may mix in one launch (a float64 reference
            can hold a 16-bit param that nearly cancels its update to more than an ulp).
        needs_closure: ``step()`` evaluates a closure (LBFGS).
        functional: its public functional entry point (see :data:`Functional`), or ``None``.
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
    functional: Functional | None = None

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


def grid(
    name: Callable[[dict[str, Any]], str] | None = None, **choices: Iterable[Any]
) -> tuple[Config, ...]:
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
        configs.append(Config(name(kwargs) if name else "-".join(labels) or "base", kwargs))
    return tuple(configs)


def sweep(*configs: Config) -> tuple[Config, ...]:
    """``configs`` for the kernel-level tests only (see :class:`Config`)."""
    return tuple(dataclasses.replace(config, generic=False) for config in configs)


def _adam_sweep(lr: float) -> tuple[Config, ...]:
    return sweep(
        *grid(amsgrad=(False, True), maximize=(False, True), weight_decay=(0.0, 0.1), lr=(lr,))
    )


def _functional(
    entry: Callable[..., None], options: Callable[[dict[str, Any]], dict[str, Any]]
) -> Functional:
    """The :data:`Functional` of an entry point ``entry(params, grads, *state, steps, ...)``,
    whose lists are the kernel's (params, grads, state..., masters, seeds, steps)."""

    def call(
        group: dict[str, Any], lists: list[list[Tensor]], found_inf: Tensor | None,
        inv_scale: Tensor | None,
    ) -> None:  # fmt: skip
        *tensors, masters, seeds, steps = lists
        entry(*tensors, steps, found_inf=found_inf, inv_scale=inv_scale, master_params=masters,
              sr_seeds=seeds, **options(group))  # fmt: skip

    return call


def _lamb_functional(
    group: dict[str, Any], lists: list[list[Tensor]], found_inf: Tensor | None,
    inv_scale: Tensor | None,
) -> None:  # fmt: skip
    params, grads, exp_avgs, exp_avg_sqs, param_norms_sq, update_norms_sq, masters, seeds, steps = (
        lists
    )
    lamb.lamb_(params, grads, exp_avgs, exp_avg_sqs, steps, found_inf=found_inf,
               inv_scale=inv_scale, master_params=masters, sr_seeds=seeds,
               norms_sq=(param_norms_sq, update_norms_sq), **lamb._lamb_options(group))  # fmt: skip


_ADAM_ERRORS = (
    ErrorInput("negative lr", dict(lr=-1.0), ValueError, "Invalid learning rate"),
    ErrorInput("beta1 of 1", dict(betas=(1.0, 0.999)), ValueError, "beta parameter at index 0"),
    ErrorInput("negative eps", dict(eps=-1e-8), ValueError, "Invalid epsilon value"),
    ErrorInput(
        "negative weight_decay", dict(weight_decay=-0.1), ValueError, "Invalid weight_decay"
    ),
    ErrorInput(
        "tensor lr with foreach",
        dict(lr=torch.tensor(1e-3), foreach=True),
        ValueError,
        "lr as a Tensor is not supported",
    ),
)
_ADAM_RANGES = {"lr": (1e-4, 1e-1), "betas": ((0.0, 0.99), (0.9, 0.9999)), "eps": (1e-10, 1e-3)}

optim_db: tuple[OptimInfo, ...] = (
    OptimInfo(
        "AdamW",
        AdamW,
        torch.optim.AdamW,
        (
            Config("default", dict(lr=1e-2, weight_decay=0.1)),
            Config("amsgrad-maximize", dict(lr=1e-2, amsgrad=True, maximize=True)),
            *_adam_sweep(1e-2),
        ),
        _ADAM_ERRORS,
        _ADAM_RANGES,
        functional=_functional(adam.adam_, adam._adam_options),
    ),
    OptimInfo(
        "Adam",
        Adam,
        torch.optim.Adam,
        (
            Config(
                "amsgrad-betas-wd", dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, amsgrad=True)
            ),
            Config("wd", dict(lr=1e-2, weight_decay=0.1)),
            *_adam_sweep(1e-2),
        ),
        _ADAM_ERRORS,
        _ADAM_RANGES,
        functional=_functional(adam.adam_, adam._adam_options),
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
            *sweep(
                *(
                    config
                    for config in grid(
                        lr=(0.05,),
                        momentum=(0.0, 0.9),
                        dampening=(0.0, 0.3),
                        nesterov=(False, True),
                        weight_decay=(0.0, 0.1),
                        maximize=(False, True),
                    )
                    # Dampening and Nesterov act through momentum; Nesterov with dampening is
                    # refused (by torch.optim.SGD too).
                    if not (config.kwargs["nesterov"] or config.kwargs["dampening"])
                    or (
                        config.kwargs["momentum"]
                        and not (config.kwargs["nesterov"] and config.kwargs["dampening"])
                    )
                ),
            ),
        ),
        (
            ErrorInput("negative lr", dict(lr=-1.0), ValueError, "Invalid learning rate"),
            ErrorInput(
                "negative momentum", dict(lr=0.1, momentum=-0.5), ValueError, "Invalid momentum"
            ),
            ErrorInput(
                "nesterov without momentum", dict(lr=0.1, nesterov=True), ValueError, "Nesterov"
            ),
            ErrorInput(
                "nesterov with dampening",
                dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
                ValueError,
                "Nesterov",
            ),
        ),
        {"lr": (1e-4, 1.0)},
        functional=_functional(sgd.sgd_, sgd._sgd_options),
    ),
    OptimInfo(
        "Adagrad",
        Adagrad,
        torch.optim.Adagrad,
        (
            Config("lr_decay-wd", dict(lr=0.1, lr_decay=0.01, weight_decay=0.01)),
            Config("plain", dict(lr=0.1)),
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
            *sweep(
                *grid(
                    lr=(0.1,),
                    initial_accumulator_value=(0.1,),
                    maximize=(False, True),
                    weight_decay=(0.0, 0.1),
                    lr_decay=(0.0, 0.05),
                )
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
        functional=_functional(adagrad.adagrad_, adagrad._adagrad_options),
    ),
    OptimInfo(
        "RMSprop",
        RMSprop,
        torch.optim.RMSprop,
        (
            # torch's own RMSprop configs (its optim_db), at a learning rate that moves params.
            Config("default", dict(lr=1e-2)),
            Config("weight_decay", dict(lr=1e-2, weight_decay=0.1)),
            Config("maximize", dict(lr=1e-2, maximize=True)),
            Config("centered-wd", dict(lr=1e-2, weight_decay=0.1, centered=True)),
            Config("maximize-wd", dict(lr=1e-2, weight_decay=0.1, maximize=True)),
            Config(
                "momentum-centered-wd",
                dict(lr=1e-2, weight_decay=0.1, centered=True, momentum=0.1),
            ),
            Config(
                "every-option",
                dict(
                    lr=1e-2,
                    alpha=0.9,
                    eps=1e-6,
                    weight_decay=0.1,
                    centered=True,
                    momentum=0.1,
                    maximize=True,
                ),
            ),
            *sweep(
                *grid(
                    lr=(1e-2,),
                    momentum=(0.0, 0.9),
                    centered=(False, True),
                    maximize=(False, True),
                    weight_decay=(0.0, 0.1),
                )
            ),
        ),
        (
            ErrorInput("negative lr", dict(lr=-1.0), ValueError, "Invalid learning rate"),
            ErrorInput("negative eps", dict(eps=-1.0), ValueError, "Invalid epsilon value"),
            ErrorInput("negative momentum", dict(momentum=-1.0), ValueError, "Invalid momentum"),
            ErrorInput(
                "negative weight_decay", dict(weight_decay=-1.0), ValueError, "Invalid weight_decay"
            ),
            ErrorInput("negative alpha", dict(alpha=-1.0), ValueError, "Invalid alpha value"),
        ),
        {"lr": (1e-4, 1e-1), "alpha": (0.5, 0.999), "eps": (1e-10, 1e-3)},
        # torch's CPU sqrt of a float32 tensor is off by one ulp in ~17% of elements (our kernels'
        # sqrtf is correctly rounded, as CUDA's), and RMSprop divides by it: an ulp or two in
        # every update, amplified where a momentum buffer cancels or a grad is near zero.
        tolerance=Tolerance(
            param_rtol=1e-5, state_rtol=1e-5, state_atol=1e-5, trajectory_atol=1e-6
        ),
        functional=_functional(rmsprop.rmsprop_, rmsprop._rmsprop_options),
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
            *sweep(*grid(lr=(1e-2,), maximize=(False, True), weight_decay=(0.0, 0.5))),
        ),
        (
            ErrorInput("negative lr", dict(lr=-1.0), ValueError, "Invalid learning rate"),
            ErrorInput(
                "beta2 of 1", dict(betas=(0.9, 1.0)), ValueError, "beta parameter at index 1"
            ),
        ),
        {"lr": (1e-4, 1e-1), "betas": ((0.0, 0.99), (0.9, 0.999))},
        functional=_functional(lion.lion_, lion._lion_options),
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
            *sweep(
                Config("no-trust-ratio", dict(lr=1e-2, weight_decay=0.0)),
                Config(
                    "norm-below-the-clip",
                    dict(lr=1e-2, weight_decay=0.1, use_nvlamb=True, max_grad_norm=100.0),
                ),
            ),
        ),
        (
            ErrorInput("negative lr", dict(lr=-1.0), ValueError, "Invalid learning rate"),
            ErrorInput("negative eps", dict(eps=-1.0), ValueError, "Invalid epsilon value"),
        ),
        {"lr": (1e-4, 1e-1)},
        # The trust ratio divides norms summed in another order than float64's.
        tolerance=Tolerance(param_rtol=2e-6, param_atol=2e-6, state_rtol=1e-5),
        # Against a float64 reference, a 16-bit param that nearly cancels its update is off by
        # more than an ulp (the every-dtype tests hold them to one ulp at boundary sizes).
        mixed_param_dtypes=(torch.float32,),
        functional=_lamb_functional,
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
    *,
    fused: bool | None = None,
    reference: bool | None = None,
    closure: bool | None = None,
    rounding: bool | None = None,
    functional: bool | None = None,
) -> tuple[OptimInfo, ...]:
    """The rows with these properties (``None``: either): ``fused`` (our kernels),
    ``reference`` (a torch.optim reference), ``closure`` (``step()`` needs a closure),
    ``rounding`` (takes ``master_weights`` and ``stochastic_rounding``), ``functional`` (has a
    functional entry point)."""
    return tuple(
        info
        for info in optim_db
        if (fused is None or info.fused == fused)
        and (reference is None or (info.reference is not None) == reference)
        and (closure is None or info.needs_closure == closure)
        and (rounding is None or info.rounding == rounding)
        and (functional is None or (info.functional is not None) == functional)
    )
