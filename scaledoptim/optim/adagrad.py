"""Adagrad: the class, the kernel's arguments (cuda/adagrad.cu) and the torch form."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim.adagrad import adagrad as torch_adagrad

from ..fused import FusedOptimizer, check_tensor_hyperparameter
from ..fused.lowbit import check_state_bits
from ..fused.options import option, read_options
from ..fused.state import state_dtype
from ..kernels import (
    CUDA_SOURCE_DIR,
    ROUNDING_LISTS,
    MultiTensorKernel,
)
from ..torch_ops import PackedSteps, advance_steps_
from .spec import Config, ErrorInput, OptimizerSpec

__all__ = ["ADAGRAD_KERNEL", "Adagrad", "AdagradArgs", "AdagradOptions", "adagrad_args"]


@dataclasses.dataclass(frozen=True)
class AdagradOptions:
    """Adagrad's hyper-parameters: defaults, valid ranges, the tests' sweep.
    ``initial_accumulator_value`` is checked by the constructor alone (see :class:`Adagrad`)."""

    lr: float = option(
        1e-2, check="learning rate", tensor=True, sweep=(0.1,), draw=(1e-4, 1e-1)
    )
    lr_decay: float = option(0.0, check="lr_decay value", tensor=True, sweep=(0.0, 0.05))
    weight_decay: float = option(
        0.0, check="weight_decay value", tensor=True, sweep=(0.0, 0.1)
    )
    initial_accumulator_value: float = option(0.0, tensor=True, sweep=(0.1,))
    eps: float = option(1e-10, check="epsilon value", tensor=True, draw=(1e-10, 1e-3))
    maximize: bool = option(False, sweep=(False, True))


# ------------------------------------------------------------------------------ the kernel
class AdagradArgs(ctypes.Structure):
    """Mirror of ``AdagradArgs`` in cuda/adagrad.cu."""

    _fields_ = [
        ("found_inf", ctypes.c_void_p),
        ("inv_scale", ctypes.c_void_p),
        ("lr", ctypes.c_float),
        ("lr_decay", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("maximize", ctypes.c_int),
    ]


ADAGRAD_KERNEL = MultiTensorKernel(
    CUDA_SOURCE_DIR / "adagrad.cu",
    "adagrad_kernel",
    ("params", "grads", "state_sums", *ROUNDING_LISTS, "steps"),
    AdagradArgs,
    dtype_lists=(0, 1),
)


def adagrad_args(found_inf: int | None, inv_scale: int | None, o: AdagradOptions) -> AdagradArgs:
    """The kernel's arguments: device scalar pointers, and every host-side constant."""
    return AdagradArgs(found_inf, inv_scale, o.lr, o.lr_decay, o.weight_decay, o.eps, o.maximize)


# ------------------------------------------------------------------------------ the optimizer
class Adagrad(FusedOptimizer):
    r"""Adagrad with the loss-scaling protocol, a drop-in for :class:`torch.optim.Adagrad`.

    Same signature, same math, same state names (``sum``, ``step``), created when a param
    joins the optimizer as torch does: ``sum`` filled with the constructor's
    ``initial_accumulator_value``, in every param group. As in torch.optim.Adagrad (2.13), a
    group's own ``initial_accumulator_value`` (a group dict given to the constructor or to
    ``add_param_group``) is kept in the group, unchecked and unused; this matches torch
    rather than honouring it, which loses nothing (it is a starting value, not data). A param
    whose state is empty at a step (cleared, or dropped from a loaded state_dict) starts from
    the constructor's value too, as torch's does.
    Fused and sync-free; ``foreach`` and ``fused`` do not change the fused path. ``lr`` may be a
    one-element tensor (a CPU one is read at each step). Complex params, sparse grads, views
    with gaps, ``differentiable=True`` and an ``lr`` tensor on an accelerator take
    :func:`torch.optim.adagrad.adagrad` with the group's flags, in the same step (see
    the migration guide, "What takes torch.optim's own implementation"). State is fp32 whatever the
    param dtype.

    Args:
        params: iterable of parameters or dicts defining parameter groups.
        lr: learning rate.
        lr_decay: learning rate decay: step ``t`` uses ``lr / (1 + (t - 1) * lr_decay)``.
        weight_decay: weight decay (L2 penalty).
        initial_accumulator_value: initial value of the sum of squared gradients, for every
            param group (see above).
        eps: term added to the denominator for numerical stability.
        foreach: torch.optim's ``foreach`` flag, with its checks; the fused path does not
            depend on it (see above).
        maximize: maximize the objective instead of minimizing.
        differentiable: torch.optim's ``differentiable`` flag: ``True`` takes
            :func:`torch.optim.adagrad.adagrad` (see above).
        fused: torch.optim's ``fused`` flag, with its checks; the fused path does not
            depend on it (see above).
        master_weights: keep an fp32 master copy of 16-bit params (see
            :class:`~scaledoptim.FusedOptimizer`).
        stochastic_rounding: round bf16 params stochastically (see
            :class:`~scaledoptim.FusedOptimizer`).
        state_bits: 32 only: ``state_sum`` keeps float32 (8 raises, saying why).
        block_size: checked as the other optimizers check it; unused.
    """

    kernel = ADAGRAD_KERNEL
    rounds = True
    options = AdagradOptions
    args = staticmethod(adagrad_args)
    elementwise = True
    torch_update_takes_grad_scale = True
    torch_optim = torch.optim.Adagrad
    initial_state_options: ClassVar[dict[str, str]] = {"sum": "initial_accumulator_value"}
    _legacy_options: ClassVar[dict[str, Any]] = {
        "foreach": None, "maximize": False, "differentiable": False, "fused": None,
    }

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
        state_bits: int = 32,
        block_size: int = 256,
    ) -> None:
        # Checked here, not by check_options: only the constructor's value is used (see above).
        check_tensor_hyperparameter(
            "initial_accumulator_value value", "initial_accumulator_value",
            initial_accumulator_value,
        )
        check_state_bits(state_bits, block_size)
        if state_bits != 32:
            # Adagrad declares no 8-bit state (See Note [low-bit variants]).
            raise ValueError(
                "Adagrad keeps float32 states (state_bits=32): its state_sum is a sum, not an "
                "average; it only grows, each step's g**2 a shrinking part of it, and a sum "
                "keeps the rounding error of every step (an average forgets it): at 8 bits "
                "that error outgrows the late steps' increments. Use AdamW or RMSprop for 8-bit "
                "states"
            )
        defaults = dict(
            lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value, eps=eps, foreach=foreach,
            maximize=maximize, differentiable=differentiable, fused=fused,
            master_weights=master_weights, stochastic_rounding=stochastic_rounding,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As :meth:`torch.optim.Optimizer.add_param_group`, creating the group's state as
        torch.optim.Adagrad does in its constructor: ``sum`` filled with the constructor's
        ``initial_accumulator_value`` (not the group's: see the class)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        init = self.initial_state_fill()["sum"]
        fresh = [p for p in group["params"] if p not in self.state or not self.state[p]]
        # CPU counters packed as the step's plan would pack them (Note [packed counters]).
        counters = (
            PackedSteps(torch.zeros(len(fresh), dtype=torch.float32))
            if fresh and all(p.device.type == "cpu" for p in fresh)
            else [torch.zeros((), dtype=torch.float32, device=p.device) for p in fresh]
        )
        for param, counter in zip(fresh, counters):
            self.state[param] = {
                "step": counter,
                "sum": torch.full_like(
                    param,
                    complex(init, init) if param.is_complex() else init,
                    dtype=state_dtype(param),
                    memory_format=torch.preserve_format,
                ),
            }

    def check_torch_optim(self, group: dict[str, Any], params: list[Tensor]) -> None:
        if group["weight_decay"] != 0 and any(
            p.grad is not None and p.grad.is_sparse for p in params
        ):
            raise RuntimeError(
                "weight_decay option is not compatible with sparse gradients; pass "
                "weight_decay=0 for params with sparse grads (a param group of their own), or "
                "use a dense layer (nn.Embedding(sparse=False))"
            )

    def state_keys(self, group: dict[str, Any]) -> tuple[str | None, ...]:
        return ("sum",)

    def torch_update(
        self,
        group: dict[str, Any],
        tensor_lists: list[list[torch.Tensor]],
        found_inf: torch.Tensor | None,
        grad_scale: torch.Tensor | None = None,
    ) -> None:
        """torch's fused Adagrad (checked against torch.optim.Adagrad's single-tensor math on
        CPU, skips included), which reads the advanced counter and takes ``found_inf`` itself:
        Adagrad's single torch form, on every device."""
        params, grads, sums, steps = tensor_lists
        advance_steps_(steps, found_inf)
        o = read_options(AdagradOptions, group)
        torch._fused_adagrad_(
            params, grads, sums, steps, lr=o.lr, lr_decay=o.lr_decay,
            weight_decay=o.weight_decay, eps=o.eps, maximize=o.maximize, grad_scale=grad_scale,
            found_inf=found_inf,
        )

    def torch_optim_update(
        self,
        group: dict[str, Any],
        tensor_lists: list[list[torch.Tensor]],
        found_inf: torch.Tensor | None,
    ) -> None:
        """:func:`torch.optim.adagrad.adagrad`, called as ``torch.optim.Adagrad.step`` calls it."""
        params, grads, sums, steps = tensor_lists
        torch_adagrad(
            params, grads, sums, steps, fused=group["fused"], found_inf=found_inf,
            has_sparse_grad=any(g.is_sparse for g in grads), foreach=group["foreach"],
            differentiable=group["differentiable"], has_complex=any(map(torch.is_complex, params)),
            lr=group["lr"], weight_decay=group["weight_decay"], lr_decay=group["lr_decay"],
            eps=group["eps"], maximize=group["maximize"],
        )


OptimizerSpec(
    cls=Adagrad,
    summary="a drop-in for torch.optim.Adagrad",
    reference=torch.optim.Adagrad,
    configs=(
        Config("lr_decay-wd", dict(lr=0.1, lr_decay=0.01, weight_decay=0.01)),
        Config("plain", dict(lr=0.1)),
        Config(
            "every-option",
            dict(
                lr=0.1, lr_decay=0.05, weight_decay=0.1, initial_accumulator_value=0.2, eps=1e-3,
                maximize=True,
            ),
        ),
    ),
    refusals=(
        ErrorInput(
            "negative initial_accumulator_value",
            dict(initial_accumulator_value=-0.1),
            ValueError,
            "Invalid initial_accumulator_value",
        ),
    ),
)
