"""How a scaledoptim optimizer answers ``torch.amp.GradScaler.step()``: the step request it
reads from the attributes torch's scaler sets, and ``_step_supports_amp_scaling`` answered to that
caller alone (Note [torch GradScaler]). ``scaledoptim.GradScaler`` does not use it; the plain
``step()`` guard and the unscaling mixin do.
"""

from __future__ import annotations

import functools
import sys
import warnings
from types import CodeType

import torch

from .ownership import ScaleOwner
from .plans import StepRequest, native_amp_scaling
from .user_frames import user_stacklevel

__all__ = ["asked_by_torch_scaler", "torch_scaler_request"]


def torch_scaler_request(optimizer: ScaleOwner) -> StepRequest | None:
    """The step ``torch.amp.GradScaler.step()`` asks for by setting ``grad_scale`` and
    ``found_inf`` on the optimizer (Note [torch GradScaler]); ``None`` when the optimizer's
    own step reads them (torch's fused optimizers)."""
    attrs = vars(optimizer)
    if not optimizer._scaledoptim_warned_torch_scaler:
        optimizer._scaledoptim_warned_torch_scaler = True
        warnings.warn(
            f"A torch.amp.GradScaler steps this scaledoptim.{type(optimizer).__name__}: the scaler "
            "keeps a scale of its own, so opt.scale (and the 'loss_scale' saved in "
            "opt.state_dict()) is not the scale in use. The steps are right (they skip on "
            "the scaler's found_inf), but use scaledoptim.GradScaler, a drop-in with the "
            "same API whose scale is opt.scale, or the optimizer's own protocol "
            "(opt.unscale_and_step(grads_scaled_by=opt.scale)).",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    if native_amp_scaling(optimizer):
        return None  # torch's fused step reads grad_scale and found_inf itself
    grad_scale = attrs.get("grad_scale")
    return StepRequest(
        unscale=grad_scale is not None,
        scaled_by=grad_scale,
        found_inf=attrs["found_inf"],
        moves_scale=False,
    )


def asked_by_torch_scaler(optimizer: ScaleOwner) -> bool:
    """``optimizer._step_supports_amp_scaling`` as its reader gets it (Note [torch GradScaler]):
    true for torch's fused optimizers, and for a scaledoptim one only when
    ``torch.amp.GradScaler.step`` asks. Call it from that property alone: it reads the frame
    that read the property."""
    if native_amp_scaling(optimizer):
        return True
    # Frame 0 is this function, 1 the property, 2 whoever read it.
    return sys._getframe(2).f_code in _torch_scaler_steps()


@functools.cache
def _torch_scaler_steps() -> frozenset[CodeType]:
    """The code of ``torch.amp.GradScaler.step`` (and subclasses' own ``step``) that asks
    ``_step_supports_amp_scaling`` before stepping.

    Note [torch GradScaler]
    ~~~~~~~~~~~~~~~~~~~~~~~
    ``torch.amp.GradScaler.step(opt)`` asks ``opt._step_supports_amp_scaling``; when it is true
    it sets ``opt.grad_scale`` (``None`` after ``unscale_``) and ``opt.found_inf`` (on device)
    and calls ``opt.step()``, which must unscale and skip itself. scaledoptim's optimizers answer
    true to that call alone: their step then honours both on device (sync-free on the fused
    ones) and warns once that ``opt.scale`` is not the scale in use. Anyone else asking (Lightning
    decides from it that the optimizer "unscales internally" and refuses gradient clipping) gets
    false, which is what a scaledoptim optimizer's plain ``step()`` is. torch's own fused
    optimizers set the flag on the instance; they answer true to everyone, as in torch.
    """
    codes = {torch.amp.GradScaler.step.__code__}
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    except ImportError:  # torch built without distributed
        pass
    else:
        if "step" in vars(ShardedGradScaler):
            codes.add(ShardedGradScaler.step.__code__)
    return frozenset(codes)
