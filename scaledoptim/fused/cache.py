"""The step cache: a fused step's plan kept for the next step, and re-verified at every step.

Note [step cache]
~~~~~~~~~~~~~~~~~
A step's plan (every check, the state lists, the kernel tables) depends on what is stable from
step to step: the params, their state, the options that shape the lists, the sizes, dtypes and
layouts. What changes is where the grads live: ``zero_grad(set_to_none=True)`` frees them and
backward allocates new ones. So :class:`StepCache` keeps the plan and re-verifies, at every step,
each fact it reuses, in list comparisons done in C (``map`` of a getter over the tensors, no
per-tensor Python); a cache is never the only thing between a user's change and a wrong value:

* params: the objects, their data pointer, dtype, shape and strides (``p.data = p.data[:k]``
  or ``p.data = p.data.view(torch.int32)`` keep the pointer), and the device;
* grads: which params have one, their layout, and, once they moved (new storage), their dtype,
  shape and device against the validated ones, not their param's (a param pruned together with
  its grad keeps them equal); the kept tables are then repointed to them (our kernels rewrite the
  grad pointers of their tables in bulk; torch's ops get the grads when they run);
* state: the data pointer of every value of every param's state, in order (walking the dicts, not
  looking params up: a tensor key's hash is a Python call): a value replaced, added or dropped,
  or a tensor given other storage (``state[k].data = new``, ``state[k].set_(...)``, a
  ``resize_`` that reallocates) changes that sequence;
* options: the group objects, the options that decide the lists (``lists_key``) and the
  backend choice (``SCALEDOPTIM_KERNELS``, the chunk size, the params' device); every option is
  validated and every hyper-parameter read at every step anyway.

Anything that differs sends the step through the full plan, which validates it, raises the clear
error if there is one, and builds a new cache. What is not re-verified, because a check per
tensor would cost as much again as the whole cached step: a grad or state tensor reinterpreted
in place at an unchanged data pointer (``.data =`` a view of its own storage with another shape
or dtype, or an in-place ``t_()``/``as_strided_()``/shrinking ``resize_()``). That cannot reach
outside the storage the plan validated (a view never shrinks its storage), and grads from
autograd or the ``.grad`` setter always match their (verified) param.

The cache keeps no grad alive (a freed grad's memory must return to the allocator): prepared
updates hold none, only the kernels' tables their pointers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from itertools import chain
from operator import is_
from typing import Any

import torch
from torch import Tensor

from ..kernels import launch_config
from .backends import KERNELS_ENV, PreparedUpdate
from .plan import FusedStepPlan, Planned, _GroupLists, lists_key
from .update import Group

__all__ = ["StepCache"]

# The descriptors' getters, called directly: C-level map() over the params, no attribute lookup.
_GRAD: Callable[[Tensor], Any] = vars(torch._C.TensorBase)["grad"].__get__
_DATA_PTR = Tensor.data_ptr
_IS_CONTIGUOUS = Tensor.is_contiguous
_STRIDE = Tensor.stride
_DTYPE: Callable[[Tensor], torch.dtype] = vars(torch._C.TensorBase)["dtype"].__get__
_SIZE = Tensor.size
_VERSION: Callable[[Tensor], int] = vars(torch._C.TensorBase)["_version"].__get__
_DEVICE_INDEX = Tensor.get_device  # -1 on the CPU; cheaper than .device


class _GroupEntry:
    """One param group's part of a cached step (Note [step cache]): what was validated, its
    tensor lists without the grads, and its prepared update."""

    def __init__(
        self, optimizer: Planned, lists: _GroupLists, update: PreparedUpdate | None
    ) -> None:
        params = lists.params
        all_params = lists.group["params"]
        self.group = lists.group
        self.lists_key = lists_key(optimizer, lists.group)
        with_grad = {id(p) for p in params}
        self.without_grad = [i for i, p in enumerate(all_params) if id(p) not in with_grad]
        self.params = params
        self.param_ptrs = list(map(_DATA_PTR, params))
        self.dtypes = list(map(_DTYPE, params))
        self.sizes = list(map(_SIZE, params))
        self.contiguous = all(map(_IS_CONTIGUOUS, params))
        self.strides = None if self.contiguous else list(map(_STRIDE, params))
        self.devices = list(map(_DEVICE_INDEX, params))
        grads = list(map(_GRAD, params))
        self.grad_ptrs = list(map(_DATA_PTR, grads))
        self.grad_dtypes = list(map(_DTYPE, grads))
        self.update = update

    def current(self, optimizer: Planned, group: Group) -> tuple[list[Tensor], list[Tensor]] | None:
        """``(params, grads)``: the group's params with a grad and their grads, if the cached
        update still holds for them (now bound to where the grads live), else ``None``. A
        surprise may raise instead: the caller's ``None``."""
        if group is not self.group or lists_key(optimizer, group) != self.lists_key:
            return None
        params = group["params"]
        grads = list(map(_GRAD, params))
        if self.without_grad:
            if [i for i, g in enumerate(grads) if g is None] != self.without_grad:
                return None
            params = [p for p, g in zip(params, grads) if g is not None]
            grads = [g for g in grads if g is not None]
        # (A grad that turned None fails below with a TypeError: the caller's None.) The same
        # param objects (one replaced by another over the same storage has no state yet; the
        # entry keeps the validated ones, so their ids stay theirs), at the same pointers (moved
        # to other storage), with the same dtype and shape (a view of its own storage,
        # ``p.data = p.data[:k]`` or ``.view(torch.int32)``, keeps the pointer).
        if (
            list(map(_DATA_PTR, params)) != self.param_ptrs
            or not all(map(is_, params, self.params))
            or list(map(_DTYPE, params)) != self.dtypes
            or list(map(_SIZE, params)) != self.sizes
        ):
            return None
        # Params and grads keep the validated layout (``p.data = p.data.t()`` keeps the
        # pointer). Grads first: a sparse grad fails here, before data_ptr() could raise.
        if self.contiguous:
            if not (all(map(_IS_CONTIGUOUS, grads)) and all(map(_IS_CONTIGUOUS, params))):
                return None
        elif (
            list(map(_STRIDE, grads)) != self.strides or list(map(_STRIDE, params)) != self.strides
        ):
            return None
        pointers = list(map(_DATA_PTR, grads))
        if pointers != self.grad_ptrs:
            # New storage: autograd and the .grad setter check dtype, shape and device against
            # the param, but assigning a grad's .data bypasses them, and the tables rely on the
            # validated ones (a param pruned with its grad still matches it: compare with those).
            # (Size objects compare in C; is_same_size would parse arguments per grad.)
            if (
                list(map(_DTYPE, grads)) != self.grad_dtypes
                or list(map(_SIZE, grads)) != self.sizes
                or list(map(_DEVICE_INDEX, grads)) != self.devices
            ):
                return None
            # A null pointer with elements is a grad a kernel cannot read (Note [launchable
            # tensors] in kernels/launcher.py): the full plan refuses it before any table moves.
            if 0 in pointers and any(p == 0 and g.numel() for p, g in zip(pointers, grads)):
                return None
            if self.update is not None:
                self.update.repoint(pointers)
            self.grad_ptrs = pointers
        return params, grads


class StepCache:
    """A fused optimizer's last step plan, reusable while nothing it depends on changed (Note
    [step cache])."""

    def __init__(self, optimizer: Planned, plan: FusedStepPlan) -> None:
        (part,) = plan.parts.values()
        self.backend = plan.backend
        self.mode = os.environ.get(KERNELS_ENV)
        self.device = optimizer._params_device()
        self.chunk_size = launch_config.chunk_size
        updates = iter(part.updates)  # one per group with grads, in order
        self.groups = [
            _GroupEntry(optimizer, lists, next(updates) if lists.params else None)
            for lists in plan.groups
        ]
        # The plan's part as it was built (its updates, counters, check, reduction, epilogue),
        # without its grads: each step's are bound in plan() (and the cache keeps none alive).
        self.part = dataclasses.replace(part, grad_lists=[])
        # Where every state value lives, in order: state moved to another param, replaced,
        # added, dropped or given other storage changes that sequence.
        self.state_ptrs = _state_pointers(optimizer.state)
        self.masters = plan.masters

    @staticmethod
    def of(optimizer: Planned, plan: FusedStepPlan) -> StepCache | None:
        """The cache of ``plan``, or ``None`` when the next step may not be planned the same way:
        state still to create, params on two backends, grads copied into their param's layout,
        or params that are tensor subclasses (a DTensor's ``data_ptr()`` is 0, so the pointer
        comparisons of Note [step cache] could not see its storage, or its state's, move)."""
        if plan.new_state or plan.grads_copied or plan.over_subclasses or len(plan.parts) != 1:
            return None
        return StepCache(optimizer, plan)

    def plan(self, optimizer: Planned) -> FusedStepPlan | None:
        """This step's plan from the cache, or ``None`` when anything it depends on changed."""
        if (
            os.environ.get(KERNELS_ENV) != self.mode
            or launch_config.chunk_size != self.chunk_size
            or len(optimizer.param_groups) != len(self.groups)
        ):
            return None
        param_lists, grad_lists = [], []
        try:
            if optimizer._params_device() != self.device:
                return None
            if _state_pointers(optimizer.state) != self.state_ptrs:
                return None
            for entry, group in zip(self.groups, optimizer.param_groups):
                current = entry.current(optimizer, group)
                if current is None:
                    return None
                params, grads = current
                if grads:
                    param_lists.append(params)
                    grad_lists.append(grads)
            edited = self.masters.edited(optimizer) if self.masters is not None else []
        except (RuntimeError, TypeError, AttributeError, KeyError):
            return None
        # The check's pointers from every group's, each step: a step that repointed one group
        # and then fell back to the full plan (an error in a later group) left the check behind.
        pointers = (
            self.groups[0].grad_ptrs
            if len(self.groups) == 1
            else list(chain.from_iterable(entry.grad_ptrs for entry in self.groups))
        )
        plan = FusedStepPlan(optimizer, self.backend)
        plan.params = list(chain.from_iterable(param_lists))
        plan.grads = list(chain.from_iterable(grad_lists))
        plan.masters, plan.edited_masters = self.masters, edited
        # The same groups have grads as when the part was built (current() checked), so its
        # updates are this step's, one per grad list.
        part = plan.parts[self.backend] = dataclasses.replace(self.part, grad_lists=grad_lists)
        assert part.unscale is not None
        part.unscale.repoint(pointers)
        if part.reduction is not None:
            part.reduction.repoint(pointers)
        return plan


def _state_pointers(state: dict[Tensor, dict[str, Any]]) -> list[int]:
    """The data pointer of every value of every param's state, in order (``TypeError`` for a
    state that is not a dict)."""
    values = chain.from_iterable(map(dict.values, state.values()))
    try:
        return list(map(_DATA_PTR, values))
    except TypeError:  # an entry a user added that is no tensor: no step reads it
        return [
            v.data_ptr() if isinstance(v, Tensor) else id(v)
            for v in chain.from_iterable(map(dict.values, state.values()))
        ]
