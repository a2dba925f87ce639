"""DTensor params (FSDP2, tensor parallel), alone or beside plain params: the step runs over
their local shards, and what one shard cannot see alone is agreed over the params' meshes.

Note [DTensor steps on our kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each element of an elementwise update (``Update.elementwise``) reads only that element of its
param, grad and state, so a DTensor's update is its local shard's update (Note [tensor
subclasses] in backends/torch_native.py). On both backends the plan therefore hands the update
each DTensor's local tensor (``to_local()``: a plain tensor, a view of the DTensor's storage) of
its param, grad, state and fp32 master, so that our kernels, and torch's foreach and fused ops,
get plain tensors, also where DTensors and plain params share one optimizer (tensor parallel
leaves the modules it does not parallelize plain; torch's ops refuse a list that mixes the two).
The state stays a DTensor of the param's placements in ``optimizer.state`` (so DCP saves and
reshards it) and the update writes through its local tensor. ``check_launchable`` still checks
every tensor a table is built from (Note [launchable tensors] in kernels/launcher.py). What one
rank's shards cannot see alone:

* ``found_inf``: the read-only check sees this rank's shards only, so the plan's unscale ends
  with a MAX all-reduce of it over every dimension of each mesh of the step's params, on device
  (no host read), before the update or the scale reads it. Every rank of a mesh then skips the
  same steps and moves its scale alike, with or without ``process_group``; with it, the
  protocol's own MAX over ``process_group`` follows (MAX twice is the same MAX).
* the clip's sum of squares (``max_grad_norm``): each rank's check sums the squares of its
  shards. Where every param with a grad is sharded alike (FSDP2's ``Shard(0)``, HSDP's
  ``(Replicate(), Shard(0))``), that one sum is added up over the mesh dimensions that shard
  them (not a ``Replicate`` one, which holds whole tensors already). Params sharded differently
  (tensor parallel's ``Shard(0)``, ``Shard(1)`` and ``Replicate`` biases, or plain params beside
  DTensors) cannot share one sum: the step then takes each tensor's sum of squares of its
  unscaled local shard (foreach norms: one more read of the grads, on clipping steps only) and
  adds each over its own mesh dimensions (Note [sums over the mesh] in torch_ops/sharded.py).
  The protocol does not add the sum again over ``process_group`` (``sums_over_process_group``).

The rest takes torch's ops (the plan routes the whole step there): LAMB, whose kernels compute
each tensor's norms and use them for its trust ratio inside one launch sequence, with no point
between them where a sum could be added up over the mesh, gets the DTensors themselves (its torch
form sums over the mesh itself), and the agreement above, whose check reads their local tensors;
``Partial`` placements (values not summed yet) and every other tensor subclass go to torch's ops
as they are, and are refused beside plain params (one foreach op cannot take both), before
anything changes. A DTensor step is not cached (``StepCache.of``):
a DTensor's ``data_ptr()`` is 0, and checking its local tensors' pointers would take Python per
tensor at every step, about what the plan costs; each step plans in full, and the launcher
reuses its argument tables while the local tensors stay where they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..kernels import PLAIN_TENSOR_TYPES
from ..protocol.clipping import agree_on_sum_of_squares, norms_by_dtype
from ..scale import agree_on_found_inf
from ..torch_ops import LOW_PRECISION, MeshSums, local_tensors
from .update import Group, Update

__all__ = ["MeshAgreement", "check_dtensor_update", "steps_on_local_shards"]


def check_dtensor_update(update: Update, param_groups: list[Group]) -> None:
    """Raises, naming the param group or the fix, for DTensor params whose placements the
    update's sums over whole tensors cannot take (a ``Partial`` one, for an update that is not
    elementwise), and for tensor subclasses beside plain params that the step cannot take on
    local shards (Note [DTensor steps on our kernels])."""
    name = type(update).__name__
    if not update.elementwise:
        for index, group in enumerate(param_groups):
            try:
                # See Note [sums over the mesh] in torch_ops/sharded.py.
                MeshSums(list(group["params"]))
            except ValueError as error:
                raise ValueError(
                    f"{name}: param group {index}: {error}; nothing was changed"
                ) from None
            low = sorted(
                {
                    str(p.dtype)
                    for p in group["params"]
                    if type(p) not in PLAIN_TENSOR_TYPES and p.dtype in LOW_PRECISION
                }
            )
            if low:
                # Its torch form steps whole DTensors; the rounding back into 16-bit params
                # takes plain ops, which have no sharding strategy.
                raise ValueError(
                    f"{name}: param group {index}: {' and '.join(low)} DTensor params are not "
                    "supported by an update that is not elementwise; nothing was changed. Keep "
                    "the sharded params in float32 (FSDP2's MixedPrecisionPolicy(param_dtype="
                    "torch.bfloat16) computes in bf16 and keeps them so)"
                )
    params = [p for group in param_groups for p in group["params"]]
    others = [type(p).__name__ for p in params if type(p) not in PLAIN_TENSOR_TYPES]
    if (
        len(others) == len(params)
        or steps_on_local_shards(update, params)
        or (not update.elementwise and set(others) <= {"DTensor"})
    ):
        return
    raise ValueError(
        f"{name}'s params mix plain tensors and {sorted(set(others))}, which its step cannot take "
        "on local shards (a DTensor with a Partial placement, or another tensor subclass), and "
        "torch's ops refuse a list that mixes the two; nothing was changed. Step the plain "
        "params with an optimizer of their own, or make them DTensors too (e.g. "
        "nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))"
    )


def steps_on_local_shards(update: Update, params: list[Tensor]) -> bool:
    """Whether a step of ``params``, some of them tensor subclasses, runs on their local shards
    (Note [DTensor steps on our kernels]): an elementwise update, and every subclass a DTensor
    without a ``Partial`` placement whose local tensor is a plain tensor."""
    if not update.elementwise or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    for param in params:
        if type(param) in PLAIN_TENSOR_TYPES:
            continue
        if not isinstance(param, DTensor) or type(param.to_local()) not in PLAIN_TENSOR_TYPES:
            return False
        if any(placement.is_partial() for placement in param.placements):
            return False
    return True


class MeshAgreement:
    """What a step over the local shards of ``params`` (those with a grad) agrees on over their
    meshes: ``found_inf`` and the clip's sum of squares.

    Args:
        params: the step's params with a grad, plain tensors and DTensors (no ``Partial``).
    """

    def __init__(self, params: list[Tensor]) -> None:
        self.sums = MeshSums(params)
        groups: dict[int, Any] = {}  # in param order: every rank calls them in the same order
        for param in params:
            mesh = getattr(param, "device_mesh", None)
            if mesh is not None:
                for dim in range(mesh.ndim):
                    group = mesh.get_group(dim)
                    groups.setdefault(id(group), group)
        #: Every dimension's process group of every mesh, for the MAX of ``found_inf``.
        self.process_groups = list(groups.values())
        #: Whether every tensor is sharded alike: one sum of squares is added up as it is.
        self.alike = len(self.sums.groups) == 1 and len(self.sums.groups[0][1]) == len(params)

    def own_sum(self, norm_sq: Tensor | None) -> Tensor | None:
        """Where the check adds its sum of squares: ``norm_sq`` when every tensor is sharded
        alike, else nowhere (:meth:`sum_of_squares_` takes each tensor's)."""
        return norm_sq if self.alike else None

    def sum_of_squares_(self, grads: list[Tensor], inv_scale: Tensor, norm_sq: Tensor) -> None:
        """Adds to ``norm_sq`` the sum of squares of the unscaled ``grads`` (still scaled by
        ``1 / inv_scale``: before the unscale), each tensor's summed over its own mesh
        dimensions; for params sharded differently, before the check."""
        if self.alike or not grads:
            return
        local = local_tensors(grads)
        norms: list[Tensor] = [inv_scale] * len(local)
        for indices, same in norms_by_dtype(local, float64=False):  # in order, for the sums
            for i, norm in zip(indices, same):
                norms[i] = norm
        # unscaled before squaring: a scaled square can overflow where the unscaled one does not
        squares = (torch.stack(norms) * inv_scale).square()
        norm_sq.add_(self.sums.reduce_(squares).sum())

    def agree_(self, found_inf: Tensor, norm_sq: Tensor | None) -> None:
        """``found_inf`` MAX over every mesh, and the check's sum of squares (when every tensor
        is sharded alike) added up over the dimensions that shard them; on device."""
        if norm_sq is not None and self.alike:
            for group in self.sums.groups[0][0]:
                agree_on_sum_of_squares(norm_sq, group)
        for group in self.process_groups:
            agree_on_found_inf(found_inf, group)
