"""The loss-scaling protocol for any torch optimizer; it never imports the fused engine.

* :class:`Optimizer`: ``unscale``, ``step_after_unscale``, ``unscale_and_step`` (closure replay
  included) on top of an ordinary ``step()``, and the optimizer's own loss scale, its
  configuration and checkpoints.
* :func:`scale_outputs`, :func:`backward`, :func:`grad`: scaling what backward starts from.
* :func:`share_scale`: one scale for several optimizers.
* :class:`GradScaler`: ``torch.amp.GradScaler``'s object, whose scale is the optimizers'.
* :func:`with_scaling`, :func:`patch_optimizer`, :data:`LBFGS`: the protocol for optimizers we
  did not write.
"""

from .gradscaler import GradScaler
from .optimizer import Optimizer
from .outputs import backward, grad, scale_outputs
from .replay import ClosureReplayError
from .sharing import share_scale
from .wrapping import LBFGS, patch_optimizer, with_scaling

__all__ = [
    "LBFGS",
    "ClosureReplayError",
    "GradScaler",
    "Optimizer",
    "backward",
    "grad",
    "patch_optimizer",
    "scale_outputs",
    "share_scale",
    "with_scaling",
]
