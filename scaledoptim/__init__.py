"""scaledoptim: mixed-precision gradient scaling inside the PyTorch optimizer."""

from . import amp
from .amp import autocast
from .optim import LAMB, SGD, Adagrad, Adam, AdamW, FusedOptimizer, Lion
from .optimizer import Optimizer
from .replay import ClosureReplayError
from .outputs import backward, grad, scale_outputs
from .scale_config import ScalingConfig
from .sharing import share_scale
from .wrapping import LBFGS, patch_optimizer, with_scaling

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
    "Lion",
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
