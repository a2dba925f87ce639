"""Clipping the global grad norm inside the step: ``unscale_and_step(..., max_grad_norm=c)``.

Note [clipping in the step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The arithmetic is :func:`torch.nn.utils.clip_grad_norm_`'s: ``total`` is the 2-norm of the
unscaled grads of all the optimizer's params, ``coef = clamp(c / (total + 1e-6), max=1)``, and the
update reads ``unscaled grad * coef``. The step never reads the norm on the host:

* the sum of squares of the unscaled grads comes from where the step reads the grads anyway: our
  kernels' read-only inf/nan check (cuda/non_finite_check.cu, in fp32, per-chunk partials added
  in a fixed order: Note [deterministic sums]); the torch forms and generic optimizers, whose
  grads are unscaled in place first, from foreach norms of the unscaled grads
  (:func:`sum_of_squares`); on a CPU, torch's fused Adam(W), SGD and Adagrad from the foreach
  norms of the scaled grads times ``inv_scale`` (Note [unscale in the update on a CPU] in
  fused/backends/routes.py);
* the parts of a step (two backends) and, under ``process_group``, the ranks add their sums on
  device (:func:`agree_on_sum_of_squares`), then ``total = sqrt(sum)``, which is
  :attr:`Optimizer.grad_norm <scaledoptim.Optimizer.grad_norm>`;
* our kernels get ``inv_scale * coef`` where they read ``inv_scale``: the clip rides in
  registers, the grads are neither written nor read again; torch's fused CPU updates get
  ``grad_scale = 1 / (inv_scale * coef)``; grads unscaled in place are multiplied by ``coef``
  in place, as ``clip_grad_norm_`` does after ``GradScaler.unscale_``.

One part's sum of squares from foreach norms is ``total ** 2`` with ``total`` computed as
``clip_grad_norm_`` computes it, and ``sqrt(total ** 2) == total`` exactly (correctly rounded
square and root, no overflow or underflow): on the torch forms a single-process step computes
the norm and ``coef`` exactly as ``GradScaler.unscale_`` + ``clip_grad_norm_`` do (a scale
that is a power of 2 scales every square exactly, so the scaled norm times ``inv_scale`` is the
same float); where the update divides by ``1 / (inv_scale * coef)`` instead of multiplying by
``inv_scale`` then ``coef``, the params differ from theirs in the last bits. A grad whose unscaled
square overflows float32 (an unscaled norm above about 1.8e19) makes the norm inf and ``coef`` 0.

A step that overflows (``found_inf``) leaves a non-finite norm and is skipped as always; with
``grads_scaled_by=None`` nothing is skipped, so non-finite grads make the params non-finite, as
``clip_grad_norm_`` does.

Under ``process_group``, plain grads need ``configure_scaling(grads_across_ranks=...)``: with
``"sharded"`` each rank's optimizer holds its own part of the model (FSDP1's flat shards,
ZeroRedundancyOptimizer) and the ranks' sums of squares are added; with ``"replicated"`` (DDP)
every rank holds the same grads of the whole model, whose norm is this rank's (added, it would
be sqrt(world size) times too large). Not said, the step cannot tell the two apart and refuses
to clip. DTensor grads (FSDP2, tensor
parallel) give the norm of the whole sharded tensors through their own reductions (over their
mesh, the same value on every rank of it), so their sum is not added again over
``process_group``: that would count it once per rank (the norm sqrt(world size) times too large).
An optimizer whose params mix DTensors and plain tensors under ``process_group`` is refused
(:func:`sums_over_process_group`): one sum could not be added for one part and not the other.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "agree_on_sum_of_squares",
    "check_grads_across_ranks",
    "clip_coefficient",
    "clip_in_place_",
    "norm_and_coefficient",
    "norms_by_dtype",
    "sum_of_squares",
    "sums_over_process_group",
    "to_max_grad_norm",
]

GRADS_ACROSS_RANKS = ("replicated", "sharded")


def to_max_grad_norm(max_grad_norm: Any) -> float | None:
    """``max_grad_norm`` as the step uses it: a finite Python float > 0, or ``None`` for no
    clipping (``None`` or ``0``, as the Trainer and nanoGPT write it). Converted here, so that
    nothing that passed can fail later for its type (a ``Fraction``, an int past int64).

    Raises:
        TypeError: not a Python number (a tensor, a bool, a string).
        ValueError: negative, nan, inf, or too large for a float.
    """
    if max_grad_norm is None:
        return None
    if isinstance(max_grad_norm, Tensor):
        raise TypeError(
            "max_grad_norm must be a Python float, got a tensor: validating it would read it on "
            "the host. Pass float(max_grad_norm) (or a number from your config)."
        )
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, Real):
        raise TypeError(
            f"max_grad_norm must be a positive float, or 0 or None (no clipping), got "
            f"{type(max_grad_norm).__name__} {max_grad_norm!r}; pass e.g. max_grad_norm=1.0"
        )
    try:
        value = float(max_grad_norm)  # numbers.Real: int, float, Fraction, numpy numbers
    except OverflowError:
        value = math.inf
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(
            f"Invalid max_grad_norm: {max_grad_norm}; it must be finite and >= 0 (the norm the "
            "grads are clipped to, e.g. 1.0; 0 or None: no clipping)"
        )
    return value or None


def sum_of_squares(grads: list[Tensor]) -> Tensor:
    """The squared 2-norm of all of ``grads`` as a 0-dim float32 tensor on their device, computed
    as :func:`torch.nn.utils.clip_grad_norm_` computes the norm (foreach norms per dtype, then
    the norm of those), squared (Note [clipping in the step]); no host read.

    Sparse grads count their coalesced values, complex ones their real view; the norm of DTensor
    grads is over the whole sharded tensors.
    """
    device = grads[0].device
    dense = []
    for grad in grads:
        if grad.is_sparse:
            grad = grad.coalesce()._values()
        if grad.is_complex():
            grad = torch.view_as_real(grad)
        dense.append(grad)
    # Stacked dtype by dtype, in the order clip_grad_norm_ stacks them (the sum's rounding).
    norms = [norm for _, same in norms_by_dtype(dense) for norm in same]
    total = torch.linalg.vector_norm(torch.stack(norms))
    full_tensor = getattr(total, "full_tensor", None)  # a DTensor: reduce over its mesh
    if full_tensor is not None:
        total = full_tensor()
    total = total.to(device=device, dtype=torch.float32)
    return total * total


def norms_by_dtype(
    grads: list[Tensor], float64: bool = True
) -> list[tuple[list[int], list[Tensor]]]:
    """The 2-norm of each of ``grads``, one foreach norm per dtype: for each dtype in the order
    of its first grad, the indices of its grads and their norms. 16-bit grads' norms are
    float32 (a 16-bit result would overflow, and round, where float32's does not), as
    :func:`torch.nn.utils.clip_grad_norm_` takes them; float64 grads' are float64 if
    ``float64``, else float32."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, grad in enumerate(grads):
        by_dtype.setdefault(grad.dtype, []).append(index)
    groups = []
    for dtype, indices in by_dtype.items():
        same = [grads[i] for i in indices]
        if dtype == torch.float32 or (float64 and dtype == torch.float64):
            groups.append((indices, list(torch._foreach_norm(same, 2.0))))
        else:
            norms = torch._foreach_norm(same, 2.0, dtype=torch.float32)
            groups.append((indices, list(norms)))
    return groups


def check_grads_across_ranks(grads_across_ranks: Any, process_group: Any) -> None:
    """Raises ``ValueError`` for a ``configure_scaling(grads_across_ranks=...)`` that is not one
    of ``None``, ``"replicated"``, ``"sharded"``, or that is given without ``process_group``."""
    if grads_across_ranks is None:
        return
    if not isinstance(grads_across_ranks, str) or grads_across_ranks not in GRADS_ACROSS_RANKS:
        raise ValueError(
            f"grads_across_ranks must be 'replicated' (DDP: every rank holds the same grads), "
            f"'sharded' (each rank's optimizer holds its own part of the model) or None, got "
            f"{grads_across_ranks!r}"
        )
    if process_group is None:
        raise ValueError(
            f"grads_across_ranks={grads_across_ranks!r} without process_group: it says how the "
            "grads relate across the group's ranks; pass process_group=dist.group.WORLD (or "
            "your group) with it, or drop it for single-process training"
        )


def sums_over_process_group(
    params: list[Tensor], process_group: Any, grads_across_ranks: str | None = None
) -> bool:
    """Whether the ranks' sums of squares are added over ``process_group``: not without one,
    not for DTensor params, whose sums are over their whole sharded tensors already, and for
    plain params as ``grads_across_ranks`` says (Note [clipping in the step]). Raises, before
    anything changes, for a mix of both kinds and for plain params it was not told about."""
    if process_group is None:
        return False
    sharded = [hasattr(p, "full_tensor") for p in params]
    if any(sharded) and not all(sharded):
        raise ValueError(
            "max_grad_norm with process_group and params that mix DTensors (FSDP2, tensor "
            "parallel) and plain tensors: the DTensors' norm is over their mesh already, the "
            "plain tensors' is added over process_group, and one step cannot do both. Shard "
            "every param (fully_shard the whole model), or give the plain params an optimizer "
            "of their own."
        )
    if any(sharded):
        return False
    if grads_across_ranks is None:
        raise ValueError(
            "max_grad_norm under process_group: the step cannot tell whether the ranks' grads are "
            "replicas of the whole model's (DDP: the norm is each rank's own) or parts of it (a "
            "sharded optimizer: the ranks' sums of squares are added). Say which: "
            "opt.configure_scaling(process_group=..., grads_across_ranks='replicated') under "
            "DDP, or grads_across_ranks='sharded' (ZeroRedundancyOptimizer, FSDP1's flat shards)"
        )
    return grads_across_ranks == "sharded"


def agree_on_sum_of_squares(norm_sq: Tensor, process_group: Any) -> None:
    """Adds the ranks' sums of squares in place (SUM over ``process_group``, on device, no host
    read; Note [found_inf agreement] in scale/distributed.py for the ``wait``)."""
    if process_group is None:
        return
    work = dist.all_reduce(norm_sq, op=dist.ReduceOp.SUM, group=process_group, async_op=True)
    work.wait()


def norm_and_coefficient(
    norm_sq: Tensor, max_grad_norm: float, process_group: Any
) -> tuple[Tensor, Tensor]:
    """The norm from this rank's sum of squares once the ranks' are added, and the clip factor
    (on device, no host read)."""
    agree_on_sum_of_squares(norm_sq, process_group)
    norm = norm_sq.sqrt()
    return norm, clip_coefficient(norm, max_grad_norm)


def clip_coefficient(norm: Tensor, max_grad_norm: float) -> Tensor:
    """``clamp(max_grad_norm / (norm + 1e-6), max=1)``, as :func:`torch.nn.utils.clip_grad_norm_`
    computes it (``nan`` for a ``nan`` norm, ``0`` for an infinite one)."""
    return torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)


def clip_in_place_(grads: list[Tensor], coef: Tensor) -> None:
    """``g *= coef`` for unscaled grads, as ``clip_grad_norm_`` does (a DTensor grad through its
    local shard: ``coef`` is the same on every rank)."""
    if not grads:
        return
    dense: dict[torch.dtype, list[Tensor]] = {}
    for grad in grads:
        to_local = getattr(grad, "to_local", None)
        if to_local is not None:
            grad = to_local()
        if grad.is_sparse:
            grad = grad._values()
        dense.setdefault(grad.dtype, []).append(grad)
    for same in dense.values():
        torch._foreach_mul_(same, coef.to(same[0].device))
