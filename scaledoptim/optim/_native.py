"""The torch-native execution path: torch's fused multi-tensor ops, sync-free on any device.

torch's ``_fused_adam(w)_`` / ``_fused_sgd_`` read ``found_inf`` on device and skip the whole
update when it is 1.0 (see Note [found_inf contract] in ``scaledoptim/optimizer.py``), but they
need params, grads and state of one dtype and they do not advance step counters. So this module:

* runs 16-bit params through fp32 working copies (state is fp32, math is fp32, the param is
  rounded once). This also routes around torch 2.13's CPU ``_fused_sgd_``, which leaves bf16/fp16
  params of 16 or more elements unchanged (``tests/test_torch_kernels.py`` shows it);
* advances step counters by ``1 - found_inf`` on device, before the update that reads them.

This path never unscales in the update: on CPU an in-place unscale followed by the plain fused
update is about twice as fast as torch's in-kernel ``grad_scale``.
"""

from __future__ import annotations

import torch

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _working_copies(
    params: list[torch.Tensor], grads: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fp32 copies of 16-bit params (other params as they are) and grads of the same dtype."""
    work = [p.float() if p.dtype in _LOW_PRECISION else p for p in params]
    work_grads = [g if g.dtype == w.dtype else g.to(w.dtype) for g, w in zip(grads, work)]
    return work, work_grads


def _write_back(params: list[torch.Tensor], work: list[torch.Tensor]) -> None:
    rounded = [(p, w) for p, w in zip(params, work) if p is not w]
    if rounded:
        torch._foreach_copy_([p for p, _ in rounded], [w for _, w in rounded])


def _advance_steps(steps: list[torch.Tensor], found_inf: torch.Tensor | None) -> None:
    if steps:
        torch._foreach_add_(steps, 1 if found_inf is None else 1 - found_inf)


def adam_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    amsgrad: bool,
    maximize: bool,
    found_inf: torch.Tensor | None,
) -> None:
    """One Adam (``decoupled_weight_decay=False``) or AdamW step over a list of tensors."""
    work, work_grads = _working_copies(params, grads)
    _advance_steps(steps, found_inf)
    fused = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
    fused(
        work, work_grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
        amsgrad=amsgrad, maximize=maximize, found_inf=found_inf,
    )  # fmt: skip
    _write_back(params, work)


def sgd_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
    found_inf: torch.Tensor | None,
) -> None:
    """One SGD step over a list of tensors; ``steps`` count taken steps.

    The momentum buffers start at zero, so ``momentum * 0 + (1 - dampening) * d_p`` is torch's
    first-step ``buf = d_p`` whenever ``dampening == 0``. With dampening, the buffer of a param
    whose first step is still to be taken is pre-set on device so the same formula yields
    ``d_p``. The first step is decided on device because a skipped step must not count as one.
    """
    work, work_grads = _working_copies(params, grads)
    if momentum_buffers and dampening != 0:
        for buf, param, grad, step in zip(momentum_buffers, work, work_grads, steps):
            d_p = grad.neg() if maximize else grad
            if weight_decay != 0:
                d_p = d_p.add(param, alpha=weight_decay)
            buf.copy_(torch.where(step == 0, d_p * (dampening / momentum), buf))
    torch._fused_sgd_(
        work, work_grads, momentum_buffers,
        weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
        nesterov=nesterov, maximize=maximize, is_first_step=False, found_inf=found_inf,
    )  # fmt: skip
    _advance_steps(steps, found_inf)
    _write_back(params, work)
