"""LAMB's in-place torch form on a CPU (Note [host skip]): the same math as the sync-free form,
in fewer passes over the data."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..torch_ops import BATCH, PackedSteps, batches, scalars, storage_flat


def _lamb_in_place_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    grad_norm_sq: Tensor,
    o: dict[str, Any],
) -> None:
    """The update on a CPU, in place and in fewer passes than the sync-free form, with its math
    (Note [host skip]): the clipping folded into the moments' coefficients (read on the host);
    the bias-corrected direction ``(m / bc1) / (sqrt(v / bc2) + eps)`` as
    ``k * m / (sqrt(v) + eps * sqrt(bc2))`` with ``k = sqrt(bc2) / bc1``, where ``k`` (and so
    the weight decay's ``wd / k``) cancels out of the trust ratio. Tensors are updated by batches
    of about ``BATCH`` elements with one temporary list (the direction) each; a larger tensor by
    pieces of that size (:func:`_lamb_large_`): its data passes through the cache once or twice
    instead of a dozen times."""
    c = _InPlaceCoefficients(params, steps, grad_norm_sq, o)
    for run in batches(params):
        p, g, m, v = params[run], grads[run], exp_avgs[run], exp_avg_sqs[run]
        if len(p) > 1 or p[0].numel() <= BATCH:
            _lamb_moments_(p, g, m, v, c)
            u = _lamb_direction(p, m, v, c, run)
            factors = c.step_sizes[run]
            if c.trust_ratio:
                p_norms = torch.stack(torch._foreach_norm(p))
                u_norms = torch.stack(torch._foreach_norm(u))
                factors = c.trust_ratio_factors(p_norms, u_norms, factors)
            torch._foreach_addcmul_(p, u, list(factors.unbind()))
        else:
            _lamb_large_(p[0], g[0], m[0], v[0], c, run)


#: The largest tensor whose whole direction the in-place form keeps while it computes its norm
#: (8 MB in float32); a larger one computes it again, piece by piece (a second sqrt pass costs
#: less than writing and reading back a direction out of the cache).
KEPT_DIRECTION = 1 << 21


def _lamb_large_(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, c: _InPlaceCoefficients, run: slice
) -> None:
    """One tensor of more than ``BATCH`` elements, by pieces of ``BATCH``: each piece's moments
    and direction while it is in the cache. With the trust ratio, which needs the norm of the
    whole direction, the pieces' directions are kept (up to :data:`KEPT_DIRECTION` elements) or
    computed again once the norm is known (the kernels' way)."""
    pieces = list(zip(*(storage_flat(t).split(BATCH) for t in (p, g, m, v))))
    factor = c.step_sizes[run]
    kept: list[Tensor] = []
    squares = torch.zeros(2, dtype=torch.float64)
    for piece_p, piece_g, piece_m, piece_v in pieces:
        _lamb_moments_([piece_p], [piece_g], [piece_m], [piece_v], c)
        (piece_u,) = _lamb_direction([piece_p], [piece_m], [piece_v], c, run)
        if not c.trust_ratio:
            piece_p.addcmul_(piece_u, factor[0])
            continue
        squares += torch.stack(torch._foreach_norm([piece_p, piece_u])).double().square()
        if p.numel() <= KEPT_DIRECTION:
            kept.append(piece_u)
    if not c.trust_ratio:
        return
    p_norm, u_norm = squares.sqrt().unbind()
    factor = c.trust_ratio_factors(p_norm.view(1), u_norm.view(1), factor)
    for i, (piece_p, _, piece_m, piece_v) in enumerate(pieces):
        piece_u = kept[i] if kept else _lamb_direction([piece_p], [piece_m], [piece_v], c, run)[0]
        piece_p.addcmul_(piece_u, factor[0])


class _InPlaceCoefficients:
    """The host-side factors of one in-place LAMB step: scalars, and 1-D tensors of one factor
    per param where it depends on the param's step count."""

    def __init__(
        self, params: list[Tensor], steps: list[Tensor], grad_norm_sq: Tensor, o: dict[str, Any]
    ) -> None:
        beta1, beta2, wd, lr = o["beta1"], o["beta2"], o["weight_decay"], o["lr"]
        clip = 1.0
        if o["max_grad_norm"] > 0:
            clip = max(math.sqrt(grad_norm_sq.item()) / o["max_grad_norm"], 1.0)
        self.clip, self.lr, self.weight_decay = clip, lr, wd
        # With AdamW-mode decay (or none) the clipping folds into the moments' coefficients; a
        # grad to clip before its L2 term is divided first.
        self.folded = o["adam_w_mode"] or wd == 0
        grad_weight = (1 - beta1 if o["grad_averaging"] else 1.0) / (clip if self.folded else 1.0)
        # m.lerp_(g, 1 - beta1) where it is the same average: one pass instead of two
        self.lerp_weight = 1 - beta1 if o["grad_averaging"] and grad_weight == 1 - beta1 else None
        self.b1, self.b2 = scalars(params, beta1, beta2)
        self.grad_weight = grad_weight  # add_'s alpha and addcmul's value: Scalars
        self.square_weight = (1 - beta2) / (clip * clip) if self.folded else 1 - beta2
        counts = (steps.flat if isinstance(steps, PackedSteps) else torch.stack(steps)).double()
        root_bc2 = torch.ones_like(counts)
        k = root_bc2
        if o["bias_correction"]:
            root_bc2 = (1 - torch.pow(beta2, counts)).sqrt()
            k = root_bc2 / (1 - torch.pow(beta1, counts))
        dtype = params[0].dtype
        self.epsilons = (o["eps"] * root_bc2).to(dtype)
        self.step_sizes = (-lr * k).to(dtype)
        self.decays = (wd / k).to(dtype) if o["adam_w_mode"] and wd != 0 else None
        self.trust_ratio = o["use_nvlamb"] or wd != 0

    def trust_ratio_factors(self, p_norms: Tensor, u_norms: Tensor, step_sizes: Tensor) -> Tensor:
        """``-lr * ||p|| / ||u||`` where both norms are non-zero, else the step sizes."""
        ratios = (-self.lr * p_norms / u_norms).to(step_sizes.dtype)
        return torch.where((p_norms > 0) & (u_norms > 0), ratios, step_sizes)


def _lamb_moments_(
    p: list[Tensor], g: list[Tensor], m: list[Tensor], v: list[Tensor], c: _InPlaceCoefficients
) -> None:
    """The new moments, in place."""
    if not c.folded:
        g = list(torch._foreach_div(g, c.clip))
        torch._foreach_add_(g, p, alpha=c.weight_decay)
    if c.lerp_weight is not None:
        torch._foreach_lerp_(m, g, c.lerp_weight)
    else:
        torch._foreach_mul_(m, c.b1)
        torch._foreach_add_(m, g, alpha=c.grad_weight)
    torch._foreach_mul_(v, c.b2)
    torch._foreach_addcmul_(v, g, g, value=c.square_weight)


def _lamb_direction(
    p: list[Tensor], m: list[Tensor], v: list[Tensor], c: _InPlaceCoefficients, run: slice
) -> list[Tensor]:
    """``m / (sqrt(v) + eps * sqrt(bc2)) (+ wd / k * p)``: the direction over ``k``, new tensors
    (``run``: the params' slice of the per-param factors)."""
    u = list(torch._foreach_sqrt(v))
    epsilons = c.epsilons[run]
    torch._foreach_add_(u, list(epsilons.expand(len(u)).unbind()))
    torch._foreach_reciprocal_(u)
    torch._foreach_mul_(u, m)
    if c.decays is not None:
        torch._foreach_addcmul_(u, p, list(c.decays[run].expand(len(u)).unbind()))
    return u
