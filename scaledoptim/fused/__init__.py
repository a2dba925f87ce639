"""The engine of the fused optimizers; it never imports ``scaledoptim.optim``.

* :class:`FusedOptimizer`: the base class; a subclass implements :class:`Update`.
* ``plan.py``: a step's plan (validated before anything changes); ``cache.py``: its cache.
* ``state.py``, ``rounding.py``: per-param state and the param rounding options.
* ``backends/``: what runs an update (our kernels, or torch's ops); ``select`` picks one.
"""

from .optimizer import (
    FusedOptimizer,
    check_hyperparameter,
    check_tensor_hyperparameter,
    hyperparameter,
)
from .update import GradReduction, Group, TensorLists, Update

__all__ = [
    "FusedOptimizer",
    "GradReduction",
    "Group",
    "TensorLists",
    "Update",
    "check_hyperparameter",
    "check_tensor_hyperparameter",
    "hyperparameter",
]
