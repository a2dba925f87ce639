"""Validation of the grads a step will use; every check runs before anything changes."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["check_param_grads"]


def check_param_grads(params: Iterable[torch.Tensor], device: torch.device) -> None:
    """Rejects, before anything is modified, grads that are not floating, sparse, off
    ``device``, or not shaped like their param. One pass: it runs on every step."""
    for param in params:
        grad = param.grad
        assert grad is not None  # the caller passes the params that have a grad
        if grad.is_complex() or param.is_complex():
            raise TypeError(
                f"A param or grad has dtype {grad.dtype}: scaledoptim does not support complex "
                "params. Keep them as real pairs (torch.view_as_real) or give them an optimizer "
                "of their own without scaling"
            )
        if not grad.is_floating_point():
            raise TypeError(
                f"A grad has dtype {grad.dtype}; grads must be floating point. Assign p.grad a "
                "floating tensor (autograd always produces one)."
            )
        if grad.is_sparse:
            raise RuntimeError(
                "scaledoptim does not support sparse gradients; use a dense layer (e.g. "
                "nn.Embedding(sparse=False)) or a torch.optim sparse optimizer without scaling"
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
