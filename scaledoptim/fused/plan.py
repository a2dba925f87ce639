"""A fused step's plan: every param, grad and state entry validated, new state built on the side,
every update prepared (plan, then commit); and the plan kept for the next step (the step cache).

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
from typing import Any, Protocol

import torch
from torch import Tensor

from ..kernels import PLAIN_TENSOR_TYPES, ROUNDING_LISTS, launch_config
from ..protocol.plans import PendingStep
from ..protocol.validation import check_param_grads
from ..torch_ops import PackedSteps, refuse_during_capture
from .backends import (
    KERNELS_ENV,
    TORCH_NATIVE,
    TORCH_OPTIM,
    Backend,
    PreparedEpilogue,
    PreparedReduction,
    PreparedUnscale,
    PreparedUpdate,
    select,
    step_device,
    torch_optim_indices,
)
from .rounding import (
    MASTER_KEY,
    check_rounding_options,
    check_rounding_params,
    is_master_of,
    resync_masters_,
    stage_rounding_state,
)
from .state import stage_state
from .update import Group, TensorLists, Update

__all__ = ["FusedStepPlan", "MasterWatch", "Planned", "StepCache", "plan_step"]

# The descriptors' getters, called directly: C-level map() over the params, no attribute lookup.
_GRAD: Callable[[Tensor], Any] = vars(torch._C.TensorBase)["grad"].__get__
_DATA_PTR = Tensor.data_ptr
_IS_CONTIGUOUS = Tensor.is_contiguous
_STRIDE = Tensor.stride
_DTYPE: Callable[[Tensor], torch.dtype] = vars(torch._C.TensorBase)["dtype"].__get__
_SIZE = Tensor.size
_VERSION: Callable[[Tensor], int] = vars(torch._C.TensorBase)["_version"].__get__
_DEVICE_INDEX = Tensor.get_device  # -1 on the CPU; cheaper than .device


class Planned(Update, Protocol):
    """What the plan needs of a fused optimizer: its update, its groups and state, its device."""

    param_groups: list[Group]
    state: Any
    _master_watch: MasterWatch | None

    def _params_device(self) -> torch.device: ...


def plan_step(
    optimizer: Planned, cache: StepCache | None
) -> tuple[FusedStepPlan, StepCache | None]:
    """This step's plan (from ``cache`` when nothing it depends on changed) and the cache for the
    next step."""
    if cache is not None:
        plan = cache.plan(optimizer)
        if plan is not None:
            return plan, cache
    plan = _build_plan(optimizer)
    return plan, StepCache.of(optimizer, plan)


# ----------------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class _Part:
    """What one backend runs in a step: its group updates, the grads they read (per group, in
    their params' layout), their step counters, the check (or unscale) of those grads, the
    update's grad reduction if any, and the epilogue over the counters."""

    updates: list[PreparedUpdate] = dataclasses.field(default_factory=list)
    grad_lists: list[list[Tensor]] = dataclasses.field(default_factory=list)
    steps: list[Tensor] = dataclasses.field(default_factory=list)
    unscale: PreparedUnscale | None = None
    reduction: PreparedReduction | None = None
    epilogue: PreparedEpilogue | None = None


@dataclasses.dataclass
class _GroupLists:
    """One group's part of a plan: the group, its params with a grad, its update's lists and the
    tensors of its scratch lists."""

    group: Group
    params: list[Tensor]
    lists: TensorLists
    scratch: list[Tensor]


class FusedStepPlan:
    """A fused step, validated: the prepared updates and the state they will create.

    ``params`` are the params with a grad and ``grads`` their grads as they are (the protocol's
    :class:`~scaledoptim.protocol.plans.StepPlan`).
    """

    def __init__(self, optimizer: Planned, backend: Backend) -> None:
        self.optimizer = optimizer
        self.backend = backend
        self.applies_scale_update = backend.applies_scale_update
        self.new_state: dict[Tensor, dict[str, Any]] = {}
        self.parts: dict[Backend, _Part] = {}
        self.params: list[Tensor] = []
        self.grads: list[Tensor] = []
        self.groups: list[_GroupLists] = []
        self.grads_copied = False  # a grad was copied into its param's layout
        self.over_subclasses = False  # a param is a tensor subclass (a DTensor, ...)
        # Per backend, the inv_scale its updates must still apply once the grads are checked.
        self.left: dict[Backend, Tensor | None] = {}
        # Note [param edits under master weights]: the masters, and those to resync first.
        self.masters: MasterWatch | None = None
        self.edited_masters: list[int] = []

    def part(self, backend: Backend) -> _Part:
        return self.parts.setdefault(backend, _Part())

    def unscale_grads_(
        self, found_inf: Tensor, inv_scale: Tensor, checked: frozenset[int] = frozenset()
    ) -> Tensor | None:
        for backend, part in self.parts.items():
            assert part.unscale is not None  # every part is prepared before the plan is returned
            self.left[backend] = part.unscale(found_inf, inv_scale, checked, part.grad_lists)
        return inv_scale

    def commit(self, pending: PendingStep) -> None:
        """Installs the new state, runs every update and the epilogue: only device errors can
        interrupt."""
        found_inf = pending.found_inf
        self.optimizer.state.update(self.new_state)
        masters = self.masters
        if masters is not None and self.edited_masters:
            resync_masters_(
                [masters.params[i] for i in self.edited_masters],
                [masters.masters[i] for i in self.edited_masters],
            )
        for backend, part in self.parts.items():
            left = self.left.get(backend, pending.inv_scale)
            if part.reduction is not None:
                part.reduction(found_inf, left, part.grad_lists)
            for update, grads in zip(part.updates, part.grad_lists):
                update(found_inf, left, grads)
        for backend, part in self.parts.items():
            assert part.epilogue is not None
            part.epilogue(found_inf, pending.scale_update if backend is self.backend else None)
        if masters is not None:
            masters.record(self.optimizer)


def _build_plan(optimizer: Planned) -> FusedStepPlan:
    """The step's plan from scratch: every param, grad and state entry validated, new state
    built on the side, every group's update, the grad reduction and the epilogue prepared."""
    device = optimizer._params_device()
    backend = select(device)
    plan = FusedStepPlan(optimizer, backend)
    plan.over_subclasses = any(
        type(p) not in PLAIN_TENSOR_TYPES
        for group in optimizer.param_groups
        for p in group["params"]
    )
    if plan.over_subclasses:
        _check_dtensor_update(optimizer)
        if backend is not TORCH_NATIVE:
            # Note [launchable tensors] in kernels/launcher.py: our kernels take plain tensors
            # only; torch's ops take a DTensor (or another subclass) as torch.optim gives it them.
            plan = FusedStepPlan(optimizer, TORCH_NATIVE)
            plan.over_subclasses = True
    seed_index = _seed_index(optimizer)
    rounds = optimizer.kernel.lists[-3:-1] == ROUNDING_LISTS
    for group in optimizer.param_groups:
        # Checked here, not at every step: what they depend on (the options' values and the
        # params' dtypes) sends a step through the full plan when it changes.
        check_rounding_options(group, rounds)
        check_rounding_params(group)
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            plan.groups.append(_GroupLists(group, params, [], []))
            continue
        # checks every param
        routed = torch_optim_indices(optimizer, group, params, any(route_key(optimizer, group)))
        check_param_grads(params, device)
        plan.params += params
        plan.grads += [p.grad for p in params]
        # Updates walk param, grad and state storage in lockstep, so a grad whose strides
        # differ from its param's is copied into the param's layout (torch 2.13's CPU fused
        # AdamW silently mixes up the elements of a transposed grad).
        # (torch.optim's implementation takes grads as they are: sparse ones have no strides.)
        grads = [
            p.grad
            if i in routed or p.grad.stride() == p.stride()
            else torch.empty_like(p, dtype=p.grad.dtype).copy_(p.grad)
            for i, p in enumerate(params)
        ]
        plan.grads_copied |= any(g is not p.grad for g, p in zip(grads, params))
        keys = optimizer.state_keys(group)
        state_lists: TensorLists = [[] for key in keys if key is not None]
        steps = []
        for i, param in enumerate(params):
            counter_device = step_device(group, param) if i in routed else None
            tensors, step, replacement = stage_state(
                param, optimizer.state.get(param, {}), keys, counter_device
            )
            for state_list, tensor in zip(state_lists, tensors):
                state_list.append(tensor)
            steps.append(step)
            if replacement is not None:
                plan.new_state[param] = replacement
        steps = _pack_counters(params, steps, plan.new_state, optimizer.state)
        scratch = optimizer.scratch_lists(group, params)
        rounding = _stage_rounding(optimizer, group, params, plan.new_state, seed_index)
        filled = iter(state_lists)
        state = [[] if key is None else next(filled) for key in keys]
        lists = [params, grads, *state, *scratch, *rounding, steps]
        plan.groups.append(_GroupLists(group, params, lists, list(chain.from_iterable(scratch))))
        for part_backend, picked in _split_by_support(plan.backend, params, routed):
            chosen = (
                lists
                if len(picked) == len(params)
                else [[t[i] for i in picked] if t else [] for t in lists]
            )
            part = plan.part(part_backend)
            chosen_scratch = list(
                chain.from_iterable(chosen[2 + len(keys) : 2 + len(keys) + len(scratch)])
            )
            part.updates.append(part_backend.prepare(optimizer, group, chosen, chosen_scratch))
            part.grad_lists.append(chosen[1])
            part.steps += chosen[-1]
    if plan.new_state:
        refuse_during_capture("Creating or converting optimizer state")
    plan.part(plan.backend)  # the device's backend ends the step (and moves the scale) always
    reduction = optimizer.grad_reduction(plan.grads) if plan.grads else None
    if reduction is not None and len(plan.parts) > 1:
        dtypes = sorted({str(p.dtype) for p in plan.params if not plan.backend.supports(p)})
        raise ValueError(
            f"{type(optimizer).__name__}'s update reduces over every grad of the step, but the "
            f"{plan.backend.name} backend cannot update {', '.join(dtypes)} params; use float32, "
            "float16 or bfloat16 params, or torch's ops for all of them (SCALEDOPTIM_KERNELS=torch)"
        )
    for part_backend, part in plan.parts.items():
        part.unscale = part_backend.prepare_unscale(part.grad_lists)
        if reduction is not None:
            part.reduction = part_backend.prepare_reduction(reduction, part.grad_lists)
        part.epilogue = part_backend.prepare_epilogue(part.steps)
    plan.masters = MasterWatch.of(optimizer, plan.new_state)
    if plan.masters is not None:
        plan.edited_masters = plan.masters.edited(optimizer)
    return plan


def _check_dtensor_update(optimizer: Planned) -> None:
    """Raises for DTensor params of an update that is not elementwise (Note [tensor
    subclasses] in backends/torch_native.py): its per-tensor reductions would need the mesh."""
    if optimizer.elementwise or not torch.distributed.is_available():
        return
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        for param in group["params"]:
            if isinstance(param, DTensor):
                raise TypeError(
                    f"{type(optimizer).__name__} cannot step DTensor params yet: its update "
                    "reduces over each whole tensor (norms), which a sharded param would need "
                    "reduced across its mesh; use an elementwise optimizer (AdamW, Adam, SGD, "
                    "Adagrad, RMSprop, Lion) for sharded params, or replicate them"
                )


def _pack_counters(
    params: list[Tensor],
    steps: list[Tensor],
    new_state: dict[Tensor, dict[str, Any]],
    state: dict[Tensor, dict[str, Any]],
) -> list[Tensor]:
    """A CPU group's step counters as views of one tensor (Note [packed counters] in
    torch_ops/skip.py), in ``new_state`` where they were not yet; other devices' as they are."""
    if any(step.device.type != "cpu" for step in steps):
        return steps  # kernels advance them in the update; CUDA's foreach op is one launch
    flat = steps[0]._base
    if (
        flat is not None
        and flat.dim() == 1
        and flat.dtype == torch.float32
        and flat.device.type == "cpu"
        and len(flat) == len(steps)
        and flat.is_contiguous()
        and all(step._base is flat for step in steps)
        and [step.storage_offset() for step in steps]
        == list(range(flat.storage_offset(), flat.storage_offset() + len(steps)))
    ):
        packed = PackedSteps(flat)
        packed[:] = steps  # the same objects as the state's
        return packed
    packed = PackedSteps(torch.stack([step.detach() for step in steps]))
    for param, counter in zip(params, packed):
        replacement = new_state.get(param)
        if replacement is None:
            replacement = new_state[param] = dict(state.get(param, {}))
        replacement["step"] = counter
    return packed


def _split_by_support(
    backend: Backend, params: list[Tensor], routed: set[int]
) -> list[tuple[Backend, list[int]]]:
    """The indices of ``params`` per backend: torch.optim's implementation for ``routed`` (Note
    [torch.optim route]), ``backend``'s, and torch's ops for the rest (those our kernels cannot
    take: torch.optim takes float64 params, so the fused optimizers do too)."""
    ours = [i for i, p in enumerate(params) if i not in routed and backend.supports(p)]
    others = [i for i, p in enumerate(params) if i not in routed and not backend.supports(p)]
    split = ((backend, ours), (TORCH_NATIVE, others), (TORCH_OPTIM, sorted(routed)))
    return [(b, picked) for b, picked in split if picked]


def _seed_index(optimizer: Planned) -> dict[Tensor, int]:
    """Each param's index among all of the optimizer's, which seeds its stochastic rounding;
    built only when a group asks for it."""
    if not any(group.get("stochastic_rounding", False) for group in optimizer.param_groups):
        return {}
    return {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}


def _stage_rounding(
    optimizer: Planned,
    group: Group,
    params: list[Tensor],
    new_state: dict[Tensor, dict[str, Any]],
    seed_index: dict[Tensor, int],
) -> TensorLists:
    """The kernel's ``master_params`` and ``sr_seeds`` lists for ``params`` (none for a kernel
    without them), recording created or dropped state entries in ``new_state``."""
    if optimizer.kernel.lists[-3:-1] != ROUNDING_LISTS:
        return []
    masters: list[Tensor] = []
    seeds: list[Tensor] = []
    for param in params:
        state = new_state.get(param, optimizer.state.get(param, {}))
        master, seed, changes = stage_rounding_state(param, state, group, seed_index.get(param, -1))
        if changes:
            updated = {**state, **changes}
            new_state[param] = {k: v for k, v in updated.items() if v is not None}
        if master is not None:
            masters.append(master)
        if seed is not None:
            seeds.append(seed.view(torch.float32))  # the kernel reads its bits
    return [masters, seeds]


def route_key(update: Update, group: Group) -> tuple[bool, bool]:
    """What of ``group``, besides its params, sends all of them to torch.optim's implementation
    (Note [torch.optim route] in backends/torch_optim.py): ``differentiable``, and a tensor
    hyper-parameter on an accelerator. Here, as the step cache re-checks it at every step."""
    if update.torch_optim is None:
        return False, False
    return bool(group.get("differentiable")), _holds_accelerator_tensor(group)


def _holds_accelerator_tensor(group: Group) -> bool:
    for key, value in group.items():
        if key == "params":
            continue
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, Tensor) and item.device.type != "cpu":
                return True
    return False


def lists_key(optimizer: Update, group: Group) -> tuple[Any, ...]:
    """What, besides the params and their state, decides a group's tensor lists (the value's type
    too: ``1`` is no valid ``master_weights`` though it equals ``True``) and its backends."""
    master, stochastic = group.get("master_weights", False), group.get("stochastic_rounding", False)
    return (
        optimizer.state_keys(group), type(master), master, type(stochastic), stochastic,
        route_key(optimizer, group),
    )  # fmt: skip


class MasterWatch:
    """The 16-bit params of ``master_weights`` groups that have an fp32 master, their masters,
    and (once a step committed) each param's version counter and data pointer after it: Note
    [param edits under master weights] in rounding.py."""

    def __init__(self, params: list[Tensor], masters: list[Tensor]) -> None:
        self.params = params
        self.masters = masters
        self.versions: list[int] | None = None
        self.pointers: list[int] | None = None
        # Where the params were when this step was planned: a commit does not move them.
        self._planned_pointers: list[int] | None = None

    @staticmethod
    def of(optimizer: Planned, new_state: dict[Tensor, dict[str, Any]]) -> MasterWatch | None:
        """Every param with a master after the step ``new_state`` creates, with or without a
        grad (an edit is followed whether or not the param is stepped)."""
        params, masters = [], []
        for group in optimizer.param_groups:
            if group.get("master_weights", False) is not True:
                continue
            for param in group["params"]:
                state = new_state.get(param) or optimizer.state.get(param, {})
                master = state.get(MASTER_KEY) if isinstance(state, dict) else None
                if is_master_of(master, param):
                    params.append(param)
                    masters.append(master)
        return MasterWatch(params, masters) if params else None

    def edited(self, optimizer: Planned) -> list[int]:
        """The indices of the params written by someone else since the optimizer's last step
        (their version counter or data pointer moved); none for a param it never recorded (a
        loaded or copied state: its master is the truth)."""
        pointers = self._planned_pointers = list(map(_DATA_PTR, self.params))
        last = optimizer._master_watch
        if last is None or last.versions is None or last.pointers is None:
            return []
        versions = list(map(_VERSION, self.params))
        recorded: list[tuple[int, int] | None]
        if last is self:  # the steady state: the same params, compared in C
            if versions == last.versions and pointers == last.pointers:
                return []
            recorded = list(zip(last.versions, last.pointers))
        else:  # the previous plan watched other params (the holder keeps their ids unique)
            known = dict(zip(map(id, last.params), zip(last.versions, last.pointers)))
            recorded = [known.get(id(p)) for p in self.params]
        return [
            i
            for i, (now, then) in enumerate(zip(zip(versions, pointers), recorded))
            if then is not None and now != then
        ]

    def record(self, optimizer: Planned) -> None:
        """Records the params as the step that just committed left them (torch's ops move
        their version counters; our kernels write through pointers and do not)."""
        self.versions = list(map(_VERSION, self.params))
        self.pointers = self._planned_pointers or list(map(_DATA_PTR, self.params))
        optimizer._master_watch = self


# ----------------------------------------------------------------------------- the step cache
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
        self.unscale = part.unscale
        self.reduction = part.reduction
        # Where every state value lives, in order: state moved to another param, replaced,
        # added, dropped or given other storage changes that sequence.
        self.state_ptrs = _state_pointers(optimizer.state)
        self.steps = part.steps
        self.epilogue = part.epilogue
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
        part = plan.part(self.backend)
        part.updates = [entry.update for entry in self.groups if entry.update is not None]
        part.grad_lists = grad_lists
        part.steps = self.steps
        part.unscale, part.reduction, part.epilogue = self.unscale, self.reduction, self.epilogue
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
