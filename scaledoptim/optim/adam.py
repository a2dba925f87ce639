"""Adam and AdamW: the classes, the kernel's arguments (cuda/adam.cu) and the torch form."""

from __future__ import annotations

import ctypes
import dataclasses
import math
from collections.abc import Iterable
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim.adam import adam as torch_adam

from ..fused import FusedOptimizer
from ..fused.lowbit import (
    SIGNED,
    UNSIGNED,
    lowbit_fields,
    lowbit_kernel,
)
from ..fused.lowbit import lowbit_options as _lowbit_options
from ..fused.options import option, read_options
from ..kernels import (
    CUDA_SOURCE_DIR,
    ROUNDING_LISTS,
    MultiTensorKernel,
)
from ..torch_ops import advance_steps_
from .spec import Config, ErrorInput, OptimizerSpec

__all__ = [
    "ADAM_KERNEL", "ADAM_LOWBIT_KERNEL", "Adam", "AdamArgs", "AdamOptions", "AdamW",
    "AdamWOptions", "LowBitAdamArgs", "adam_args",
]


@dataclasses.dataclass(frozen=True)
class AdamOptions:
    """Adam's hyper-parameters (checked in torch.optim.Adam's order): defaults, valid ranges,
    the tests' sweep."""

    lr: float = option(
        1e-3, check="learning rate", tensor=True, sweep=(1e-2,), draw=(1e-4, 1e-1)
    )
    eps: float = option(1e-8, check="epsilon value", tensor=True, draw=(1e-10, 1e-3))
    betas: tuple[float, float] = option(
        (0.9, 0.999), check="beta parameter", high=1.0, tensor=True,
        draw=((0.0, 0.99), (0.9, 0.9999)),
    )
    weight_decay: float = option(
        0.0, check="weight_decay value", tensor=True, sweep=(0.0, 0.1)
    )
    amsgrad: bool = option(False, sweep=(False, True))
    maximize: bool = option(False, sweep=(False, True))
    decoupled_weight_decay: bool = option(False)


@dataclasses.dataclass(frozen=True)
class AdamWOptions(AdamOptions):
    """AdamW's: Adam's with decoupled weight decay of 1e-2 by default."""

    weight_decay: float = option(
        1e-2, check="weight_decay value", tensor=True, sweep=(0.0, 0.1)
    )
    decoupled_weight_decay: bool = option(True)


# ------------------------------------------------------------------------------ the kernel
class AdamArgs(ctypes.Structure):
    """Mirror of ``AdamArgs`` in cuda/adam.cu."""

    _fields_ = [
        ("found_inf", ctypes.c_void_p),
        ("inv_scale", ctypes.c_void_p),
        ("lr", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("one_minus_beta1", ctypes.c_float),
        ("one_minus_beta2", ctypes.c_float),
        ("log_beta1", ctypes.c_float),
        ("log_beta2", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("param_decay", ctypes.c_float),
        ("amsgrad", ctypes.c_int),
        ("maximize", ctypes.c_int),
    ]


ADAM_KERNEL = MultiTensorKernel(
    CUDA_SOURCE_DIR / "adam.cu",
    "adam_kernel",
    ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", *ROUNDING_LISTS, "steps"),
    AdamArgs,
    dtype_lists=(0, 1),
)


class LowBitAdamArgs(ctypes.Structure):
    """Mirror of ``LowBitAdamArgs`` in cuda/adam.cu: :class:`AdamArgs` and the block size."""

    _fields_ = lowbit_fields(AdamArgs)


#: The kernel of Adam's 8-bit states (``state_bits=8``; Note [low-bit variants]).
ADAM_LOWBIT_KERNEL = lowbit_kernel(
    ADAM_KERNEL, ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"), LowBitAdamArgs
)


def adam_args(found_inf: int | None, inv_scale: int | None, o: AdamOptions) -> AdamArgs:
    """The kernel's arguments: device scalar pointers, and every host-side constant (``o``
    read by :func:`~scaledoptim.fused.options.read_options`: numbers)."""
    lr, (beta1, beta2), decoupled = float(o.lr), map(float, o.betas), o.decoupled_weight_decay
    return AdamArgs(
        found_inf=found_inf,
        inv_scale=inv_scale,
        lr=lr,
        beta2=beta2,
        one_minus_beta1=1 - beta1,
        one_minus_beta2=1 - beta2,
        log_beta1=math.log(beta1) if beta1 > 0 else -math.inf,
        log_beta2=math.log(beta2) if beta2 > 0 else -math.inf,
        eps=o.eps,
        weight_decay=0.0 if decoupled else o.weight_decay,
        param_decay=1 - lr * o.weight_decay if decoupled else 1.0,
        amsgrad=o.amsgrad,
        maximize=o.maximize,
    )


# ------------------------------------------------------------------------------ the optimizer
class Adam(FusedOptimizer):
    r"""Adam with the loss-scaling protocol, a drop-in for :class:`torch.optim.Adam`.

    Same signature, same math, same state names (``step``, ``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``), same errors. Fused: the whole update is one multi-tensor op that skips
    on ``found_inf`` on device; ``foreach``, ``fused`` and ``capturable`` do not change that
    path. ``lr`` and ``betas`` may be one-element tensors (CPU ones are read at each step).
    Complex params, views with gaps, ``differentiable=True`` and hyper-parameter tensors on an
    accelerator take :func:`torch.optim.adam.adam` with the group's flags, in the same step
    (the migration guide, "What takes torch.optim's own implementation"). State is fp32 whatever the
    param dtype, and 16-bit params are updated in fp32 and rounded once; or, with
    ``state_bits=8``, 8-bit block-wise codes (the low-bit states guide): ``exp_avg_codes`` and
    ``exp_avg_scales`` for ``exp_avg``, and so on, about 2.03 bytes per element for both moments
    in blocks of 256 (float32 moments: 8), updated in the same pass; such an optimizer refuses
    what takes torch.optim's implementation, and sharded (DTensor) params.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate.
        betas: coefficients for the running averages of the gradient and its square.
        eps: term added to the denominator for numerical stability.
        weight_decay: weight decay coefficient (L2 penalty, or decoupled: see below).
        amsgrad: use the maximum of past squared-gradient averages.
        maximize: maximize the objective instead of minimizing.
        decoupled_weight_decay: apply weight decay as AdamW does.
        foreach: torch.optim's ``foreach`` flag, with its checks; the fused path does not
            depend on it (see above).
        fused: torch.optim's ``fused`` flag, with its checks; the fused path does not
            depend on it (see above).
        capturable: torch.optim's ``capturable`` flag, with its checks; the fused path does
            not depend on it (see above).
        differentiable: torch.optim's ``differentiable`` flag: ``True`` takes
            :func:`torch.optim.adam.adam` (see above).
        master_weights: keep an fp32 master copy of 16-bit params (see
            :class:`~scaledoptim.FusedOptimizer`).
        stochastic_rounding: round bf16 params stochastically (see
            :class:`~scaledoptim.FusedOptimizer`).
        state_bits: 32 (float32 states) or 8 (8-bit block-wise codes of every moment).
        block_size: elements per block of 8-bit states, each with its float32 scale.
    """

    kernel = ADAM_KERNEL
    rounds = True
    options = AdamOptions
    args = staticmethod(adam_args)
    lowbit_kernel = ADAM_LOWBIT_KERNEL
    #: The precision of its states with ``state_bits=8``: the code of each (Note [low-bit
    #: variants]).
    lowbit_codes = MappingProxyType(
        {"exp_avg": SIGNED, "exp_avg_sq": UNSIGNED, "max_exp_avg_sq": UNSIGNED}
    )
    elementwise = True
    torch_update_takes_grad_scale = True
    torch_optim = torch.optim.Adam
    _legacy_options: ClassVar[dict[str, Any]] = {
        "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
        "differentiable": False, "decoupled_weight_decay": False, "fused": None,
    }

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
        state_bits: int = 32,
        block_size: int = 256,
    ) -> None:
        betas = _check_tensor_options(lr, betas, foreach=foreach, capturable=capturable)
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
            master_weights=master_weights, stochastic_rounding=stochastic_rounding,
            **_lowbit_options(state_bits, block_size),
        )
        super().__init__(params, defaults)

    def check_options(self, options: dict[str, Any]) -> None:
        super().check_options(options)
        if (
            isinstance(options["lr"], Tensor)
            and options["foreach"]
            and not options["capturable"]
        ):  # torch.optim checks this again at step (a group edited since)
            raise RuntimeError(
                "lr as a Tensor is not supported for capturable=False and foreach=True"
            )

    def check_torch_optim(self, group: dict[str, Any], params: list[Tensor]) -> None:
        if any(p.grad is not None and p.grad.is_sparse for p in params):
            raise RuntimeError(
                f"{type(self).__name__} does not support sparse gradients, please consider "
                "SparseAdam instead, or a dense layer (nn.Embedding(sparse=False))"
            )

    def state_keys(self, group: dict[str, Any]) -> tuple[str | None, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq" if group["amsgrad"] else None)

    def torch_update(
        self,
        group: dict[str, Any],
        tensor_lists: list[list[torch.Tensor]],
        found_inf: torch.Tensor | None,
        grad_scale: torch.Tensor | None = None,
    ) -> None:
        """torch's fused Adam(W), which takes ``found_inf`` (and ``grad_scale``) itself: Adam's
        single torch form, on every device."""
        *tensors, steps = tensor_lists
        advance_steps_(steps, found_inf)  # torch's fused Adam reads the advanced counter
        fused, options = _torch_fused(read_options(AdamOptions, group))
        fused(*tensors, steps, **options, grad_scale=grad_scale, found_inf=found_inf)

    def torch_form_(self, group: dict[str, Any], tensor_lists: list[list[torch.Tensor]]) -> None:
        """torch's fused Adam(W) in place and taken, over counters that already count this
        step: the float32 update of a batch of decoded 8-bit states (Note [low-bit
        batches]); the float32 states take :meth:`torch_update`."""
        *tensors, steps = tensor_lists
        fused, options = _torch_fused(read_options(AdamOptions, group))
        fused(*tensors, steps, **options)

    def torch_optim_update(
        self,
        group: dict[str, Any],
        tensor_lists: list[list[torch.Tensor]],
        found_inf: torch.Tensor | None,
    ) -> None:
        """:func:`torch.optim.adam.adam`, called as ``torch.optim.Adam.step`` calls it."""
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = tensor_lists
        beta1, beta2 = group["betas"]
        torch_adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            foreach=group["foreach"], capturable=group["capturable"],
            differentiable=group["differentiable"], fused=group["fused"], found_inf=found_inf,
            has_complex=any(map(torch.is_complex, params)),
            decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=group["amsgrad"],
            beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=group["maximize"],
        )


class AdamW(Adam):
    r"""AdamW with the loss-scaling protocol, a drop-in for :class:`torch.optim.AdamW`.

    :class:`Adam` with decoupled weight decay (``param *= 1 - lr * weight_decay``) and
    ``weight_decay=1e-2`` by default. See :class:`Adam` for the arguments.

    Example::

        >>> opt = scaledoptim.AdamW(model.parameters(), lr=1e-3)
        >>> S = opt.scale
        >>> scaledoptim.scale_outputs(loss_fn(model(x), y), S).backward()
        >>> _, found_inf, S = opt.unscale_and_step(grads_scaled_by=S)
    """

    options = AdamWOptions

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
        state_bits: int = 32,
        block_size: int = 256,
    ) -> None:
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            foreach=foreach, maximize=maximize, capturable=capturable,
            differentiable=differentiable, fused=fused, decoupled_weight_decay=True,
            master_weights=master_weights, stochastic_rounding=stochastic_rounding,
            state_bits=state_bits, block_size=block_size,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        # As torch.optim.AdamW: a checkpoint saved by Adam still steps as AdamW.
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True


def _check_tensor_options(
    lr: float | Tensor,
    betas: tuple[float | Tensor, float | Tensor],
    *,
    foreach: bool | None,
    capturable: bool,
) -> tuple[float | Tensor, float | Tensor]:
    """torch.optim.Adam's checks of a tensor ``lr`` and ``betas``, made before anything else as
    torch makes them; returns the betas as torch keeps them (one-element tensors as 0-dim)."""
    if isinstance(lr, Tensor):
        if foreach and not capturable:
            raise ValueError(
                "lr as a Tensor is not supported for capturable=False and foreach=True"
            )
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    if isinstance(betas[0], Tensor) != isinstance(betas[1], Tensor):
        raise ValueError("betas must be either both floats or both Tensors")
    for i, beta in enumerate(betas):
        if isinstance(beta, Tensor):
            if foreach and not capturable:
                raise ValueError(
                    f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True"
                )
            if beta.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
    beta1, beta2 = (b.squeeze() if isinstance(b, Tensor) and b.dim() != 0 else b for b in betas)
    return beta1, beta2


def _torch_fused(o: AdamOptions) -> tuple[Any, dict[str, Any]]:
    """torch's fused Adam or AdamW op, and its keyword arguments."""
    beta1, beta2 = o.betas
    fused = torch._fused_adamw_ if o.decoupled_weight_decay else torch._fused_adam_
    return fused, dict(
        lr=o.lr, beta1=beta1, beta2=beta2, eps=o.eps, weight_decay=o.weight_decay,
        amsgrad=o.amsgrad, maximize=o.maximize,
    )


_TENSOR_LR_WITH_FOREACH = ErrorInput(
    "tensor lr with foreach", dict(lr=torch.tensor(1e-3), foreach=True), ValueError,
    "lr as a Tensor is not supported",
)


OptimizerSpec(
    cls=Adam,
    summary="a drop-in for torch.optim.Adam; 8-bit states available",
    reference=torch.optim.Adam,
    configs=(
        Config(
            "amsgrad-betas-wd", dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, amsgrad=True)
        ),
        Config("wd", dict(lr=1e-2, weight_decay=0.1)),
    ),
    refusals=(_TENSOR_LR_WITH_FOREACH,),
)
OptimizerSpec(
    cls=AdamW,
    summary="a drop-in for torch.optim.AdamW; 8-bit states available",
    reference=torch.optim.AdamW,
    configs=(
        Config("default", dict(lr=1e-2, weight_decay=0.1)),
        Config("amsgrad-maximize", dict(lr=1e-2, amsgrad=True, maximize=True)),
    ),
    refusals=(_TENSOR_LR_WITH_FOREACH,),
)
