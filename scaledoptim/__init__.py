"""scaledoptim: mixed-precision gradient scaling inside the PyTorch optimizer."""

from . import amp
from .amp import autocast
from .fused import FusedOptimizer
from .kernels import environment as _environment
from .optim import *  # noqa: F403  (every registered optimizer: optim/__init__.py)
from .optim.spec import registered as _registered
from .protocol import (
    ClosureReplayError,
    GradScaler,
    Optimizer,
    backward,
    grad,
    patch_optimizer,
    scale_outputs,
    share_scale,
    with_scaling,
)
from .scale import ScalingConfig

_environment.warn_unknown_variables()  # a misspelt SCALEDOPTIM_* variable would do nothing

__version__ = "0.1.0.dev0"

__all__ = [
    *(spec.name for spec in _registered()),
    "ClosureReplayError",
    "FusedOptimizer",
    "GradScaler",
    "Optimizer",
    "ScalingConfig",
    "amp",
    "autocast",
    "backward",
    "grad",
    "patch_optimizer",
    "scale_outputs",
    "share_scale",
    "with_scaling",
]
