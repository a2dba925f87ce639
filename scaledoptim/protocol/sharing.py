"""Several optimizers sharing one dynamic loss scale (GANs, several models, several losses)."""

from __future__ import annotations

import torch

from ..scale import LossScale
from .optimizer import Optimizer
from .scaling import ScalingState

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

    The shared scale is the first optimizer's scale *tensor*: ``opt.scale`` of every sharer
    returns it, and a handle to the first's scale taken before stays live. The other
    optimizers' old scale tensors are no longer in use; passing one is refused with an error
    that names this tensor.

    Calling it again with the same optimizers returns the same scale. An optimizer is shared
    once: one that already shares with others, or one given twice, is refused.

    Example::

        >>> S = scaledoptim.share_scale(opt_g, opt_d)
        >>> scaledoptim.scale_outputs(loss_g + loss_d, S).backward()
        >>> for opt in (opt_g, opt_d):
        ...     _, found_inf, S = opt.unscale_and_step(grads_scaled_by=S)

    Raises:
        ValueError: fewer than two optimizers, or one given more than once.
        TypeError: an optimizer without the loss-scaling protocol.
        RuntimeError: optimizers on different devices; an optimizer that already shares a scale
            with others, is stepped by a :class:`scaledoptim.GradScaler` or has a pending
            :meth:`Optimizer.unscale`.
    """
    if len(optimizers) < 2:
        raise ValueError("share_scale() needs at least two optimizers")
    for opt in optimizers:
        if not isinstance(opt, Optimizer):
            raise TypeError(
                f"{type(opt).__name__} has no loss-scaling protocol; wrap it with "
                "scaledoptim.patch_optimizer(opt) first"
            )
    if len({id(opt) for opt in optimizers}) < len(optimizers):
        raise ValueError(
            "share_scale() was given the same optimizer more than once; pass each optimizer "
            "that should share the scale exactly once"
        )
    states = [opt.scaling_state for opt in optimizers]
    first = states[0].loss_scale
    if all(state.loss_scale is first for state in states) and first.sharers == len(optimizers):
        return first.scale  # these optimizers already share exactly this scale
    for opt, state in zip(optimizers, states):
        if state.loss_scale.sharers > 1:
            raise RuntimeError(
                f"{type(opt).__name__} already shares a scale with "
                f"{state.loss_scale.sharers - 1} other optimizer(s): an optimizer is shared once. "
                "Call share_scale() once, with every optimizer that should share the scale."
            )
        if state.driver is not None:
            raise RuntimeError(
                f"{type(opt).__name__} is stepped by a {state.driver}, which owns its scale and "
                "shares it with every optimizer it steps: share_scale() is not needed"
            )
        if state.unscaled:
            raise RuntimeError(
                "share_scale() between unscale() and the step: call step_after_unscale() (or "
                "zero_grad()) first"
            )
    devices = {opt._params_device() for opt in optimizers}
    if len(devices) > 1:
        raise RuntimeError(f"Optimizers sharing a scale must share a device, got {devices}")
    device = devices.pop()
    if first.device != device:  # the params moved since the first's scale was made
        moved = LossScale(first.config, device)
        moved.growth_tracker.copy_(first.growth_tracker)
        moved.hysteresis_tracker.copy_(first.hysteresis_tracker)
        moved.scale.copy_(first.scale)
        first.retire(_RETIRED.format(name=type(optimizers[0]).__name__))
        first = moved
    first.sharers = len(optimizers)
    for opt, state in zip(optimizers, states):
        if state.loss_scale is not first:
            state.loss_scale.retire(_RETIRED.format(name=type(opt).__name__))
        opt._scaledoptim_scaling = ScalingState(
            first,
            process_group=state.process_group,
            grads_across_ranks=state.grads_across_ranks,
        )
    return first.scale


_RETIRED = (
    "This is the scale {name} had before scaledoptim.share_scale() gave it a shared scale: pass "
    "the tensor share_scale() returned (every sharer's opt.scale is that tensor now)"
)
