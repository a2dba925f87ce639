"""The steady-state step of a fused optimizer: its plan kept from the last step and revalidated in
a few C-level passes over the params, instead of rebuilt.

A step's plan (every check, the state lists, the kernel tables) depends on what is stable from
step to step: the params, their state, the options that shape the lists, the sizes, dtypes and
layouts. What changes is where the grads live: ``zero_grad(set_to_none=True)`` frees them and
backward allocates new ones. So the cache compares the params' data pointers and the identities
of the state's values (list comparisons of ints, no per-tensor Python), checks every param's
and grad's layout, validates the grads' dtype, shape and device when one moved, and then, on
our kernels, writes the new grad pointers into the kept tables in bulk
(:meth:`~scaledoptim.kernels.PreparedLaunch.repoint`); on torch's ops it prepares the group
updates again over the kept lists (a closure each, no validation).
Anything else that differs (a param swapped or moved, state replaced or loaded, a group added,
an option that changes the lists, a grad of another layout, a sparse or missing grad) sends the
step through the full plan, which validates it, raises the clear error if there is one, and
builds a new cache.

The cache keeps no grad alive (a freed grad's memory must return to the allocator), only their
pointers. A grad at an unchanged pointer is trusted to keep its dtype, shape and device:
autograd and the ``.grad`` setter check them, and assigning a grad's ``.data`` a tensor with
other storage moves the pointer. (A ``.data`` view of a param's or grad's own storage with
another shape and the same layout would be updated as the flat array it is; one with another
layout is caught. A param replaced by another Parameter over the same storage keeps the old
one's state.) The cache keeps the state tensors, which the optimizer keeps anyway, so that their
ids cannot be reused while it holds them.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ..backends import Backend, PreparedUpdate
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
_IS_SAME_SIZE = Tensor.is_same_size
_DEVICE_INDEX = Tensor.get_device  # -1 on the CPU; cheaper than .device


class _GroupEntry:
    """One param group's part of a cached step: what was validated, its tensor lists without the
    grads, and its update when the grads' pointers can be rewritten in it."""

    def __init__(
        self,
        optimizer: FusedOptimizer,
        group: dict[str, Any],
        params: list[Tensor],
        lists: list[list[Tensor]],
        update: PreparedUpdate | None,
    ) -> None:
        grads = [p.grad for p in params]
        all_params = group["params"]
        self.group = group
        self.lists_key = optimizer._lists_key(group)
        with_grad = {id(p) for p in params}
        self.without_grad = [i for i, p in enumerate(all_params) if id(p) not in with_grad]
        self.params = params
        self.param_ptrs = list(map(_DATA_PTR, params))
        self.contiguous = all(map(_IS_CONTIGUOUS, params))
        self.strides = None if self.contiguous else list(map(_STRIDE, params))
        self.dtypes = list(map(_DTYPE, params))
        self.devices = list(map(_DEVICE_INDEX, params))
        self.grad_ptrs = list(map(_DATA_PTR, grads))
        # Every list but the grads (index 1), which the cache must not keep alive.
        self.lists = [tensors if i != 1 else [] for i, tensors in enumerate(lists)]
        # Our kernels' update, with tables of its own to repoint; other updates (torch's ops)
        # hold their lists, grads included, so they are prepared again at each step.
        self.update = (
            KernelUpdate(optimizer, group, update.launch.detached())
            if isinstance(update, KernelUpdate)
            else None
        )

    def prepared(self, optimizer: FusedOptimizer, backend: Backend, grads: list[Tensor]) -> PreparedUpdate:
        """The group's update over ``grads`` (validated by :meth:`current`)."""
        if self.update is not None:
            return self.update
        return backend.prepare(optimizer, self.group, [self.lists[0], grads, *self.lists[2:]])

    def current(
        self, optimizer: FusedOptimizer, group: dict[str, Any]
    ) -> tuple[list[Tensor], list[Tensor]] | None:
        """``(params, grads)``: the group's params with a grad and their grads, if the cached
        update still holds for them (repointed to where the grads live now), else ``None``. A
        surprise may raise instead: the caller's ``None``."""
        if group is not self.group or optimizer._lists_key(group) != self.lists_key:
            return None
        params = group["params"]
        grads = list(map(_GRAD, params))
        if self.without_grad:
            if [i for i, g in enumerate(grads) if g is None] != self.without_grad:
                return None
            params = [p for p, g in zip(params, grads) if g is not None]
            grads = [g for g in grads if g is not None]
        # (A grad that turned None fails below with a TypeError: the caller's None.) A param
        # replaced, added, dropped or moved to other storage changes the pointers.
        if list(map(_DATA_PTR, params)) != self.param_ptrs:
            return None
        # Params and grads keep the validated layout (``p.data = p.data.t()`` keeps the
        # pointer). Grads first: a sparse grad fails here, before data_ptr() could raise.
        if self.contiguous:
            if not (all(map(_IS_CONTIGUOUS, grads)) and all(map(_IS_CONTIGUOUS, params))):
                return None
        elif list(map(_STRIDE, grads)) != self.strides or list(map(_STRIDE, params)) != self.strides:
            return None
        pointers = list(map(_DATA_PTR, grads))
        if pointers != self.grad_ptrs:
            # New storage: autograd and the .grad setter check dtype, shape and device, but
            # assigning a grad's .data bypasses them, and the tables rely on them.
            # (is_same_size compares in C++; .shape would build a torch.Size per grad.)
            if (
                list(map(_DTYPE, grads)) != self.dtypes
                or not all(map(_IS_SAME_SIZE, grads, params))
                or list(map(_DEVICE_INDEX, grads)) != self.devices
            ):
                return None
            if self.update is not None:
                self.update.launch.repoint(1, pointers)  # lists are (params, grads, ...)
            self.grad_ptrs = pointers
        return params, grads


class StepCache:
    """A fused optimizer's last step plan, reusable while nothing it depends on changed (see the
    module notes)."""

    def __init__(self, optimizer: FusedOptimizer, plan: _FusedStepPlan) -> None:
        (part,) = plan.parts.values()
        self.backend = plan.backend
        self.device = optimizer._scaling().loss_scale.device
        self.chunk_size = launch_config.chunk_size
        updates = iter(part.updates)  # one per group with grads, in order
        self.groups = [
            _GroupEntry(optimizer, group, params, lists, next(updates) if params else None)
            for group, params, lists in plan.groups
        ]
        # Our kernels' check, with tables of its own; torch's unscale is prepared again.
        self.check = (
            part.unscale.launch.detached() if isinstance(part.unscale, KernelCheck) else None
        )
        # The state, compared by the identity of every value in order (walking the dicts, not
        # looking params up: a tensor key's hash is a Python call). State moved to another
        # param, replaced, added or dropped changes that sequence.
        self.state_values = _state_values(optimizer.state)
        self.state_ids = list(map(id, self.state_values))
        # What the check's tables point at. Kept apart from the groups' pointers: a step that
        # repointed one group and then fell back to the full plan left the check behind.
        self.grad_ptrs = list(chain.from_iterable(entry.grad_ptrs for entry in self.groups))
        self.steps = part.steps
        self.epilogue = part.epilogue

    @staticmethod
    def of(optimizer: FusedOptimizer, plan: _FusedStepPlan) -> StepCache | None:
        """The cache of ``plan``, or ``None`` when the next step may not be planned the same way:
        state still to create, params on two backends, grads copied into their param's layout,
        or an optimizer whose planning does more than build lists (LAMB tracks each step's
        grads for its global norm)."""
        if plan.new_state or plan.grads_copied or len(plan.parts) != 1:
            return None
        if not optimizer._plans_only_lists():
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
        param_lists, grad_lists = [], []
        try:
            if list(map(id, _state_values(optimizer.state))) != self.state_ids:
                return None
            for entry, group in zip(self.groups, optimizer.param_groups):
                current = entry.current(optimizer, group)
                if current is None:
                    return None
                params, grads = current
                if grads:
                    param_lists.append(params)
                    grad_lists.append(grads)
        except (RuntimeError, TypeError, AttributeError, KeyError):
            return None
        pointers = (
            self.groups[0].grad_ptrs
            if len(self.groups) == 1
            else list(chain.from_iterable(entry.grad_ptrs for entry in self.groups))
        )
        if pointers != self.grad_ptrs:
            if self.check is not None:
                self.check.repoint(0, pointers)
            self.grad_ptrs = pointers
        plan = _FusedStepPlan(optimizer, backend)
        plan.params = list(chain.from_iterable(param_lists))
        # A copy: torch's unscale replaces 16-bit grads in the backend's lists by fp32 copies.
        plan.grads = list(chain.from_iterable(grad_lists))
        part = plan.part(backend)
        entries = (entry for entry in self.groups if entry.params)
        part.updates = [entry.prepared(optimizer, backend, grads) for entry, grads in zip(entries, grad_lists)]
        part.grad_lists = grad_lists
        part.steps = self.steps
        part.unscale = (
            KernelCheck(self.check, grad_lists)
            if self.check is not None
            else backend.prepare_unscale(grad_lists)
        )
        part.epilogue = self.epilogue
        return plan


def _state_values(state: dict[Tensor, dict[str, Any]]) -> list[Any]:
    """Every value of every param's state, in order (``TypeError`` for a state that is not a
    dict)."""
    return list(chain.from_iterable(map(dict.values, state.values())))
