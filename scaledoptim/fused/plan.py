"""A fused step's plan: every param, grad and state entry validated, new state built on the side,
every update prepared (plan, then commit). The plan kept for the next step is ``cache.py``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from itertools import chain
from typing import Any, Protocol

import torch
from torch import Tensor

from ..kernels import PLAIN_TENSOR_TYPES, ROUNDING_LISTS
from ..protocol.clipping import clip_in_place_
from ..protocol.plans import PendingStep
from ..protocol.validation import check_param_grads
from ..torch_ops import PackedSteps, local_tensors, refuse_during_capture
from .backends import (
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
from .sharded import MeshAgreement, check_dtensor_update, kernels_take_shards
from .state import stage_state
from .update import Group, TensorLists, Update

__all__ = ["FusedStepPlan", "MasterWatch", "Planned", "build_plan"]

# The descriptors' getters, called directly: C-level map() over the params, no attribute lookup.
_DATA_PTR = Tensor.data_ptr
_VERSION: Callable[[Tensor], int] = vars(torch._C.TensorBase)["_version"].__get__


class Planned(Update, Protocol):
    """What the plan needs of a fused optimizer: its update, its groups and state, its device."""

    param_groups: list[Group]
    state: Any
    _master_watch: MasterWatch | None

    def _params_device(self) -> torch.device: ...

    def initial_state_fill(self) -> dict[str, float]: ...


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
        # DTensors stepped on their local shards by our kernels: what the ranks of their meshes
        # agree on (Note [DTensor steps on our kernels] in fused/sharded.py).
        self.mesh: MeshAgreement | None = None
        # Per backend, the inv_scale its updates must still apply once the grads are checked.
        self.left: dict[Backend, Tensor | None] = {}
        # See Note [param edits under master weights]: the masters, and those to resync first.
        self.masters: MasterWatch | None = None
        self.edited_masters: list[int] = []

    def part(self, backend: Backend) -> _Part:
        return self.parts.setdefault(backend, _Part())

    def unscale_grads_(
        self,
        found_inf: Tensor,
        inv_scale: Tensor,
        checked: frozenset[int] = frozenset(),
        norm_sq: Tensor | None = None,
    ) -> Tensor | None:
        mesh, own_sum = self.mesh, norm_sq
        if mesh is not None and norm_sq is not None:
            own_sum = mesh.own_sum(norm_sq)
            mesh.sum_of_squares_(self.grads, inv_scale, norm_sq)  # before any is unscaled
        for backend, part in self.parts.items():
            assert part.unscale is not None  # every part is prepared before the plan is returned
            self.left[backend] = part.unscale(
                found_inf, inv_scale, checked, part.grad_lists, own_sum
            )
        if mesh is not None:
            mesh.agree_(found_inf, norm_sq)
        return inv_scale

    def clip_grads_(self, coef: Tensor) -> None:
        # See Note [clipping in the step] in protocol/clipping.py: in the inv_scale an update
        # applies in registers, else in the grads the unscale left (the torch forms read those).
        for backend, part in self.parts.items():
            left = self.left.get(backend)
            if left is not None:
                self.left[backend] = left * coef
                continue
            grads = list(chain.from_iterable(part.grad_lists))
            if grads:
                clip_in_place_(grads, coef)

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


def build_plan(optimizer: Planned) -> FusedStepPlan:
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
    on_shards = False  # See Note [DTensor steps on our kernels] in fused/sharded.py
    if plan.over_subclasses:
        check_dtensor_update(optimizer, optimizer.param_groups)
        all_params = [p for group in optimizer.param_groups for p in group["params"]]
        on_shards = backend is not TORCH_NATIVE and kernels_take_shards(optimizer, all_params)
        if backend is not TORCH_NATIVE and not on_shards:
            # See Note [launchable tensors] in kernels/launcher.py: our kernels take plain tensors
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
        fill = optimizer.initial_state_fill()
        state_lists: TensorLists = [[] for key in keys if key is not None]
        steps = []
        for i, param in enumerate(params):
            counter_device = step_device(group, param) if i in routed else None
            tensors, step, replacement = stage_state(
                param, optimizer.state.get(param, {}), keys, counter_device, fill
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
        if on_shards:  # the kernels get plain local tensors; the state stays DTensors
            lists = [local_tensors(tensors) for tensors in lists]
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
        part.unscale = part_backend.prepare_unscale(part.grad_lists, part.updates)
        if reduction is not None:
            part.reduction = part_backend.prepare_reduction(reduction, part.grad_lists)
        part.epilogue = part_backend.prepare_epilogue(part.steps)
    if on_shards:
        plan.mesh = MeshAgreement(plan.params)
    plan.masters = MasterWatch.of(optimizer, plan.new_state)
    if plan.masters is not None:
        plan.edited_masters = plan.masters.edited(optimizer)
    return plan


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
    )


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
