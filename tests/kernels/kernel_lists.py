"""The tensor lists of KERNEL_CASES' rows (``make_lists``), as the optimizers build them, and
the adapters of the update kernels whose launch or functional entry point is not the plain one."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

import scaledoptim
from scaledoptim import kernels
from scaledoptim.optim import lamb


def zero_steps(params: Sequence[Tensor]) -> list[Tensor]:
    return [torch.zeros((), device=p.device) for p in params]


def fp32_zeros(params: Sequence[Tensor]) -> list[Tensor]:
    return [torch.zeros_like(p, dtype=torch.float32) for p in params]


def adam_lists(params, grads, options, generator) -> list[list[Tensor]]:
    max_exp_avg_sqs = fp32_zeros(params) if options["amsgrad"] else []
    return [
        list(params),
        list(grads),
        fp32_zeros(params),
        fp32_zeros(params),
        max_exp_avg_sqs,
        *NO_ROUNDING,
        zero_steps(params),
    ]


def sgd_lists(params, grads, options, generator) -> list[list[Tensor]]:
    # Garbage buffers: the first taken step must overwrite them with the gradient.
    buffers = (
        [torch.randn(p.shape, generator=generator).to(p.device) for p in params]
        if options["momentum"]
        else []
    )
    return [list(params), list(grads), buffers, *NO_ROUNDING, zero_steps(params)]


NO_ROUNDING = ([], [])  # master_params, sr_seeds: round to nearest


def with_rounding_lists(functional: Callable[..., None]) -> Callable[..., None]:
    """``functional`` (rounding lists as keywords) taking every list of its kernel positionally."""

    def call(*lists: Sequence[Tensor], **kwargs) -> None:
        *rest, masters, seeds, steps = lists
        int_seeds = [seed.view(torch.int32) for seed in seeds]
        functional(*rest, steps, master_params=masters, sr_seeds=int_seeds, **kwargs)

    return call


def lion_lists(params, grads, options, generator) -> list[list[Tensor]]:
    return [list(params), list(grads), fp32_zeros(params), *NO_ROUNDING, zero_steps(params)]


def adagrad_lists(params, grads, options, generator) -> list[list[Tensor]]:
    sums = [torch.full(p.shape, 0.1, device=p.device) for p in params]  # initial_accumulator_value
    return [list(params), list(grads), sums, *NO_ROUNDING, zero_steps(params)]


def lamb_lists(params, grads, options, generator) -> list[list[Tensor]]:
    norms_sq = [[torch.zeros((), device=p.device) for p in params] for _ in range(2)]
    return [list(params), list(grads), fp32_zeros(params), fp32_zeros(params), *norms_sq,
            *NO_ROUNDING, zero_steps(params)]  # fmt: skip


#: Where the LAMB norm rows accumulate the squared grad norm (CPU: those rows run emulated).
GRAD_NORM_SQ = torch.zeros(())


def prepare_lamb(
    lists: Sequence[Sequence[Tensor]],
) -> Callable[[dict, int | None, int | None], None]:
    """The optimizer's LAMB launches over ``lists``: the global grad norm of its grads, the
    moments and norms, the update."""
    device = lists[0][0].device if lists[0] else torch.device("cpu")
    grad_norm_sq = torch.zeros((), device=device)
    grad_norm = kernels.prepare_launch(lamb.LAMB_GRAD_NORM_KERNEL, [lists[1]])
    update = [kernels.prepare_launch(k, lists) for k in (lamb.LAMB_NORMS_KERNEL, lamb.LAMB_KERNEL)]
    scratch = [*lists[4], *lists[5]]

    def run(options: dict, found_inf: int | None, inv_scale: int | None) -> None:
        grad_norm_sq.zero_()
        grad_norm.run(lamb.LambNormArgs(found_inf, inv_scale, grad_norm_sq.data_ptr()))
        torch._foreach_zero_(scratch)
        args = lamb.lamb_args(found_inf, inv_scale, grad_norm_sq.data_ptr(), **options)
        for launch in update:
            launch.run(args)

    return run


def lamb_functional(params, grads, exp_avgs, exp_avg_sqs, param_norms_sq, update_norms_sq,
                    masters, seeds, steps, **kwargs) -> None:  # fmt: skip
    scaledoptim.optim.lamb.lamb_(params, grads, exp_avgs, exp_avg_sqs, steps, master_params=masters,
                  sr_seeds=[s.view(torch.int32) for s in seeds],
                  norms_sq=(param_norms_sq, update_norms_sq), **kwargs)  # fmt: skip
