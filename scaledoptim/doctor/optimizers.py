"""The fused optimizers the doctor checks: the fused rows of
:data:`scaledoptim.testing.optim_db.optim_db`, each with its default config.

To check a new optimizer, add its row to ``optim_db``: the doctor, the tests and the benchmarks
read the same table. A row's reference is ``torch.optim``'s class of the same math, or, where
torch has none, the optimizer's own torch form run in float64 (``row.reference_for``).
"""

from __future__ import annotations

from typing import Any

import scaledoptim

from ..testing.optim_db import OptimInfo, rows

__all__ = ["OPTIMIZERS", "ours"]

OPTIMIZERS: tuple[OptimInfo, ...] = tuple(rows(fused=True))


def ours(row: OptimInfo, params: Any) -> scaledoptim.Optimizer:
    """The scaledoptim optimizer of ``row`` over ``params``, in its default config: the class
    called ``row.name`` in :mod:`scaledoptim` when the check runs (so the class a user patched
    in is the one checked), else the row's."""
    cls = getattr(scaledoptim, row.name, row.cls)
    opt = cls(params, **row.default.kwargs)
    assert isinstance(opt, scaledoptim.Optimizer)
    return opt
