"""The binding of cuda/lamb.cu: its argument structs, its three kernels, and ``lamb_``."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import Tensor

from .builtin import STEP_EPILOGUE, StepEpilogueArgs
from .launcher import prepare_launch, scalar_pointer
from .rounding import ROUNDING_LISTS, rounding_lists
from .sources import CUDA_SOURCE_DIR
from .spec import MultiTensorKernel

__all__ = ["LAMB", "LAMB_GRAD_NORM", "LAMB_NORMS", "LambArgs", "LambNormArgs", "lamb_", "lamb_args"]


class LambArgs(ctypes.Structure):
    """Mirror of ``LambArgs`` in cuda/lamb.cu."""

    _fields_ = [
        ("found_inf", ctypes.c_void_p),
        ("inv_scale", ctypes.c_void_p),
        ("grad_norm_sq", ctypes.c_void_p),
        ("lr", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("beta1_grad", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("one_minus_beta2", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("max_grad_norm", ctypes.c_float),
        ("bias_correction", ctypes.c_int),
        ("adam_w_mode", ctypes.c_int),
        ("trust_ratio", ctypes.c_int),
    ]


class LambNormArgs(ctypes.Structure):
    """Mirror of ``LambNormArgs`` in cuda/lamb.cu."""

    _fields_ = [
        ("found_inf", ctypes.c_void_p),
        ("inv_scale", ctypes.c_void_p),
        ("grad_norm_sq", ctypes.c_void_p),
    ]


_LISTS = (
    "params",
    "grads",
    "exp_avgs",
    "exp_avg_sqs",
    "param_norms_sq",
    "update_norms_sq",
    *ROUNDING_LISTS,
    "steps",
)
#: The update (the optimizer's ``kernel``): ``p -= lr * trust_ratio * update``.
LAMB = MultiTensorKernel(CUDA_SOURCE_DIR / "lamb.cu", "lamb_kernel", _LISTS, LambArgs,
                         dtype_lists=(0, 1), per_tensor_lists=(4, 5, 7, 8))  # fmt: skip
#: The new moments and the per-tensor squared norms of params and updates, on the same lists.
LAMB_NORMS = MultiTensorKernel(CUDA_SOURCE_DIR / "lamb.cu", "lamb_norms_kernel", _LISTS, LambArgs,
                               dtype_lists=(0, 1), per_tensor_lists=(4, 5, 7, 8))  # fmt: skip
#: The squared global norm of the unscaled grads.
LAMB_GRAD_NORM = MultiTensorKernel(CUDA_SOURCE_DIR / "lamb.cu", "lamb_grad_norm_kernel", ("grads",),
                                   LambNormArgs, dtype_lists=(0,))  # fmt: skip


def lamb_args(
    found_inf: int | None,
    inv_scale: int | None,
    grad_norm_sq: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    max_grad_norm: float,
    adam_w_mode: bool,
    grad_averaging: bool,
    use_nvlamb: bool,
) -> LambArgs:
    """The kernels' arguments: device scalar pointers, and every host-side constant."""
    return LambArgs(
        found_inf=found_inf, inv_scale=inv_scale, grad_norm_sq=grad_norm_sq, lr=lr, beta1=beta1,
        beta1_grad=1 - beta1 if grad_averaging else 1.0, beta2=beta2, one_minus_beta2=1 - beta2,
        eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
        bias_correction=bias_correction, adam_w_mode=adam_w_mode,
        trust_ratio=use_nvlamb or weight_decay != 0,
    )  # fmt: skip


class LambLaunches:
    r"""The validated launches of one LAMB step over fixed tensor lists (plan, then run).

    Args:
        tensor_lists: the lists of :data:`LAMB` (``param_norms_sq``/``update_norms_sq`` are
            0-dim float32 scratch tensors, one per param, zeroed by :meth:`run`).
        norm_grads: the grads whose global norm clips (all of the optimizer's, not only these
            lists'), or ``None`` when an earlier launch of the same step already computed it
            into ``grad_norm_sq``. Its launch is prepared when it runs, so an optimizer may
            still be collecting them (they are params' grads, validated with them).
        grad_norm_sq: a 0-dim float32 device tensor holding or receiving that squared norm.
    """

    def __init__(self, tensor_lists: Sequence[Sequence[Tensor]], norm_grads: Sequence[Tensor] | None,
                 grad_norm_sq: Tensor) -> None:  # fmt: skip
        self.device = tensor_lists[0][0].device
        self.scratch = list(tensor_lists[4]) + list(tensor_lists[5])
        self.grad_norm_sq = grad_norm_sq
        self.norm_grads = norm_grads
        self.moments = prepare_launch(LAMB_NORMS, tensor_lists)
        self.update = prepare_launch(LAMB, tensor_lists)
        self.norm_pointer = scalar_pointer(grad_norm_sq, "grad_norm_sq", self.device)

    def run_before_update(self, found: int | None, inv: int | None) -> None:
        """The launches before the update kernel: the global grad norm, the moments and norms."""
        if self.norm_grads is not None:
            self.grad_norm_sq.zero_()
            norm = prepare_launch(
                LAMB_GRAD_NORM, [self.norm_grads]
            )  # cached tables after the first step
            norm.run(LambNormArgs(found, inv, self.norm_pointer))
        torch._foreach_zero_(self.scratch)

    def run(self, args: LambArgs) -> None:
        """Every launch of the update, the update's ``args`` given; the step counters are left
        to the step's epilogue (Note [step counters])."""
        self.run_before_update(args.found_inf, args.inv_scale)
        self.moments.run(args)
        self.update.run(args)


def lamb_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    found_inf: Tensor | None,
    inv_scale: Tensor | None,
    master_params: Sequence[Tensor] = (),
    sr_seeds: Sequence[Tensor] = (),
    norms_sq: tuple[Sequence[Tensor], Sequence[Tensor]] | None = None,
    **options: float | bool,
) -> None:
    r"""One fused LAMB step over all tensors (Apex FusedLAMB's semantics), with no host sync.

    The global norm of the unscaled grads (all of ``grads``) clips them by
    ``max(norm / max_grad_norm, 1)``; Adam moments; the update
    ``m_hat / (sqrt(v_hat) + eps) (+ weight_decay * p in adam_w_mode)``; per tensor the trust
    ratio ``||p|| / ||update||`` (when ``use_nvlamb`` or ``weight_decay != 0``, and both norms
    are non-zero); ``p -= lr * ratio * update``. Nothing changes when ``found_inf`` is set.

    Args:
        found_inf: 0-dim float32 device tensor, or ``None`` to always step.
        inv_scale: 0-dim float32 device tensor, or ``None`` when grads are not scaled.
        master_params, sr_seeds: the param rounding lists (see
            :func:`scaledoptim.kernels.rounding.rounding_lists`), empty to round to nearest.
        norms_sq: two lists of 0-dim float32 scratch tensors (one per param each) receiving
            the squared norms of params and updates, or ``None`` to allocate them.
        options: the keyword arguments of :func:`lamb_args` but the pointers.
    """
    if not params:
        return
    device = params[0].device
    norms = norms_sq or [[torch.zeros((), device=device) for _ in params] for _ in range(2)]
    lists = [
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        *norms,
        *rounding_lists(master_params, sr_seeds),
        steps,
    ]
    grad_norm_sq = torch.zeros((), device=device)
    launches = LambLaunches(lists, grads, grad_norm_sq)
    epilogue = prepare_launch(STEP_EPILOGUE, [steps])
    found = scalar_pointer(found_inf, "found_inf", device)
    inv = scalar_pointer(inv_scale, "inv_scale", device)
    launches.run(lamb_args(found, inv, launches.norm_pointer, **options))
    epilogue.run(StepEpilogueArgs(found_inf=found))  # Note [step counters]: after the update
