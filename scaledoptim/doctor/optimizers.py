"""The fused optimizers the doctor checks: the fused rows of
:data:`scaledoptim.testing.optim_db.optim_db`, each with its default config.

To check a new optimizer, add its row to ``optim_db``: the doctor, the tests and the benchmarks
read the same table. A row's reference is ``torch.optim``'s class of the same math, or, where
torch has none, the optimizer's own torch form run in float64.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import scaledoptim

from ..testing.optim_db import OptimInfo, rows

__all__ = ["OPTIMIZERS", "OptimizerRow"]


@dataclasses.dataclass(frozen=True)
class OptimizerRow:
    """A fused row of optim_db as the doctor checks it.

    Args:
        info: the row; the doctor runs its default config.
    """

    info: OptimInfo

    @property
    def name(self) -> str:
        """The class's name in :mod:`scaledoptim`."""
        return self.info.name

    @property
    def reference(self) -> type[torch.optim.Optimizer] | None:
        """``torch.optim``'s class, or ``None``: the optimizer's own torch form in float64."""
        return self.info.reference

    @property
    def reference_dtype(self) -> torch.dtype | None:
        """The dtype the reference's params must have (``None``: any)."""
        return self.info.reference_dtype

    def ours(self, params: Any) -> scaledoptim.Optimizer:
        """A scaledoptim optimizer over ``params``: the class called :attr:`name` in
        :mod:`scaledoptim` when the check runs (so the class a user patched in is the one
        checked), else the row's."""
        cls = getattr(scaledoptim, self.name, self.info.cls)
        opt = cls(params, **self.info.default.kwargs)
        assert isinstance(opt, scaledoptim.Optimizer)
        return opt

    def theirs(self, params: Any) -> torch.optim.Optimizer:
        """The reference over ``params`` (float64 params when :attr:`reference` is ``None``)."""
        return self.info.reference_for(params)


OPTIMIZERS: tuple[OptimizerRow, ...] = tuple(OptimizerRow(info) for info in rows(fused=True))
