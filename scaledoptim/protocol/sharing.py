"""Several optimizers sharing one dynamic loss scale (GANs, several models, several losses)."""

from __future__ import annotations

import torch

from ..scale import LossScale
from .optimizer import Optimizer
from .ownership import ScalingState

__all__ = ["share_scale"]


def share_scale(*optimizers: Optimizer) -> torch.Tensor:
    r"""Makes several optimizers share one dynamic loss scale; returns it.

    The shared scale continues the first optimizer's: its configuration, its current scale and
    its growth and hysteresis trackers. So a run resumes bit for bit when each optimizer loads
    its checkpoint first and ``share_scale`` is called after (the optimizers saved the same
    shared scale). Each optimizer still skips its own step when *its* grads overflow (as
    :class:`torch.amp.GradScaler` does); the scale moves once per iteration, after every
    optimizer has called :meth:`Optimizer.unscale` (or :meth:`Optimizer.unscale_and_step`),
    backing off if any of them found inf/nan.

    Example::

        >>> S = scaledoptim.share_scale(opt_g, opt_d)
        >>> scaledoptim.scale_outputs(loss_g + loss_d, S).backward()
        >>> for opt in (opt_g, opt_d):
        ...     _, found_inf, S = opt.unscale_and_step(grads_scaled_by=S)
    """
    if len(optimizers) < 2:
        raise ValueError("share_scale() needs at least two optimizers")
    for opt in optimizers:
        if not isinstance(opt, Optimizer):
            raise TypeError(
                f"{type(opt).__name__} has no loss-scaling protocol; wrap it with "
                "scaledoptim.patch_optimizer(opt) first"
            )
    devices = {opt._params_device() for opt in optimizers}
    if len(devices) > 1:
        raise RuntimeError(f"Optimizers sharing a scale must share a device, got {devices}")
    first = optimizers[0]._scaling().loss_scale
    shared = LossScale(first.config, devices.pop())
    for name in ("scale", "growth_tracker", "hysteresis_tracker"):  # on device: no host read
        getattr(shared, name).copy_(getattr(first, name))
    shared.sharers = len(optimizers)
    for opt in optimizers:
        process_group = opt._scaling().process_group
        opt._scaledoptim_scaling = ScalingState(shared, process_group=process_group)
    return shared.scale
