"""The step cache: a fused step's plan kept for the next step, and re-verified at every step.

Note [step cache]
~~~~~~~~~~~~~~~~~
A step's plan (every check, the state lists, the kernel tables) depends on what is stable from
step to step: the params, their state, the options that shape the lists, the sizes, dtypes and
layouts. What changes is where the grads live: ``zero_grad(set_to_none=True)`` frees them and
backward allocates new ones. So :class:`StepCache` keeps the plan and re-verifies, at every step,
each fact it reuses, in passes done in C (``map`` of a getter over the tensors, or one guard call
over a list; no per-tensor Python); a cache is never the only thing between a user's change and a
wrong value:

* params: the objects and their data pointer, and their layout: exact type, dtype, device, shape
  and strides (``p.data = p.data[:k]``, ``.view(torch.int32)`` or ``.t()`` keep the pointer);
* grads: which params have one, and their layout against the validated grads', not their
  param's (a param pruned together with its grad keeps them equal; ``g.data = g.data[:1]`` or
  a shrinking ``resize_`` at an unchanged pointer fails it too); once they moved (new storage),
  the kept tables are repointed to them (our kernels rewrite the grad pointers of their tables
  in bulk; torch's ops get the grads when they run);
* state: the data pointer of every value of every param's state, in order (walking the dicts, not
  looking params up: a tensor key's hash is a Python call): a value replaced, added or dropped,
  or a tensor given other storage (``state[k].data = new``, ``state[k].set_(...)``, a
  ``resize_`` that reallocates) changes that sequence;
* options: the group objects, the options that decide the lists (``lists_key``) and the
  backend choice (``SCALEDOPTIM_KERNELS``, the chunk size, the params' device); every option is
  validated and every hyper-parameter read at every step anyway.

The layout check is torch.compile's guard on its inputs (``TensorGuards`` of
``torch._C._dynamo.guards``, built from the validated tensors): one C++ pass that compares each
tensor's Python type, dispatch keys (under the thread's dispatch settings), dtype, device index,
``requires_grad``, sizes and strides with the recorded ones. It replaces four ``map`` passes for
the grads (dtype, shape, device, contiguity) and three for the params (dtype, shape, contiguity),
and is stricter than them: every fact they compared it compares too (exact strides imply the
validated contiguity), so whatever they refused it refuses. What it refuses besides (a grad whose
strides differ from the validated ones only in a size-1 dim, ``requires_grad`` toggled, a step
under ``torch.inference_mode()``) only sends that step through the full plan, which decides.
``_version`` could not replace any of it: ``p.data = p.data[:2]`` keeps the version counter,
the ``_cdata`` and the data pointer; only the layout shows it.

Anything that differs sends the step through the full plan, which validates it, raises the clear
error if there is one, and builds a new cache. What is not re-verified, because a check per
state tensor would cost as much again as the whole cached step: a state tensor reinterpreted in
place at an unchanged data pointer (``.data =`` a view of its own storage with another shape or
dtype, or an in-place ``t_()``/``as_strided_()``/shrinking ``resize_()``). That cannot reach
outside the storage the plan validated (a view never shrinks its storage).

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
from torch._C._dynamo.guards import TensorGuards

from ..kernels import launch_config
from .backends import KERNELS_ENV, PreparedUpdate
from .plan import FusedStepPlan, Planned, _GroupLists, lists_key
from .update import Group

__all__ = ["StepCache"]

# The descriptors' getters, called directly: C-level map() over the params, no attribute lookup.
_GRAD: Callable[[Tensor], Any] = vars(torch._C.TensorBase)["grad"].__get__
_DATA_PTR = Tensor.data_ptr


def _layout_guard(tensors: list[Tensor]) -> TensorGuards:
    """A check, in one C++ pass, that tensors have the exact type, dtype, device, shape and
    strides (and dispatch keys and requires_grad) of ``tensors`` as they are now (Note [step
    cache]: torch.compile's guard on its inputs' metadata)."""
    # One list of dims per tensor, as torch.compile passes them (the stub says one list).
    sizes: Any = [list(t.size()) for t in tensors]
    strides: Any = [list(t.stride()) for t in tensors]
    return TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)


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
        self.param_layouts = _layout_guard(params)
        grads = list(map(_GRAD, params))
        self.grad_ptrs = list(map(_DATA_PTR, grads))
        self.grad_layouts = _layout_guard(grads)
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
        # The same param objects (one replaced by another over the same storage has no state
        # yet; the entry keeps the validated ones, so their ids stay theirs), at the same
        # pointers (moved to other storage), with the same type, dtype, device, shape and
        # strides (a view of its own storage, ``p.data = p.data[:k]``, ``.view(torch.int32)`` or
        # ``.t()``, keeps the pointer). The grads with the validated ones, not their param's (a
        # param pruned with its grad still matches it: compare with those); a grad that turned
        # None is no tensor, a sparse one has other dispatch keys: both fail the guard before
        # data_ptr() could raise.
        if (
            not all(map(is_, params, self.params))
            or list(map(_DATA_PTR, params)) != self.param_ptrs
            or not self.param_layouts.check(*params)
            or not self.grad_layouts.check(*grads)
        ):
            return None
        pointers = list(map(_DATA_PTR, grads))
        if pointers != self.grad_ptrs:
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
