"""The engine of the fused optimizers; it never imports ``scaledoptim.optim``.

* :class:`FusedOptimizer`: the base class; a subclass implements :class:`Update`.
* ``planning.py``: a step planned in full (validated before anything changes); ``plan.py``: what
  it runs, kept for the next step.
* ``state.py``, ``rounding.py``: per-param state and the param rounding options.
* ``backends/``: what runs an update (our kernels, or torch's ops); ``select`` picks one.
"""

from .optimizer import FusedOptimizer
from .options import check_hyperparameter, check_tensor_hyperparameter
from .plan import hyperparameter
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
