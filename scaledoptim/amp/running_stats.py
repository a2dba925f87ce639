"""Running statistics: arguments an op writes although its schema does not say so.

Note [running statistics]
~~~~~~~~~~~~~~~~~~~~~~~~~
``aten::batch_norm`` (and ``native_batch_norm``,
``instance_norm``, ``_batch_norm_impl_index``, ``cudnn_batch_norm``, ...) update
``running_mean`` and ``running_var`` in place, but their schemas declare those arguments
``Tensor?``, not ``Tensor(a!)``, so ``set_policy`` cannot refuse them as mutating. Casting
such an argument would hand the op a temporary copy and the update would be lost. So
arguments named ``running_mean``/``running_var`` are never cast, and, because the norm
kernels need their parameters to share one dtype (float32 parameters with a low precision
input is the supported mixed case), ``weight`` and ``bias`` of such an op follow the
running statistics' dtype instead of the policy's. The input is cast per the policy.
The statistics then update exactly as when the op runs without autocast on the same input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload

RUNNING_STATS = ("running_mean", "running_var")
_FOLLOWERS = ("weight", "bias")


class RunningStats:
    """The running statistics arguments of one op and the parameters that follow them."""

    __slots__ = ("followers", "names", "stats")

    def __init__(self, op: OpOverload) -> None:
        self.names = [argument.name for argument in op._schema.arguments]
        self.stats = [name for name in RUNNING_STATS if name in self.names]
        self.followers = [name for name in _FOLLOWERS if name in self.names]

    @staticmethod
    def of(op: OpOverload) -> RunningStats | None:
        """Return the layout of ``op``'s running statistics, or ``None`` when it has none."""
        layout = RunningStats(op)
        return layout if layout.stats else None

    def _stats_dtype(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype | None:
        for name in self.stats:
            index = self.names.index(name)
            value = args[index] if index < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor):
                return value.dtype
        return None

    def cast(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        cast_value: Callable[[Any], Any],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Cast ``args``/``kwargs`` with ``cast_value``, leaving the statistics alone."""
        stats_dtype = self._stats_dtype(args, kwargs)

        def one(name: str, value: Any) -> Any:
            if name in self.stats:
                return value
            if stats_dtype is not None and name in self.followers:
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    return value.to(stats_dtype)
                return value
            return cast_value(value)

        return (
            tuple([one(self.names[index], arg) for index, arg in enumerate(args)]),
            {name: one(name, arg) for name, arg in kwargs.items()},
        )

    def without_stats(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Return the arguments other than the running statistics (what ``promote`` weighs)."""
        named = [*zip(self.names, args), *kwargs.items()]
        return [value for name, value in named if name not in self.stats]
