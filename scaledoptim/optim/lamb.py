"""LAMB: hyper-parameters, state, and the update as kernel launches and torch ops."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..backends import select
from ..backends.torch_native import advance_steps_, copy_unless_skipped_
from ..kernels.lamb import LAMB as LAMB_KERNEL
from ..kernels.lamb import LambLaunches, lamb_args
from .fused import FusedOptimizer, check_hyperparameter

__all__ = ["LAMB"]


class LAMB(FusedOptimizer):
    r"""LAMB (You et al., 2020) with Apex ``FusedLAMB``'s semantics and the loss-scaling
    protocol, sync-free and CUDA-graph capturable.

    Each step: the global norm of all the optimizer's (unscaled) grads clips them by
    ``max(norm / max_grad_norm, 1)``; Adam moments (``1 - beta1`` replaced by 1 without
    ``grad_averaging``); the update ``m_hat / (sqrt(v_hat) + eps) + weight_decay * p`` (in
    ``adam_w_mode``; otherwise the L2 term is added to the grad); per tensor the trust ratio
    ``||p|| / ||update||``, applied when ``use_nvlamb`` or ``weight_decay != 0`` and both norms
    are non-zero; ``p -= lr * ratio * update``. The norms are reduced on device (no host read);
    a skipped step changes nothing. State: ``exp_avg``, ``exp_avg_sq`` (fp32) and ``step``.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate.
        betas: coefficients for the running averages of the gradient and its square.
        eps: term added to the denominator for numerical stability.
        weight_decay: weight decay coefficient.
        bias_correction: divide the moments by ``1 - beta**step``.
        max_grad_norm: the global grad norm above which grads are scaled down; ``<= 0``
            disables the clipping (where Apex would divide by inf).
        adam_w_mode: decoupled weight decay in the update (else L2 in the grad).
        grad_averaging: scale the gradient by ``1 - beta1`` in the first moment.
        use_nvlamb: apply the trust ratio even when ``weight_decay == 0``.
        master_weights: keep an fp32 master copy of 16-bit params (see
            :class:`~scaledoptim.FusedOptimizer`).
        stochastic_rounding: round bf16 params stochastically (see
            :class:`~scaledoptim.FusedOptimizer`).
    """

    kernel = LAMB_KERNEL

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        max_grad_norm: float = 1.0,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        use_nvlamb: bool = False,
        *,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
            max_grad_norm=max_grad_norm, adam_w_mode=adam_w_mode, grad_averaging=grad_averaging,
            use_nvlamb=use_nvlamb, master_weights=master_weights,
            stochastic_rounding=stochastic_rounding,
        )  # fmt: skip
        super().__init__(params, defaults)
        # Per-step scratch, not state: per-param squared norms (kernels), the grads of the step
        # and their global norm, kept across steps so launch tables stay cached.
        self._norm_scratch: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        self._step_grads: list[torch.Tensor] = []
        self._step_grad_lists: list[list[torch.Tensor]] = []
        self._grad_norm_sq: dict[torch.device, torch.Tensor] = {}

    def _check_options(self, options: dict[str, Any]) -> None:
        check_hyperparameter("learning rate", options["lr"])
        check_hyperparameter("epsilon value", options["eps"])
        check_hyperparameter("beta parameter at index 0", options["betas"][0], high=1.0)
        check_hyperparameter("beta parameter at index 1", options["betas"][1], high=1.0)
        check_hyperparameter("weight_decay value", options["weight_decay"])
        check_hyperparameter("max_grad_norm", options["max_grad_norm"], low=-float("inf"))

    def _state_keys(self, group: dict[str, Any]) -> tuple[str | None, ...]:
        return ("exp_avg", "exp_avg_sq")

    def _extra_lists(
        self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor]
    ) -> list[list[torch.Tensor]]:
        backend = select(params[0].device)
        if not all(backend.supports(p) for p in params):
            raise ValueError(
                f"LAMB's global grad norm spans every param, and the {backend.name} backend "
                f"cannot update {params[0].dtype} params; use float32, float16 or bfloat16 "
                "params, or torch's ops for all of them (SCALEDOPTIM_KERNELS=torch)"
            )
        if self._is_first_group(group):
            self._step_grads, self._step_grad_lists = [], []
        self._step_grads += grads
        # The list itself: the torch-native backend replaces 16-bit grads in it by their
        # unscaled fp32 copies before the update, and the norm must see those.
        self._step_grad_lists.append(grads)
        scratch = [self._norm_scratch.get(p) for p in params]
        for i, (p, s) in enumerate(zip(params, scratch)):
            if s is None or s[0].device != p.device:
                scratch[i] = self._norm_scratch[p] = (
                    torch.zeros((), device=p.device),
                    torch.zeros((), device=p.device),
                )
        return [[s[0] for s in scratch], [s[1] for s in scratch]]

    def _prepare_kernel_launches(
        self, group: dict[str, Any], tensor_lists: list[list[torch.Tensor]]
    ) -> Callable[[int | None, int | None], None]:
        first = self._is_first_group(group)
        launches = LambLaunches(
            tensor_lists, self._step_grads if first else None, self._norm_buffer(tensor_lists)
        )
        options = _lamb_options(group)

        def run(found: int | None, inv: int | None) -> None:
            launches.run(lamb_args(found, inv, launches.norm_pointer, **options))

        return run

    def _kernel_args(
        self, group, found_inf, inv_scale
    ):  # every launch goes through _prepare_kernel_launches
        raise NotImplementedError("LAMB's kernel update is prepared by _prepare_kernel_launches")

    def _torch_update(
        self,
        group: dict[str, Any],
        tensor_lists: list[list[torch.Tensor]],
        found_inf: torch.Tensor | None,
    ) -> None:
        """The same update with torch's foreach ops; the grads arrive unscaled."""
        params, grads, exp_avgs, exp_avg_sqs, _, _, steps = tensor_lists
        o = _lamb_options(group)
        norm_sq = self._norm_buffer(tensor_lists)
        if self._is_first_group(group):
            step_grads = [g for grads in self._step_grad_lists for g in grads]
            norms = torch._foreach_norm(step_grads, 2, dtype=torch.float32)
            norm_sq.copy_(torch.stack(norms).square().sum())
        advance_steps_(steps, found_inf)  # the moments' bias corrections read the new count
        norm = norm_sq.sqrt()
        if o["max_grad_norm"] > 0:
            grads = torch._foreach_div(grads, torch.clamp(norm / o["max_grad_norm"], min=1.0))
        wd = o["weight_decay"]
        if not o["adam_w_mode"] and wd != 0:
            grads = torch._foreach_add(grads, params, alpha=wd)
        m = torch._foreach_mul(exp_avgs, o["beta1"])
        torch._foreach_add_(m, grads, alpha=1 - o["beta1"] if o["grad_averaging"] else 1.0)
        v = torch._foreach_mul(exp_avg_sqs, o["beta2"])
        torch._foreach_addcmul_(v, grads, grads, value=1 - o["beta2"])
        if o["bias_correction"]:
            c1 = [1 - torch.pow(o["beta1"], s) for s in steps]
            c2 = [1 - torch.pow(o["beta2"], s) for s in steps]
            update = torch._foreach_div(
                torch._foreach_div(m, c1),
                torch._foreach_add(torch._foreach_sqrt(torch._foreach_div(v, c2)), o["eps"]),
            )
        else:
            update = torch._foreach_div(m, torch._foreach_add(torch._foreach_sqrt(v), o["eps"]))
        if o["adam_w_mode"] and wd != 0:
            torch._foreach_add_(update, params, alpha=wd)
        step_sizes = [torch.full((), -o["lr"], device=p.device) for p in params]
        if o["use_nvlamb"] or wd != 0:
            p_norms, u_norms = torch._foreach_norm(params), torch._foreach_norm(update)
            step_sizes = [
                torch.where((pn > 0) & (un > 0), -o["lr"] * pn / un, s)
                for pn, un, s in zip(p_norms, u_norms, step_sizes)
            ]
        new_params = torch._foreach_add(params, torch._foreach_mul(update, step_sizes))
        copy_unless_skipped_(params, new_params, found_inf)
        copy_unless_skipped_(exp_avgs, m, found_inf)
        copy_unless_skipped_(exp_avg_sqs, v, found_inf)

    def _is_first_group(self, group: dict[str, Any]) -> bool:
        first = next(
            (g for g in self.param_groups if any(p.grad is not None for p in g["params"])), None
        )
        return group is first

    def _norm_buffer(self, tensor_lists: list[list[torch.Tensor]]) -> torch.Tensor:
        device = tensor_lists[0][0].device
        if device not in self._grad_norm_sq:
            self._grad_norm_sq[device] = torch.zeros((), device=device)
        return self._grad_norm_sq[device]


def _lamb_options(group: dict[str, Any]) -> dict[str, Any]:
    beta1, beta2 = group["betas"]
    return dict(
        lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
        bias_correction=group["bias_correction"], max_grad_norm=group["max_grad_norm"],
        adam_w_mode=group["adam_w_mode"], grad_averaging=group["grad_averaging"],
        use_nvlamb=group["use_nvlamb"],
    )  # fmt: skip
