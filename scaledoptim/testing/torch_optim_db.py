"""torch's own optimizer table, as scaledoptim's tests read it.

``torch.testing._internal.common_optimizers.optim_db`` ships in the torch wheel (importing it
needs ``expecttest``, in the ``test`` extra). Each of its rows holds, for one ``torch.optim``
class, the constructor configs torch's generic suite runs (``optim_inputs_func``, without the
``foreach``/``fused``/``differentiable`` flags, which the suite adds one at a time) and the inputs
the class must refuse (``optim_error_inputs_func``). :func:`configs` expands the flags as torch's
suite does, :func:`error_inputs` lists the refusals; tests run them against scaledoptim's drop-ins
and ``with_scaling`` classes side by side with torch's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch.testing._internal.common_optimizers import (
    ErrorOptimizerInput,
    OptimizerErrorEnum,
    OptimizerInfo,
    optim_db,
)

__all__ = ["OptimizerErrorEnum", "TorchConfig", "configs", "error_inputs", "rows"]


@dataclasses.dataclass(frozen=True)
class TorchConfig:
    """One constructor config of a row of torch's table (``desc`` names it as torch does, with
    ``" & flag"`` for an added flag)."""

    info: OptimizerInfo
    desc: str
    kwargs: dict[str, Any]

    def __str__(self) -> str:
        return f"{self.info.name}-{self.desc}"

    @property
    def torch_class(self) -> type[torch.optim.Optimizer]:
        return cast(type[torch.optim.Optimizer], self.info.optim_cls)  # torch annotates an instance

    @property
    def differentiable(self) -> bool:
        return bool(self.kwargs.get("differentiable"))

    @property
    def flagged(self) -> bool:
        """Whether a flag was added to torch's config."""
        return " & " in self.desc


def rows(names: Iterable[str] | None = None) -> list[OptimizerInfo]:
    """The rows of torch's table (those of the classes called ``names``)."""
    wanted = None if names is None else set(names)
    return [info for info in optim_db if wanted is None or info.name in wanted]


def configs(
    infos: Iterable[OptimizerInfo], dtype: torch.dtype | None = None, flags: bool = True
) -> list[TorchConfig]:
    """Every CPU config of ``infos`` (torch adjusts some to ``dtype``). With ``flags``, each also
    with every flag its row supports set alone, the others ``False``, as torch's suite expands
    them; ``foreach`` on the CPU too (torch's suite leaves it to accelerators), ``fused`` where
    the row has CPU kernels."""
    expanded = []
    for info in infos:
        supported = [
            flag
            for flag in info.supported_impls
            if flags and (flag != "fused" or "cpu" in info.supports_fused_on)
        ]
        for optim_input in info.optim_inputs_func(device="cpu", dtype=dtype):
            base = {**optim_input.kwargs, **dict.fromkeys(supported, False)}
            expanded.append(TorchConfig(info, optim_input.desc, base))
            for flag in supported:
                expanded.append(
                    TorchConfig(info, f"{optim_input.desc} & {flag}", {**base, flag: True})
                )
    return expanded


def error_inputs(
    infos: Iterable[OptimizerInfo], dtype: torch.dtype = torch.float32
) -> list[tuple[OptimizerInfo, ErrorOptimizerInput]]:
    """Every CPU error input of ``infos``: ``(info, error_input)``, where ``error_input`` has
    ``optimizer_error_input`` (params, kwargs, desc), ``error_on`` (construction or step),
    ``error_type`` (a warning category for a warning) and ``error_regex``."""
    return [
        (info, error_input)
        for info in infos
        for error_input in info.optim_error_inputs_func(device="cpu", dtype=dtype)
    ]
