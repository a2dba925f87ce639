"""Plain-PyTorch references of the optimizers torch.optim lacks, written from their formulas and
computed in float64 (the state is kept in float64; params are rounded once to their dtype).

They are ordinary ``torch.optim.Optimizer`` classes, so ``torch.amp.GradScaler`` drives them as
it drives torch's own, and they can be the ``reference`` of an ``optimizer_table`` row.
"""

from __future__ import annotations

import math

import torch


class LionReference(torch.optim.Optimizer):
    """``c = b1*m + (1-b1)*g; p = p*(1 - lr*wd) - lr*sign(c); m = b2*m + (1-b2)*g``."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False):
        super().__init__(
            params, dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.double() * (-1 if group["maximize"] else 1)
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float64)
                m = state["exp_avg"].double()
                c = b1 * m + (1 - b1) * g
                new = p.double() * (1 - group["lr"] * group["weight_decay"]) - group[
                    "lr"
                ] * torch.sign(c)
                p.copy_(new)
                state["exp_avg"] = b2 * m + (1 - b2) * g
                state["step"] += 1
        return loss


class LambReference(torch.optim.Optimizer):
    """Apex FusedLAMB's semantics: global-norm clipping by ``max(norm / max_grad_norm, 1)``
    (off when ``max_grad_norm <= 0``), Adam moments (``1 - beta1`` replaced by 1 without
    ``grad_averaging``), ``m_hat / (sqrt(v_hat) + eps) + wd * p`` (L2 in the grad without
    ``adam_w_mode``), trust ratio ``||p|| / ||update||`` when ``use_nvlamb`` or ``wd != 0`` and
    both norms are non-zero."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 bias_correction=True, max_grad_norm=1.0, adam_w_mode=True, grad_averaging=True,
                 use_nvlamb=False):  # fmt: skip
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_grad_norm=max_grad_norm,
                        adam_w_mode=adam_w_mode, grad_averaging=grad_averaging, use_nvlamb=use_nvlamb)  # fmt: skip
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        grads = [
            p.grad.double() for g in self.param_groups for p in g["params"] if p.grad is not None
        ]
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads)) if grads else 0.0
        for group in self.param_groups:
            b1, b2 = group["betas"]
            wd, max_norm = group["weight_decay"], group["max_grad_norm"]
            clip = max(norm / max_norm, 1.0) if max_norm > 0 else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float64)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float64)
                state["step"] += 1
                step = float(state["step"])
                w = p.double()
                g = p.grad.double() / clip
                if not group["adam_w_mode"] and wd != 0:
                    g = g + wd * w
                m = (
                    b1 * state["exp_avg"].double()
                    + (1 - b1 if group["grad_averaging"] else 1.0) * g
                )
                v = b2 * state["exp_avg_sq"].double() + (1 - b2) * g * g
                state["exp_avg"], state["exp_avg_sq"] = m, v
                c1, c2 = (1 - b1**step, 1 - b2**step) if group["bias_correction"] else (1.0, 1.0)
                update = (m / c1) / ((v / c2).sqrt() + group["eps"])
                if group["adam_w_mode"] and wd != 0:
                    update = update + wd * w
                ratio = 1.0
                if group["use_nvlamb"] or wd != 0:
                    w_norm, u_norm = float(w.norm()), float(update.norm())
                    if w_norm > 0 and u_norm > 0:
                        ratio = w_norm / u_norm
                p.copy_(w - group["lr"] * ratio * update)
        return loss
