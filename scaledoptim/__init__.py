"""scaledoptim: mixed-precision gradient scaling inside the PyTorch optimizer."""

from . import amp
from .amp import autocast
from .optim import SGD, Adam, AdamW
from .optimizer import ClosureReplayError, Optimizer, share_scale
from .outputs import backward, grad, scale_outputs
from .scaling import ScalingConfig
from .wrapping import LBFGS, patch_optimizer, with_scaling

__version__ = "0.1.0.dev0"

__all__ = [
    "amp",
    "autocast",
    "Optimizer",
    "Adam",
    "AdamW",
    "SGD",
    "LBFGS",
    "with_scaling",
    "patch_optimizer",
    "share_scale",
    "scale_outputs",
    "backward",
    "grad",
    "ScalingConfig",
    "ClosureReplayError",
]
