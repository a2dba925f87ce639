"""The optimizer table's inputs: :class:`Config` and :class:`ErrorInput`, the :func:`grid` and
:func:`sweep` that build configs, and one named function per optimizer for its configs and one
for its error inputs, as torch's ``optim_inputs_func_*`` and ``optim_error_inputs_func_*``
(``torch/testing/_internal/common_optimizers.py``). The rows that name them are in
``optim_db.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = [
    "Config", "ErrorInput", "configs_adagrad", "configs_adam", "configs_adamw", "configs_lamb",
    "configs_lbfgs", "configs_lion", "configs_rmsprop", "configs_sgd", "error_inputs_adagrad",
    "error_inputs_adam", "error_inputs_lamb", "error_inputs_lbfgs", "error_inputs_lion",
    "error_inputs_rmsprop", "error_inputs_sgd", "grid", "no_error_inputs", "sweep",
]


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


# ------------------------------------------------------------------------- the rows' configs
# One named function per optimizer, as torch's ``optim_inputs_func_*``: the row's default first.


def configs_adamw() -> tuple[Config, ...]:
    """AdamW's configs: decoupled weight decay, AMSGrad with ``maximize``, then the sweep."""
    return (
        Config("default", dict(lr=1e-2, weight_decay=0.1)),
        Config("amsgrad-maximize", dict(lr=1e-2, amsgrad=True, maximize=True)),
        *_adam_sweep(1e-2),
    )


def configs_adam() -> tuple[Config, ...]:
    """Adam's configs: L2 weight decay with AMSGrad and other betas, then the sweep."""
    return (
        Config(
            "amsgrad-betas-wd", dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, amsgrad=True)
        ),
        Config("wd", dict(lr=1e-2, weight_decay=0.1)),
        *_adam_sweep(1e-2),
    )


def configs_sgd() -> tuple[Config, ...]:
    """SGD's configs: momentum, Nesterov, dampening and ``maximize``, then the sweep."""
    swept = grid(
        lr=(0.05,),
        momentum=(0.0, 0.9),
        dampening=(0.0, 0.3),
        nesterov=(False, True),
        weight_decay=(0.0, 0.1),
        maximize=(False, True),
    )
    return (
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
                for config in swept
                # Dampening and Nesterov act through momentum; Nesterov with dampening is
                # refused (by torch.optim.SGD too).
                if not (config.kwargs["nesterov"] or config.kwargs["dampening"])
                or (
                    config.kwargs["momentum"]
                    and not (config.kwargs["nesterov"] and config.kwargs["dampening"])
                )
            ),
        ),
    )


def configs_adagrad() -> tuple[Config, ...]:
    """Adagrad's configs: ``lr_decay``, weight decay, every option at once, then the sweep."""
    return (
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
    )


def configs_rmsprop() -> tuple[Config, ...]:
    """RMSprop's configs: torch's own (its ``optim_db``), at a learning rate that moves params,
    then the sweep."""
    return (
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
    )


def configs_lion() -> tuple[Config, ...]:
    """Lion's configs: the default, weight decay with ``maximize`` and other betas, the sweep."""
    return (
        Config("default", dict(lr=1e-3)),
        Config("wd-maximize", dict(lr=1e-3, betas=(0.8, 0.95), weight_decay=0.5, maximize=True)),
        *sweep(*grid(lr=(1e-2,), maximize=(False, True), weight_decay=(0.0, 0.5))),
    )


def configs_lamb() -> tuple[Config, ...]:
    """LAMB's configs: NVLAMB with clipping, L2 without bias correction, then the trust ratio's
    edge cases."""
    return (
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
    )


def configs_lbfgs() -> tuple[Config, ...]:
    """LBFGS's configs: the default and the strong-Wolfe line search."""
    return (
        Config("default", dict(lr=1.0)),
        Config("strong-wolfe", dict(lr=1.0, line_search_fn="strong_wolfe")),
    )


# ------------------------------------------------------------------- the rows' error inputs
# One named function per optimizer, as torch's ``optim_error_inputs_func_*``.


def _negative_lr() -> ErrorInput:
    return ErrorInput("negative lr", dict(lr=-1.0), ValueError, "Invalid learning rate")


def error_inputs_adam() -> tuple[ErrorInput, ...]:
    """What Adam and AdamW refuse: torch's checks, and a tensor lr with ``foreach``."""
    return (
        _negative_lr(),
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


def error_inputs_sgd() -> tuple[ErrorInput, ...]:
    """What SGD refuses: negative options, and Nesterov without momentum or with dampening."""
    return (
        _negative_lr(),
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
    )


def error_inputs_adagrad() -> tuple[ErrorInput, ...]:
    """What Adagrad refuses: negative options."""
    return (
        _negative_lr(),
        ErrorInput("negative lr_decay", dict(lr_decay=-0.1), ValueError, "Invalid lr_decay"),
        ErrorInput(
            "negative initial_accumulator_value",
            dict(initial_accumulator_value=-0.1),
            ValueError,
            "Invalid initial_accumulator_value",
        ),
    )


def error_inputs_rmsprop() -> tuple[ErrorInput, ...]:
    """What RMSprop refuses: negative options."""
    return (
        _negative_lr(),
        ErrorInput("negative eps", dict(eps=-1.0), ValueError, "Invalid epsilon value"),
        ErrorInput("negative momentum", dict(momentum=-1.0), ValueError, "Invalid momentum"),
        ErrorInput(
            "negative weight_decay", dict(weight_decay=-1.0), ValueError, "Invalid weight_decay"
        ),
        ErrorInput("negative alpha", dict(alpha=-1.0), ValueError, "Invalid alpha value"),
    )


def error_inputs_lion() -> tuple[ErrorInput, ...]:
    """What Lion refuses: a negative lr, a beta of 1."""
    return (
        _negative_lr(),
        ErrorInput("beta2 of 1", dict(betas=(0.9, 1.0)), ValueError, "beta parameter at index 1"),
    )


def error_inputs_lamb() -> tuple[ErrorInput, ...]:
    """What LAMB refuses: a negative lr or eps."""
    return (
        _negative_lr(),
        ErrorInput("negative eps", dict(eps=-1.0), ValueError, "Invalid epsilon value"),
    )


def error_inputs_lbfgs() -> tuple[ErrorInput, ...]:
    """What LBFGS refuses: a negative lr."""
    return (_negative_lr(),)


def no_error_inputs() -> tuple[ErrorInput, ...]:
    """No options to refuse."""
    return ()
