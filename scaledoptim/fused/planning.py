"""A fused step planned in full: every param, grad and state entry validated, new state built on
the side, every update prepared (plan, then commit); ``plan.py`` keeps the plan for the next step.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import Tensor

from ..kernels import PLAIN_TENSOR_TYPES
from ..protocol.validation import check_param_grads
from ..torch_ops import PackedSteps, local_tensors, refuse_during_capture
from .backends import (
    TORCH_NATIVE,
    TORCH_OPTIM,
    Backend,
    select,
    step_device,
    torch_optim_indices,
)
from .plan import FusedStepPlan, Planned
from .rounding import (
    MasterWatch,
    check_rounding_options,
    check_rounding_params,
    stage_rounding_state,
)
from .sharded import MeshAgreement, check_dtensor_update, steps_on_local_shards
from .state import stage_state
from .update import Group, TensorLists, route_key

__all__ = ["build_plan"]


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
        on_shards = steps_on_local_shards(optimizer, all_params)
        if backend is not TORCH_NATIVE and not on_shards:
            # See Note [launchable tensors] in kernels/launcher.py: our kernels take plain tensors
            # only; torch's ops take a DTensor (or another subclass) as torch.optim gives it them.
            plan = FusedStepPlan(optimizer, TORCH_NATIVE)
            plan.over_subclasses = True
    seed_index = _seed_index(optimizer)
    rounds = optimizer.rounds
    fill = optimizer.initial_state_fill()
    for group in optimizer.param_groups:
        # Checked here, not at every step: what they depend on (the options' values and the
        # params' dtypes) sends a step through the full plan when it changes.
        check_rounding_options(group, rounds)
        check_rounding_params(group)
        params = [p for p in group["params"] if p.grad is not None]
        plan.groups.append((group, params))
        if not params:
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
        layouts = optimizer.state_layouts(group)
        state_lists: TensorLists = [[] for key in keys if key is not None]
        steps = []
        for i, param in enumerate(params):
            counter_device = step_device(group, param) if i in routed else None
            tensors, step, replacement = stage_state(
                param, optimizer.state.get(param, {}), keys, counter_device, layouts, fill
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
        if on_shards:  # the update gets plain local tensors; the state stays DTensors
            lists = [local_tensors(tensors) for tensors in lists]
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
            part.param_lists.append(chosen[0])
            part.step_lists.append(chosen[-1])
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
    if on_shards or (plan.over_subclasses and not optimizer.elementwise):
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
    if not optimizer.rounds:
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


