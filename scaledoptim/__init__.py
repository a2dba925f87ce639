"""scaledoptim: mixed-precision gradient scaling inside the PyTorch optimizer."""

from . import amp
from .amp import autocast
from .fused import FusedOptimizer
from .kernels import environment as _environment
from .optim import LAMB, SGD, Adagrad, Adam, AdamW, Lion, RMSprop
from .protocol import (
    LBFGS,
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
    "LAMB",
    "LBFGS",
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "ClosureReplayError",
    "FusedOptimizer",
    "GradScaler",
    "Lion",
    "Optimizer",
    "RMSprop",
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
