"""Validation of the grads a step will use; every check runs before anything changes."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["check_param_grads"]


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
