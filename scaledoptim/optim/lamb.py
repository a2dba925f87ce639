"""LAMB: the class, the kernels' arguments (cuda/lamb.cu) and the torch form, once."""

from __future__ import annotations

import ctypes
import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ..fused import FusedOptimizer
from ..fused.backends.in_place import tensor_batches_
from ..fused.options import option, read_options
from ..kernels import (
    CUDA_SOURCE_DIR,
    ROUNDING_LISTS,
    ChunkPartials,
    MultiTensorKernel,
    chunk_count,
)
from ..torch_ops import MeshSums, PackedSteps, scalars
from .spec import Config, OptimizerSpec, Tolerance, sweep

__all__ = [
    "LAMB", "LAMB_GRAD_NORM_KERNEL", "LAMB_KERNEL", "LAMB_NORMS_KERNEL", "LambArgs",
    "LambNormArgs", "LambOptions", "lamb_args",
]


@dataclasses.dataclass(frozen=True)
class LambOptions:
    """LAMB's hyper-parameters: defaults and valid ranges."""

    lr: float = option(1e-3, check="learning rate", draw=(1e-4, 1e-1))
    eps: float = option(1e-6, check="epsilon value")
    betas: tuple[float, float] = option((0.9, 0.999), check="beta parameter", high=1.0)
    weight_decay: float = option(0.01, check="weight_decay value")
    bias_correction: bool = option(True)
    max_grad_norm: float = option(1.0, check="max_grad_norm", low=-math.inf)
    adam_w_mode: bool = option(True)
    grad_averaging: bool = option(True)
    use_nvlamb: bool = option(False)


# ------------------------------------------------------------------------------ the kernels
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
        ("log_beta1", ctypes.c_float),
        ("log_beta2", ctypes.c_float),
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
        ("partials", ctypes.c_void_p),
        ("arrivals", ctypes.c_void_p),
        ("n_chunks", ctypes.c_uint),
    ]


_LISTS = (
    "params",
    "grads",
    "exp_avgs",
    "exp_avg_sqs",
    "param_sq_partials",
    "update_sq_partials",
    *ROUNDING_LISTS,
    "steps",
)
# See Note [deterministic sums] in cuda/block_sums.cuh: per-chunk partial sums (the
# ``_partials`` lists), added in chunk order.
_KERNEL_LISTS = dict(dtype_lists=(0, 1))
#: The update (the optimizer's ``kernel``): ``p -= lr * trust_ratio * update``.
LAMB_KERNEL = MultiTensorKernel(CUDA_SOURCE_DIR / "lamb.cu", "lamb_kernel", _LISTS, LambArgs,
                                **_KERNEL_LISTS)
#: The new moments, and per chunk the squared norms of params and updates, on the same lists.
LAMB_NORMS_KERNEL = MultiTensorKernel(CUDA_SOURCE_DIR / "lamb.cu", "lamb_norms_kernel", _LISTS,
                                      LambArgs, **_KERNEL_LISTS)
#: The squared global norm of the unscaled grads, through per-chunk partial sums.
LAMB_GRAD_NORM_KERNEL = MultiTensorKernel(CUDA_SOURCE_DIR / "lamb.cu", "lamb_grad_norm_kernel",
                                          ("grads", "grad_sq_partials"), LambNormArgs,
                                          dtype_lists=(0,))


def _log(beta: float) -> float:
    """log(beta) in double; -inf for 0 (the bias correction is then 1)."""
    return math.log(beta) if beta > 0 else -math.inf


def lamb_args(
    found_inf: int | None, inv_scale: int | None, grad_norm_sq: int, o: LambOptions
) -> LambArgs:
    """The kernels' arguments: device scalar pointers, and every host-side constant."""
    beta1, beta2 = o.betas
    return LambArgs(
        found_inf=found_inf, inv_scale=inv_scale, grad_norm_sq=grad_norm_sq, lr=o.lr, beta1=beta1,
        beta1_grad=1 - beta1 if o.grad_averaging else 1.0, beta2=beta2, one_minus_beta2=1 - beta2,
        eps=o.eps, weight_decay=o.weight_decay, max_grad_norm=o.max_grad_norm,
        log_beta1=_log(beta1), log_beta2=_log(beta2), bias_correction=o.bias_correction,
        adam_w_mode=o.adam_w_mode,
        trust_ratio=o.use_nvlamb or o.weight_decay != 0,
    )


# ------------------------------------------------------------------------------ the optimizer
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
    rounds = True
    options = LambOptions
    kernels_before = (LAMB_NORMS_KERNEL,)
    torch_form_in_place = True
    # Per-device buffers of the squared global grad norm and of its per-chunk partials, and
    # per-param scratch of the kernels' per-chunk partial norms: kept across steps so that the
    # kernels' tables stay cached (and a captured CUDA graph's pointers valid); created on first
    # use (copies and unpickled optimizers start without them).
    _grad_norms_sq: dict[torch.device, Tensor] | None = None
    _grad_partials: dict[torch.device, ChunkPartials] | None = None
    _norm_scratch: dict[Tensor, tuple[Tensor, Tensor]] | None = None

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
        )
        super().__init__(params, defaults)

    def state_keys(self, group: dict[str, Any]) -> tuple[str | None, ...]:
        return ("exp_avg", "exp_avg_sq")

    def scratch_lists(self, group: dict[str, Any], params: list[Tensor]) -> list[list[Tensor]]:
        if self._norm_scratch is None:
            self._norm_scratch = {}
        scratch = []
        for param in params:
            pair = self._norm_scratch.get(param)
            chunks = chunk_count(param.numel())
            if pair is None or pair[0].device != param.device or pair[0].numel() != chunks:
                pair = self._norm_scratch[param] = (
                    torch.zeros(chunks, device=param.device),
                    torch.zeros(chunks, device=param.device),
                )
            scratch.append(pair)
        return [[pair[0] for pair in scratch], [pair[1] for pair in scratch]]

    def grad_reduction(self, grads: list[Tensor]) -> _GlobalGradNorm:
        device = grads[0].device
        if self._grad_partials is None:
            self._grad_partials = {}
        chunks = sum(chunk_count(g.numel()) for g in grads)
        partials = self._grad_partials.get(device)
        if partials is None or partials.partials.numel() != chunks:
            partials = self._grad_partials[device] = ChunkPartials(chunks, device)
        return _GlobalGradNorm(self._grad_norm_sq(device), partials)

    def kernel_args(
        self, group: dict[str, Any], found_inf: int | None, inv_scale: int | None
    ) -> LambArgs:
        device = group["params"][0].device
        return lamb_args(
            found_inf, inv_scale, self._grad_norm_sq(device).data_ptr(),
            read_options(LambOptions, group),
        )

    def torch_form_(self, group: dict[str, Any], tensor_lists: list[list[Tensor]]) -> None:
        """The update in place and taken unconditionally, on grads unscaled and the squared
        global grad norm computed: the torch-native backend skips it, on the host on a CPU, else
        on working copies. Its math (:class:`_LambStep`) runs by the backend's batches of whole
        tensors (Note [batches of whole tensors] in fused/backends/in_place.py)."""
        params, grads, exp_avgs, exp_avg_sqs, _, _, steps = tensor_lists
        norm_sq = self._grad_norm_sq(params[0].device)
        options = read_options(LambOptions, group)
        tensor_batches_(
            lambda local: _LambStep(local[0], steps, norm_sq, options),
            [params, grads, exp_avgs, exp_avg_sqs],
        )

    def _grad_norm_sq(self, device: torch.device) -> Tensor:
        if self._grad_norms_sq is None:
            self._grad_norms_sq = {}
        buffer = self._grad_norms_sq.get(device)
        if buffer is None:
            buffer = self._grad_norms_sq[device] = torch.zeros((), device=device)
        return buffer


class _GlobalGradNorm:
    """LAMB's squared global grad norm over every grad of the step, into ``out``, through the
    per-chunk ``partials`` of those grads."""

    kernel = LAMB_GRAD_NORM_KERNEL

    def __init__(self, out: Tensor, partials: ChunkPartials) -> None:
        self.out = out
        self.partials = partials

    def tensor_lists(self, grads: list[Tensor]) -> list[list[Tensor]]:
        return [grads, self.partials.per_tensor(grads)]

    def kernel_args(self, found_inf: int | None, inv_scale: int | None) -> LambNormArgs:
        partials = self.partials
        return LambNormArgs(
            found_inf, inv_scale, self.out.data_ptr(), partials.partials.data_ptr(),
            partials.arrivals.data_ptr(), partials.partials.numel(),
        )

    def torch_form(self, grads: list[Tensor]) -> None:
        # In float32 at least (16-bit squares overflow); float64 grads (torch.optim takes
        # float64 params, and LAMB's torch form in float64 is its test reference) in float64.
        # See Note [sums over the mesh]: a DTensor grad's square is summed over its mesh.
        narrow = [g for g in grads if g.dtype != torch.float64]
        wide = [g for g in grads if g.dtype == torch.float64]
        squares = []
        for ts, dtype in ((narrow, torch.float32), (wide, torch.float64)):
            if ts:
                sums = MeshSums(ts)
                norms = torch.stack(torch._foreach_norm(sums.local(ts), 2, dtype=dtype))
                squares.append(sums.reduce_(norms.square()).sum())
        if squares:
            self.out.copy_(squares[0] if len(squares) == 1 else squares[0] + squares[1])
        else:
            self.out.zero_()


class _LambStep:
    """One LAMB step's math over batches (the torch form, run by the backend's driver: Note
    [batches of whole tensors] in fused/backends/in_place.py), its factors on device:
    scalars, the clipping divisor (0-dim), and 1-D tensors of one factor per param where it
    depends on the param's step count. The bias-corrected direction ``(m / bc1) / (sqrt(v /
    bc2) + eps)`` is ``k * m / (sqrt(v) + eps * sqrt(bc2))`` with ``k = sqrt(bc2) / bc1``, where
    ``k`` (and so the weight decay's ``wd / k``) cancels out of the trust ratio."""

    def __init__(
        self, params: list[Tensor], steps: list[Tensor], grad_norm_sq: Tensor, o: LambOptions
    ) -> None:
        (beta1, beta2), wd, lr = o.betas, o.weight_decay, o.lr
        self.clip = None
        if o.max_grad_norm > 0:
            self.clip = torch.clamp(grad_norm_sq.sqrt() / o.max_grad_norm, min=1.0)
        self.lr, self.weight_decay, self.beta1, self.beta2 = lr, wd, beta1, beta2
        self.l2 = not o.adam_w_mode and wd != 0
        self.grad_averaging = o.grad_averaging
        self.b1, self.b2 = scalars(params, beta1, beta2)
        counts = (steps.flat if isinstance(steps, PackedSteps) else torch.stack(steps)).double()
        root_bc2 = torch.ones_like(counts)
        k = root_bc2
        if o.bias_correction:
            root_bc2 = (1 - torch.pow(beta2, counts)).sqrt()
            k = root_bc2 / (1 - torch.pow(beta1, counts))
        dtype = params[0].dtype
        self.epsilons = (o.eps * root_bc2).to(dtype)
        self.step_sizes = (-lr * k).to(dtype)
        self.decays = (wd / k).to(dtype) if o.adam_w_mode and wd != 0 else None
        self.needs_norms = o.use_nvlamb or wd != 0  # the trust ratio

    def first_(self, lists: list[list[Tensor]], run: slice) -> list[Tensor]:
        """The new moments, in place, from the grads clipped (and with the L2 term: new tensors,
        the grads are the user's); returns the directions."""
        p, g, m, v = lists
        if self.clip is not None:
            g = list(torch._foreach_div(g, self.clip))
        if self.l2:
            g = list(torch._foreach_add(g, p, alpha=self.weight_decay))
        if self.grad_averaging:
            torch._foreach_lerp_(m, g, 1 - self.beta1)  # beta1 * m + (1 - beta1) * g in one pass
        else:
            torch._foreach_mul_(m, self.b1)
            torch._foreach_add_(m, g)
        torch._foreach_mul_(v, self.b2)
        torch._foreach_addcmul_(v, g, g, value=1 - self.beta2)
        return self.direction(lists, run)

    def direction(self, lists: list[list[Tensor]], run: slice) -> list[Tensor]:
        """``m / (sqrt(v) + eps * sqrt(bc2)) (+ wd / k * p)``: the direction over ``k``, new
        tensors."""
        p, _, m, v = lists
        u = list(torch._foreach_sqrt(v))
        torch._foreach_add_(u, list(self.epsilons[run].expand(len(u)).unbind()))
        torch._foreach_reciprocal_(u)
        torch._foreach_mul_(u, m)
        if self.decays is not None:
            torch._foreach_addcmul_(u, p, list(self.decays[run].expand(len(u)).unbind()))
        return u

    def last_(
        self, params: list[Tensor], directions: list[Tensor], norms: Tensor | None, run: slice
    ) -> None:
        """``p -= lr * ratio * u``: ``ratio = ||p|| / ||u||`` where both norms are non-zero (with
        the trust ratio), else 1 (times the bias correction's ``k``)."""
        factors = self.step_sizes[run]
        if norms is not None:
            p_norms, u_norms = norms[0], norms[1]
            ratios = (-self.lr * p_norms / u_norms).to(factors.dtype)
            factors = torch.where((p_norms > 0) & (u_norms > 0), ratios, factors)
        torch._foreach_addcmul_(params, directions, list(factors.unbind()))


OptimizerSpec(
    cls=LAMB,
    summary="You et al. (2020) with Apex FusedLAMB's semantics, for large batches",
    reference=None,
    # NVLAMB with clipping, L2 without bias correction, then the trust ratio's edge cases.
    configs=(
        Config("default", dict(lr=1e-2)),
        Config(
            "nvlamb-l2-no-averaging",
            dict(
                lr=1e-2, weight_decay=0.0, use_nvlamb=True, grad_averaging=False,
                max_grad_norm=0.5,
            ),
        ),
        Config(
            "l2-no-clip-no-bias-correction",
            dict(
                lr=1e-2, weight_decay=0.1, adam_w_mode=False, max_grad_norm=0.0,
                bias_correction=False,
            ),
        ),
        *sweep(
            Config("no-trust-ratio", dict(lr=1e-2, weight_decay=0.0)),
            Config(
                "norm-below-the-clip",
                dict(lr=1e-2, weight_decay=0.1, use_nvlamb=True, max_grad_norm=100.0),
            ),
        ),
    ),
    # The trust ratio divides norms summed in another order than float64's.
    tolerance=Tolerance(param_rtol=2e-6, param_atol=2e-6, state_rtol=1e-5),
    # Against a float64 reference, a 16-bit param that nearly cancels its update is off by
    # more than an ulp (the every-dtype tests hold them to one ulp at boundary sizes).
    mixed_param_dtypes=(torch.float32,),
)
