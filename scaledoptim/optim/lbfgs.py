"""LBFGS's declaration: the class is the protocol's (``scaledoptim.protocol``), a
``torch.optim.LBFGS`` with the loss-scaling protocol; this registers it with the tables and the
docs like every optimizer of the package (Note [an optimizer declared once] in spec.py)."""

from __future__ import annotations

import torch

from ..protocol import LBFGS
from .spec import Config, ErrorInput, OptimizerSpec

__all__ = ["LBFGS"]

OptimizerSpec(
    cls=LBFGS,
    summary="torch.optim.LBFGS, its closure replayed until the grads are finite",
    reference=torch.optim.LBFGS,
    configs=(
        Config("default", dict(lr=1.0)),
        Config("strong-wolfe", dict(lr=1.0, line_search_fn="strong_wolfe")),
    ),
    refusals=(ErrorInput("lr below 0", dict(lr=-1.0), ValueError, "Invalid learning rate"),),
    needs_closure=True,
)
