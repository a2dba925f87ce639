"""The references of the Lion, Adagrad and LAMB kernels (KERNEL_CASES rows), with the signature
of kernel_reference.py's: ``(params, grads, state, steps, inv_scale, options) -> (fp32 params,
state)``, each step starting from the kernel's current state."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.optim.adagrad import adagrad as torch_adagrad

import scaledoptim
from tests.reference_optimizers import LambReference


def lion_options(**changes: float | bool) -> dict:
    """The keyword arguments of ``scaledoptim.optim.lion.lion_`` but found_inf and inv_scale, with ``changes``."""
    return dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.0, maximize=False) | changes


def adagrad_options(**changes: float | bool) -> dict:
    """The keyword arguments of ``scaledoptim.optim.adagrad.adagrad_`` but found_inf and inv_scale, with ``changes``."""
    return dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, eps=1e-10, maximize=False) | changes


def lamb_options(**changes: float | bool) -> dict:
    """The keyword arguments of ``scaledoptim.optim.lamb.lamb_`` but found_inf and inv_scale: Apex FusedLAMB's
    defaults but lr 1e-2, with ``changes``."""
    return dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, bias_correction=True,
                max_grad_norm=1.0, adam_w_mode=True, grad_averaging=True, use_nvlamb=False) | changes  # fmt: skip


def _unscaled(grads: Sequence[Tensor], inv_scale: float | None, dtype: torch.dtype) -> list[Tensor]:
    return [g.to(dtype) * (inv_scale if inv_scale is not None else 1.0) for g in grads]


def reference_lion(
    params, grads, state, steps, inv_scale, options
) -> tuple[list[Tensor], list[list[Tensor]]]:
    """One Lion step from the formula in float64 (``state``: the exp_avgs)."""
    (exp_avgs,) = state
    o = options
    new_params, new_exp_avgs = [], []
    for p, g, m in zip(params, _unscaled(grads, inv_scale, torch.float64), exp_avgs):
        g, m = -g if o["maximize"] else g, m.double()
        c = o["beta1"] * m + (1 - o["beta1"]) * g
        new_params.append(
            (p.double() * (1 - o["lr"] * o["weight_decay"]) - o["lr"] * torch.sign(c)).float()
        )
        new_exp_avgs.append((o["beta2"] * m + (1 - o["beta2"]) * g).float())
    return new_params, [new_exp_avgs]


def reference_adagrad(
    params, grads, state, steps, inv_scale, options
) -> tuple[list[Tensor], list[list[Tensor]]]:
    """One torch.optim.Adagrad step (foreach=False) on fp32 copies (``state``: the sums)."""
    (sums,) = state
    p32 = [p.float().clone() for p in params]
    new_sums = [s.clone() for s in sums]
    torch_adagrad(p32, _unscaled(grads, inv_scale, torch.float32), new_sums, [s.clone() for s in steps],
                  foreach=False, fused=False, has_sparse_grad=False, has_complex=False, **options)  # fmt: skip
    return p32, [new_sums]


def reference_lamb(
    params, grads, state, steps, inv_scale, options
) -> tuple[list[Tensor], list[list[Tensor]]]:
    """One LAMB step in float64 (tests/reference_optimizers.py's formula; ``state``: exp_avgs,
    exp_avg_sqs)."""
    exp_avgs, exp_avg_sqs = state
    o = dict(options)
    betas = (o.pop("beta1"), o.pop("beta2"))
    p64 = [torch.nn.Parameter(p.double().clone()) for p in params]
    for p, g in zip(p64, _unscaled(grads, inv_scale, torch.float64)):
        p.grad = g
    opt = LambReference(p64, betas=betas, **o)
    for p, m, v, s in zip(p64, exp_avgs, exp_avg_sqs, steps):
        opt.state[p] = dict(step=s.clone(), exp_avg=m.double(), exp_avg_sq=v.double())
    opt.step()
    new_state = [[opt.state[p][key].float() for p in p64] for key in ("exp_avg", "exp_avg_sq")]
    return [p.detach().float() for p in p64], new_state
