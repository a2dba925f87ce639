"""Validation of the grads a step will use; every check runs before anything changes."""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter

import torch

__all__ = ["check_no_fp16_grads", "check_param_grads"]

_DTYPE = attrgetter("dtype")


def check_param_grads(params: Iterable[torch.Tensor], device: torch.device) -> None:
    """Rejects, before anything is modified, grads that are not floating (or complex, for a
    complex param), off ``device``, or not shaped like their param. Sparse grads pass: torch's
    optimizers that take them (SGD, Adagrad, SparseAdam) get them unscaled through their values.
    One pass: it runs on every step."""
    for param in params:
        grad = param.grad
        assert grad is not None  # the caller passes the params that have a grad
        if not (grad.is_floating_point() or (grad.is_complex() and param.is_complex())):
            raise TypeError(
                f"A grad has dtype {grad.dtype} and its param {param.dtype}; grads must be "
                "floating point (complex for a complex param). Assign p.grad a floating tensor "
                "of its param's dtype (autograd always produces one)."
            )
        if grad.device != device:
            raise RuntimeError(
                f"A grad is on {grad.device} but the loss scale is on {device}; an optimizer's "
                "params must all live on one device: use one optimizer per device"
            )
        if grad.shape != param.shape:
            raise ValueError(
                f"A grad has shape {tuple(grad.shape)} but its param has shape "
                f"{tuple(param.shape)}; a grad assigned through .data bypassed autograd's check. "
                "Assign p.grad a tensor shaped like p."
            )


def check_no_fp16_grads(
    grads: list[torch.Tensor], method: str, generic: str | None
) -> None:
    """Refuses scaled fp16 grads that ``method`` would unscale in place, in fp16, as
    torch.amp.GradScaler refuses them ("Attempting to unscale FP16 gradients"): unscaled in
    fp16, a small true grad flushes to zero (below 6e-8) unnoticed, and clipping them drifts
    from fp32. ``unscale()`` and ``GradScaler.unscale_()`` would, for every optimizer; so would
    every scaled step of ``generic``, the name of an optimizer whose own ``step()`` reads the
    grads as they are (a ``with_scaling`` class, a patched instance, a generic subclass;
    ``None``: a fused one, which unscales fp16 grads in fp32 inside its update). The message
    names the fix that fits."""
    # map() over an attrgetter: no Python frame per grad on a path that runs every step.
    if torch.float16 not in map(_DTYPE, grads):
        return
    why = (
        "(torch.amp.GradScaler refuses them too: \"Attempting to unscale FP16 gradients\"): "
        "an fp16 grad cannot hold small values (below 6e-8 they flush to zero, unnoticed), and "
        "clipping them drifts from fp32."
    )
    if generic is None:
        raise ValueError(
            f"{method} was given fp16 grads to unscale in place {why} Use "
            "opt.unscale_and_step(grads_scaled_by=S), which unscales in fp32 inside the update, "
            "and to clip, opt.unscale_and_step(grads_scaled_by=S, max_grad_norm=c), which clips "
            "in fp32 there too; or keep fp32 params under autocast so that grads are fp32."
        )
    raise ValueError(
        f"{generic}'s step() reads the grads as they are, so {method} would leave scaled fp16 "
        f"grads unscaled in place in fp16 {why} Use a fused scaledoptim optimizer "
        "(scaledoptim.Adam, AdamW, SGD, Adagrad, RMSprop, Lion, LAMB), which unscales fp16 "
        "grads in fp32 inside its update, with master_weights=True to keep fp32 master weights "
        "of fp16 params; or keep fp32 params under autocast, so that grads are fp32."
    )
