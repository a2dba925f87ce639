"""The steady-state step of a fused optimizer on the kernel backend: its plan kept from the last
step and revalidated in a few C-level passes over the params, instead of rebuilt.

A step's plan (every check, the state lists, the kernel tables) depends on what is stable from
step to step: the params, their state, the options that shape the lists, the sizes, dtypes and
layouts. What changes is where the grads live: ``zero_grad(set_to_none=True)`` frees them and
backward allocates new ones. So the cache compares identities and data pointers (list
comparisons of ints, no per-tensor Python), validates the grads' metadata only when a grad
moved, and then writes the new grad pointers into the kept tables in bulk
(:meth:`~scaledoptim.kernels.PreparedLaunch.repoint`). Anything else that differs (a param
swapped or moved, state replaced or loaded, a group added, an option that changes the lists, a
grad of another layout, a sparse or missing grad) sends the step through the full plan, which
validates it, raises the clear error if there is one, and builds a new cache.

The cache keeps no grad alive (a freed grad's memory must return to the allocator): it keeps
their pointers. A new grad at the old pointer (the allocator reuses blocks) needs nothing
rewritten; its dtype, shape and device are autograd's, and its layout is checked every step. It keeps the params and the state tensors, which the optimizer keeps
anyway, so that their ids cannot be reused by other objects while it holds them.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..backends import Backend
from ..backends.kernels import KernelCheck, KernelUpdate
from ..kernels.config import launch_config
from .step_plan import _FusedStepPlan

if TYPE_CHECKING:
    from .fused import FusedOptimizer

__all__ = ["StepCache"]

_GRAD = Tensor.grad.__get__
_DATA_PTR = Tensor.data_ptr
_IS_CONTIGUOUS = Tensor.is_contiguous
_STRIDE = Tensor.stride
_DTYPE = Tensor.dtype.__get__
_SHAPE = Tensor.shape.__get__
_DEVICE_INDEX = Tensor.get_device  # -1 on the CPU; cheaper than .device


class _GroupEntry:
    """One param group's part of a cached step: what was validated, and its update."""

    def __init__(
        self,
        optimizer: FusedOptimizer,
        group: dict[str, Any],
        params: list[Tensor],
        update: KernelUpdate | None,
    ) -> None:
        grads = [p.grad for p in params]
        all_params = group["params"]
        self.group = group
        self.lists_key = optimizer._lists_key(group)
        self.param_ids = list(map(id, all_params))
        with_grad = {id(p) for p in params}
        self.without_grad = [i for i, p in enumerate(all_params) if id(p) not in with_grad]
        self.params = params
        self.param_ptrs = list(map(_DATA_PTR, params))
        self.contiguous = all(map(_IS_CONTIGUOUS, params))
        self.strides = None if self.contiguous else list(map(_STRIDE, params))
        self.dtypes = list(map(_DTYPE, params))
        self.shapes = list(map(_SHAPE, params))
        self.devices = list(map(_DEVICE_INDEX, params))
        self.grad_ptrs = list(map(_DATA_PTR, grads))
        # None for a group without grads (frozen params), which has no update.
        self.update = None if update is None else KernelUpdate(optimizer, group, update.launch.detached())

    def current_grads(self, optimizer: FusedOptimizer, group: dict[str, Any]) -> list[Tensor] | None:
        """The group's grads if the cached update still holds for them (repointed to where they
        live now), else ``None``. Raises nothing a caller should see: any surprise is ``None``."""
        all_params = group["params"]
        if group is not self.group or list(map(id, all_params)) != self.param_ids:
            return None
        if optimizer._lists_key(group) != self.lists_key:
            return None
        grads = list(map(_GRAD, all_params))
        if self.without_grad:
            if [i for i, g in enumerate(grads) if g is None] != self.without_grad:
                return None
            grads = [g for g in grads if g is not None]
        # (A grad that turned None fails below with a TypeError: the caller's None.)
        if list(map(_DATA_PTR, self.params)) != self.param_ptrs:
            return None
        # Layout first: a sparse grad fails here, before data_ptr() could raise.
        if self.contiguous:
            if not all(map(_IS_CONTIGUOUS, grads)):
                return None
        elif list(map(_STRIDE, grads)) != self.strides:
            return None
        pointers = list(map(_DATA_PTR, grads))
        if pointers != self.grad_ptrs:
            # New storage: autograd and the .grad setter check dtype, shape and device, but
            # assigning a grad's .data bypasses them, and the tables rely on them.
            if (
                list(map(_DTYPE, grads)) != self.dtypes
                or list(map(_SHAPE, grads)) != self.shapes
                or list(map(_DEVICE_INDEX, grads)) != self.devices
            ):
                return None
            self.update.launch.repoint(1, pointers)  # lists are (params, grads, ...)
            self.grad_ptrs = pointers
        return grads


class StepCache:
    """A fused optimizer's last step plan on the kernel backend, reusable while nothing it
    depends on changed (see the module notes)."""

    def __init__(self, optimizer: FusedOptimizer, plan: _FusedStepPlan) -> None:
        (part,) = plan.parts.values()
        self.backend = plan.backend
        self.device = optimizer._scaling().loss_scale.device
        self.chunk_size = launch_config.chunk_size
        updates = iter(part.updates)  # one per group with grads, in order
        self.groups = [
            _GroupEntry(optimizer, group, params, next(updates) if params else None)
            for group, params in plan.groups
        ]
        self.check = part.unscale.launch.detached()
        # The state, compared by identity down to every tensor (walking the dicts in order,
        # not looking params up: a tensor key's hash is a Python call).
        self.state_keys = list(map(id, optimizer.state))
        self.state_dicts = list(map(id, optimizer.state.values()))
        self.state_values = _state_values(optimizer.state)
        self.state_ids = list(map(id, self.state_values))
        self.grad_ptrs = list(chain.from_iterable(entry.grad_ptrs for entry in self.groups))
        self.params = list(chain.from_iterable(entry.params for entry in self.groups))
        self.steps = part.steps
        self.epilogue = part.epilogue

    @staticmethod
    def of(optimizer: FusedOptimizer, plan: _FusedStepPlan) -> StepCache | None:
        """The cache of ``plan``, or ``None`` when its steady state is not the kernel backend's plain form: state still to
        create, params on two backends, grads copied into their param's layout, or an update
        of several launches."""
        if plan.new_state or plan.grads_copied or len(plan.parts) != 1:
            return None
        (part,) = plan.parts.values()
        if not isinstance(part.unscale, KernelCheck) or not all(
            isinstance(update, KernelUpdate) for update in part.updates
        ):
            return None
        return StepCache(optimizer, plan)

    def plan(self, optimizer: FusedOptimizer, backend: Backend) -> _FusedStepPlan | None:
        """This step's plan from the cache, or ``None`` when anything it depends on changed."""
        if (
            backend is not self.backend
            or launch_config.chunk_size != self.chunk_size
            or len(optimizer.param_groups) != len(self.groups)
            or optimizer._scaling().loss_scale.device != self.device
        ):
            return None
        state = optimizer.state
        grad_lists = []
        try:
            if (
                list(map(id, state)) != self.state_keys
                or list(map(id, state.values())) != self.state_dicts
                or list(map(id, _state_values(state))) != self.state_ids
            ):
                return None
            for entry, group in zip(self.groups, optimizer.param_groups):
                grads = entry.current_grads(optimizer, group)
                if grads is None:
                    return None
                if grads:
                    grad_lists.append(grads)
        except (RuntimeError, TypeError, AttributeError, KeyError):
            return None
        single = len(self.groups) == 1
        pointers = (
            self.groups[0].grad_ptrs
            if single
            else list(chain.from_iterable(entry.grad_ptrs for entry in self.groups))
        )
        if pointers != self.grad_ptrs:
            self.check.repoint(0, pointers)
            self.grad_ptrs = pointers
        plan = _FusedStepPlan(optimizer, backend)
        plan.params = self.params
        plan.grads = grad_lists[0] if single and grad_lists else list(chain.from_iterable(grad_lists))
        part = plan.part(backend)
        part.updates = [entry.update for entry in self.groups if entry.update is not None]
        part.grad_lists = grad_lists
        part.steps = self.steps
        part.unscale = KernelCheck(self.check, grad_lists)
        part.epilogue = self.epilogue
        return plan


def _state_values(state: dict[Tensor, dict[str, Any]]) -> list[Any]:
    """Every value of every param's state, in order (``TypeError`` for a state that is not a
    dict)."""
    return list(chain.from_iterable(map(dict.values, state.values())))
