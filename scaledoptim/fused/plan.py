"""A fused step's plan: what each backend runs in a step (the check of the grads, the update, the
end of the step), kept for the next step and re-verified at every step; ``planning.py`` plans a
step in full. Also how an update reads its hyper-parameters at every step (the checks of their
values are in ``options.py``).

Note [step cache]
~~~~~~~~~~~~~~~~~
A step's plan (every check, the state lists, the kernel tables) rests on what is stable from step
to step: the params, their state, the options, sizes, dtypes and layouts. What changes is where
the grads live (``zero_grad(set_to_none=True)`` frees them). So :class:`StepCache` keeps the plan
and re-verifies, at every step and in passes done in C, each fact it reuses (the concepts page's
"What a kept plan re-verifies"): the params (objects, and layouts through torch.compile's
``TensorGuards``, which sees ``p.data = p.data[:k]`` or ``.t()``); which params have grads, and
the grads' layouts; the data pointers of the params, then of every state value, in order, in one
list; the groups and each option's value object (identity, not equality: ``1`` is no valid
``master_weights`` though it equals ``True``). All of it before any table is repointed to grads
at new pointers. A replaced value (a scheduler's new
``lr``) is validated again, as at a full plan; values that may change in place (tensors) at
every step; a change of ``lists_key`` plans in full. So whatever validating every option at
every step would refuse is refused (tests/fused/test_step_cache_mutations.py). Anything else
that differs plans the step in full, which raises the clear error if there is one. Not seen: a
state tensor reinterpreted in place at an unchanged data pointer, which cannot reach outside the
storage the plan validated. The cache keeps no grad alive.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from collections.abc import Callable
from itertools import chain, compress
from operator import is_
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor
from torch._C._dynamo.guards import TensorGuards

from ..kernels import launch_config
from ..protocol.clipping import clip_in_place_
from ..protocol.plans import check_param_groups
from ..protocol.values import GradPass
from ..torch_ops import restore_counters_, saved_counters
from .backends import (
    KERNELS_ENV,
    Backend,
    PreparedEpilogue,
    PreparedReduction,
    PreparedUnscale,
    PreparedUpdate,
)
from .rounding import MasterWatch
from .update import Group, Update, lists_key

__all__ = [
    "FusedStepPlan", "Part", "Planned", "StepCache", "declared_kernel_args", "hyperparameter",
    "read_options",
]

# The descriptors' getters, called directly: C-level map() over the params, no attribute lookup.
_GRAD: Callable[[Tensor], Any] = vars(torch._C.TensorBase)["grad"].__get__
_DATA_PTR = Tensor.data_ptr


class Planned(Update, Protocol):
    """What the plan needs of a fused optimizer: its update, its groups and state, its device."""

    param_groups: list[Group]
    state: Any
    _master_watch: MasterWatch | None

    def _params_device(self) -> torch.device: ...


@dataclasses.dataclass
class Part:
    """What one backend runs in a step: its group updates, their grads, params and counters (per
    group; the counters also all together), the check, the grad reduction and the epilogue."""

    updates: list[PreparedUpdate] = dataclasses.field(default_factory=list)
    grad_lists: list[list[Tensor]] = dataclasses.field(default_factory=list)
    param_lists: list[list[Tensor]] = dataclasses.field(default_factory=list)
    step_lists: list[list[Tensor]] = dataclasses.field(default_factory=list)
    steps: list[Tensor] = dataclasses.field(default_factory=list)
    unscale: PreparedUnscale | None = None
    reduction: PreparedReduction | None = None
    epilogue: PreparedEpilogue | None = None


class FusedStepPlan:
    """A fused step, validated (the protocol's ``StepPlan``): its parts, one per backend, and the
    state they will create. ``params`` are the params with a grad, ``grads`` their grads."""

    def __init__(self, optimizer: Planned, backend: Backend) -> None:
        self.optimizer = optimizer
        self.backend = backend  # the device's: it ends the step and moves the scale
        self.parts: dict[Backend, Part] = {}
        self.params: list[Tensor] = []
        self.grads: list[Tensor] = []
        self.new_state: dict[Tensor, dict[str, Any]] = {}
        # Set by planning.py: what the step cache cannot keep, the groups it keeps, the meshes our
        # kernels agree over (Note [DTensor steps on our kernels] in sharded.py), the masters.
        self.grads_copied = False
        self.over_subclasses = False
        self.groups: list[tuple[Group, list[Tensor]]] = []
        self.mesh: Any = None
        self.masters: MasterWatch | None = None
        self.edited_masters: list[int] = []
        self.done = 0  # the group updates that ran (Note [atomic step])

    def part(self, backend: Backend) -> Part:
        return self.parts.setdefault(backend, Part())

    def check(
        self,
        found_inf: Tensor,
        inv_scale: Tensor | None,
        checked: frozenset[int],
        norm_sq: Tensor | None,
        unscaled: list[list[Tensor]],
    ) -> tuple[tuple[list[list[Tensor]], bool], ...]:
        assert inv_scale is not None  # the pipeline checks scaled grads, or ones to clip
        mesh, own_sum = self.mesh, norm_sq
        if mesh is not None and norm_sq is not None:
            own_sum = mesh.own_sum(norm_sq)
            mesh.sum_of_squares_(self.grads, inv_scale, norm_sq)  # before any is unscaled
        grads = []
        for part in self.parts.values():
            assert part.unscale is not None  # every part is prepared before the plan is used
            left = part.unscale(found_inf, inv_scale, checked, part.grad_lists, own_sum, unscaled)
            grads.append((part.grad_lists, left is not None))
        if mesh is not None:
            mesh.agree_(found_inf, norm_sq)
        return tuple(grads)

    def clip(self, grad_pass: GradPass, coef: Tensor) -> GradPass:
        # See Note [clipping in the step] in protocol/clipping.py: in the inv_scale an update
        # applies in registers, else in the grads the check unscaled (the torch forms read those).
        for grad_lists, scaled in grad_pass.grads or ():
            grads = list(chain.from_iterable(grad_lists))
            if grads and not scaled:
                clip_in_place_(grads, coef)
        inv_scale = grad_pass.inv_scale
        clipped = None if inv_scale is None else inv_scale * coef
        return dataclasses.replace(grad_pass, inv_scale=clipped)

    def update(self, grad_pass: GradPass) -> None:
        # See Note [atomic step] in protocol/steps.py: `done` counts the group updates that ran,
        # so that the pending step a failure leaves runs the rest (a part's reduction too, if
        # none of its updates ran). The torch forms advance their counters with the math: the
        # failing group's are put back. Our kernels' epilogue advances them at commit.
        found_inf = grad_pass.found_inf if grad_pass.skip else None
        if self.masters is not None and self.edited_masters:
            self.masters.resync_(self.edited_masters)  # (again by the rest: a no-op)
        task, passes = 0, self._grads(grad_pass)
        for (backend, part), (grad_lists, scaled) in zip(self.parts.items(), passes):
            inv_scale = grad_pass.inv_scale if scaled else None
            if part.reduction is not None and task >= self.done:
                part.reduction(found_inf, inv_scale, grad_lists)
            counters = not backend.applies_scale_update
            for update, grads, steps in zip(part.updates, grad_lists, part.step_lists):
                if task >= self.done:
                    saved = saved_counters(steps) if counters else None
                    try:
                        update(found_inf, inv_scale, grads)
                    except BaseException:
                        restore_counters_(steps, saved)
                        raise
                    self.done += 1
                task += 1

    def commit(self, grad_pass: GradPass) -> None:
        self.optimizer.state.update(self.new_state)
        found_inf = grad_pass.found_inf if grad_pass.skip else None
        for backend, part in self.parts.items():
            assert part.epilogue is not None
            part.epilogue(found_inf, grad_pass.scale_update if backend is self.backend else None)
        if self.masters is not None:
            self.masters.record(self.optimizer)

    def settle(self, grad_pass: GradPass) -> GradPass | None:
        if self.done:  # the rest of the update, by the pending step (Note [atomic step])
            return dataclasses.replace(grad_pass, partial=self)
        # See Note [atomic step] in protocol/steps.py: the user's grads the check wrote (unscaled
        # in place: those still in a part's lists) make the pass pending; the others are made
        # what unscale() leaves (unscaled by what the update would have applied, or copied
        # from the unscaled copies the update would have read).
        grads = list(zip(self.parts.values(), self._grads(grad_pass)))
        if not any(
            any(map(is_, gs, map(_GRAD, ps)))
            for part, (grad_lists, scaled) in grads
            if not scaled
            for gs, ps in zip(grad_lists, part.param_lists)
        ):
            return None
        for part, (grad_lists, scaled) in grads:
            for gs, ps in zip(grad_lists, part.param_lists):
                for grad, user in zip(gs, map(_GRAD, ps)):
                    if scaled:
                        user.mul_(grad_pass.inv_scale)
                    elif grad is not user:
                        user.copy_(grad)
        return dataclasses.replace(grad_pass, inv_scale=None, grads=None)

    def _grads(self, grad_pass: GradPass) -> tuple[tuple[list[list[Tensor]], bool], ...]:
        """The pass's grads per part, or this plan's own, unscaled already (a pending pass)."""
        if grad_pass.grads is not None:
            return grad_pass.grads
        return tuple((part.grad_lists, False) for part in self.parts.values())


# ------------------------------------------------------------------------------- the kept plan
def _layout_guard(tensors: list[Tensor]) -> TensorGuards:
    """A check, in one C++ pass, that tensors have the exact type, dispatch keys, dtype, device,
    requires_grad, shape and strides of ``tensors`` now (torch.compile's guard on its inputs)."""
    # One list of dims per tensor, as torch.compile passes them (the stub says one list).
    sizes: Any = [list(t.size()) for t in tensors]
    strides: Any = [list(t.stride()) for t in tensors]
    return TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)


_IMMUTABLE = (bool, int, float, str, type(None))


def _settled(value: Any) -> bool:
    """Whether an option's value cannot change in place (numbers, strings, tuples of them)."""
    if isinstance(value, tuple):
        return all(isinstance(item, _IMMUTABLE) for item in value)
    return isinstance(value, _IMMUTABLE)


class _GroupEntry:
    """One param group's part of a cached step (Note [step cache]): what was validated and its
    prepared update."""

    def __init__(
        self, optimizer: Planned, group: Group, params: list[Tensor], update: PreparedUpdate | None
    ) -> None:
        self.group = group
        self.lists_key = lists_key(optimizer, group)
        self.remember_options(group)
        with_grad = {id(p) for p in params}
        self.without_grad = [i for i, p in enumerate(group["params"]) if id(p) not in with_grad]
        self.params = params
        self.param_layouts = _layout_guard(params)
        grads = list(map(_GRAD, params))
        self.grad_ptrs = list(map(_DATA_PTR, grads))
        self.grad_layouts = _layout_guard(grads)
        self.update = update

    def remember_options(self, group: Group) -> None:
        self.keys = tuple(group)
        self.values = list(group.values())
        self.settled = all(_settled(value) for key, value in group.items() if key != "params")

    def options_kept(self, group: Group) -> bool:
        """Whether every option of ``group`` is the value object validated (in C)."""
        return (
            self.settled
            and tuple(group) == self.keys
            and all(map(is_, group.values(), self.values))
        )

    def current(self, group: Group) -> tuple[list[Tensor], list[Tensor]] | None:
        """``(params, grads)``: the group's params with a grad and their grads, if they are the
        validated params, grads in the same places, all in the validated layouts, else ``None``
        (or a raise). Their pointers are :class:`StepCache`'s to compare."""
        params = group["params"]
        grads = list(map(_GRAD, params))
        if self.without_grad:
            if [i for i, g in enumerate(grads) if g is None] != self.without_grad:
                return None
            params = [p for p, g in zip(params, grads) if g is not None]
            grads = [g for g in grads if g is not None]
        # The same params with the same layout (the guard raises for another count); the grads'
        # layout against the validated grads', not their param's (a param pruned with its grad
        # still matches it); a grad that turned None or sparse fails the guard before data_ptr()
        # could raise.
        if (
            not all(map(is_, params, self.params))
            or not self.param_layouts.check(*params)
            or not self.grad_layouts.check(*grads)
        ):
            return None
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
            _GroupEntry(optimizer, group, params, next(updates) if params else None)
            for group, params in plan.groups
        ]
        # The part as it was built, without grads: each step's are bound in renew().
        self.part = dataclasses.replace(part, grad_lists=[], param_lists=[])
        # Where every param and state value lives, in order: any moved or replaced changes it.
        self.kept_ptrs = _kept_pointers([e.params for e in self.groups], optimizer.state)
        self.masters = plan.masters

    @staticmethod
    def of(optimizer: Planned, plan: FusedStepPlan) -> StepCache | None:
        """The cache of ``plan``, or ``None`` when the next step may not be planned the same way:
        state to create, two backends, grads copied into their param's layout, or tensor
        subclasses (a DTensor's ``data_ptr()`` is 0: no pointer could show it moved)."""
        if plan.new_state or plan.grads_copied or plan.over_subclasses or len(plan.parts) != 1:
            return None
        return StepCache(optimizer, plan)

    def renew(self, optimizer: Any) -> FusedStepPlan | None:
        """This step's plan from the cache, or ``None`` when anything it depends on changed.
        Raises for an option a full plan would refuse."""
        groups = optimizer.param_groups
        if (
            os.environ.get(KERNELS_ENV) != self.mode
            or launch_config.chunk_size != self.chunk_size
            or len(groups) != len(self.groups)
        ):
            return None
        for entry, group in zip(self.groups, groups):
            if group is not entry.group:
                return None
            if not entry.options_kept(group):
                check_param_groups(optimizer)
                optimizer._check_group(group)
                if lists_key(optimizer, group) != entry.lists_key:
                    return None
                entry.remember_options(group)
        param_lists, grad_lists, grad_ptrs = [], [], []
        try:
            if optimizer._params_device() != self.device:
                return None
            for entry, group in zip(self.groups, groups):
                current = entry.current(group)
                if current is None:
                    return None
                param_lists.append(current[0])
                grad_lists.append(current[1])
            if _kept_pointers(param_lists, optimizer.state) != self.kept_ptrs:
                return None
            for grads in grad_lists:
                grad_ptrs.append(list(map(_DATA_PTR, grads)))
            edited = self.masters.edited(optimizer) if self.masters is not None else []
        except (RuntimeError, TypeError, AttributeError, KeyError):
            return None
        # A null pointer with elements is a grad a kernel cannot read (Note [launchable tensors]
        # in kernels/launcher.py): the full plan refuses it. All checked before a table moves.
        for grads, pointers in zip(grad_lists, grad_ptrs):
            if 0 in pointers and any(p == 0 and g.numel() for p, g in zip(pointers, grads)):
                return None
        for entry, pointers in zip(self.groups, grad_ptrs):
            if pointers != entry.grad_ptrs:
                if entry.update is not None:
                    entry.update.repoint(pointers)
                entry.grad_ptrs = pointers
        pointers = grad_ptrs[0] if len(grad_ptrs) == 1 else list(chain.from_iterable(grad_ptrs))
        # The groups with grads (those the part was built with: its updates are this step's).
        param_lists = list(compress(param_lists, grad_lists))
        grad_lists = list(filter(None, grad_lists))
        plan = FusedStepPlan(optimizer, self.backend)
        plan.params = list(chain.from_iterable(param_lists))
        plan.grads = list(chain.from_iterable(grad_lists))
        plan.masters = self.masters
        plan.edited_masters = edited
        part = plan.parts[self.backend] = dataclasses.replace(
            self.part, grad_lists=grad_lists, param_lists=param_lists
        )
        assert part.unscale is not None
        part.unscale.repoint(pointers)
        if part.reduction is not None:
            part.reduction.repoint(pointers)
        return plan


def _kept_pointers(
    param_lists: list[list[Tensor]], state: dict[Tensor, dict[str, Any]]
) -> list[int]:
    """The data pointer of every param, then of every value of every param's state, in order
    (``TypeError`` for a state that is not a dict)."""
    values = chain.from_iterable(map(dict.values, state.values()))
    try:
        return list(map(_DATA_PTR, chain(chain.from_iterable(param_lists), values)))
    except TypeError:  # an entry a user added that is no tensor: no step reads it
        values = chain.from_iterable(map(dict.values, state.values()))
        state_ptrs = [v.data_ptr() if isinstance(v, Tensor) else id(v) for v in values]
        return list(map(_DATA_PTR, chain.from_iterable(param_lists))) + state_ptrs


# ------------------------------------------------------------------- reading a hyper-parameter
def hyperparameter(name: str, value: Any) -> Any:
    """A hyper-parameter as the update reads it: a Python number, or a one-element CPU tensor's
    current value (torch.optim accepts tensor ``lr``, ``betas``, SGD's ``weight_decay``; a
    scheduler updates the tensor in place, and reading a CPU tensor costs no device sync). A
    tensor on an accelerator is returned as it is: its group takes torch.optim's implementation,
    which reads it on device. Anything else is returned as is.

    Raises:
        ValueError: a tensor with more than one element (torch's message).
    """
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() != 1:
        raise ValueError(f"Tensor {name} must be 1-element")
    return value if value.device.type != "cpu" else value.item()


OptionsT = TypeVar("OptionsT")
_OPTION_READS: dict[type, tuple[tuple[str, bool], ...]] = {}


def read_options(options: type[OptionsT], group: Group) -> OptionsT:
    """The group's options as its update reads them at every step: an options dataclass
    (``fused/options.py``) whose fields declared ``tensor`` are read by :func:`hyperparameter`
    (a one-element CPU tensor as its current number)."""
    reads = _OPTION_READS.get(options)
    if reads is None:  # the fields of a class, listed once: read_options runs at every step
        fields = dataclasses.fields(options)  # type: ignore[arg-type]
        reads = tuple((f.name, bool(f.metadata.get("tensor"))) for f in fields)
        _OPTION_READS[options] = reads
    values = {}
    for name, tensor in reads:
        value = group[name]
        if tensor and isinstance(value, (tuple, list)):
            value = tuple(map(hyperparameter, (name,) * len(value), value))
        elif tensor:
            value = hyperparameter(name, value)
        values[name] = value
    return options(**values)


def declared_kernel_args(
    update: Any, group: Group, found_inf: int | None, inv_scale: int | None
) -> ctypes.Structure:
    """``FusedOptimizer.kernel_args`` unless a subclass overrides it: the kernel's argument
    struct for ``group``, the declared ``args`` of its ``options`` read (``found_inf`` and
    ``inv_scale``: device pointers, or ``None``)."""
    if update.args is None or update.options is None:
        raise NotImplementedError(f"{type(update).__name__} defines neither kernel_args nor args")
    return update.args(found_inf, inv_scale, read_options(update.options, group))
