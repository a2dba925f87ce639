"""``FusedOptimizer``: the public base of optimizers whose update is one multi-tensor op that
reads ``found_inf`` on device, so that skipping an overflowed step needs no host sync."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from ..backends import Backend, select
from ..kernels.rounding import ROUNDING_LISTS
from ..kernels.spec import MultiTensorKernel
from ..optimizer import Optimizer
from ..validation import check_param_grads, check_param_groups, refuse_during_capture
from .rounding import check_rounding_options, check_rounding_params, stage_rounding_state
from .state import cast_loaded_state, check_param, stage_state
from .step_cache import StepCache
from .step_plan import PENDING as _PENDING
from .step_plan import _FusedStepPlan, _split_by_support

__all__ = ["FusedOptimizer", "check_hyperparameter"]

# The optimizer's StepCache (step_cache.py): not pickled, as torch.optim pickles only its
# defaults, state and param groups.
_STEP_CACHE = "_scaledoptim_step_cache"


class FusedOptimizer(Optimizer):
    r"""Base of scaledoptim's fused optimizers, and of yours: subclass it, declare the state,
    point it at a kernel.

    A subclass defines:

    * ``kernel``: a ``scaledoptim.kernels.MultiTensorKernel`` whose tensor lists are
      ``(params, grads, *state lists, steps)``; the docs' kernel-author guide, *Writing a fused
      kernel* (``docs/kernels.md``), builds one.
    * ``_state_keys(group)``: the names of the per-param state tensors, in the order of the
      kernel's state lists (``None`` for a list the group's options turn off). They are created
      as float32 zeros shaped like the param; ``state["step"]`` (a 0-dim float32 tensor
      counting taken steps) is added and advanced for every optimizer.
    * ``_check_options(options)``: validates hyper-parameters (a dict of them); called by the
      constructor and on every param group before every step.
    * ``_kernel_args(group, found_inf, inv_scale)``: the kernel's argument struct for a group
      (``found_inf``/``inv_scale`` are device pointers or ``None``).
    * ``_torch_update(group, tensor_lists, found_inf)``: the same update with torch ops, for the
      torch-native backend (16-bit params arrive as fp32 working copies, grads unscaled, and it
      must advance ``steps`` itself, on device).

    Everything else (the loss-scaling protocol, validation before any change, backend choice,
    state creation and checkpoints) is inherited, and so are two options of every group when the
    kernel's lists end with ``(..., "master_params", "sr_seeds", "steps")`` (the docs' recipe
    *Pure bf16 training* shows both at work):

    * ``master_weights`` (default False): 16-bit params keep an fp32 copy in
      ``state["master_param"]``; the update reads and writes it and stores the param rounded
      from it in the same pass. fp32 params ignore it.
    * ``stochastic_rounding`` (default False, bfloat16 params only, exclusive with
      ``master_weights``): the param is stored rounded stochastically, unbiased, from a hash of
      ``state["sr_seed"]`` (an int32 per param), the step and the element index: reproducible,
      resumed bit-exactly, identical on both backends and under CUDA-graph replay.
    """

    kernel: ClassVar[MultiTensorKernel]

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        self._check_options(defaults)
        check_rounding_options(defaults, self._takes_rounding_lists())
        super().__init__(params, defaults)
        for group in self.param_groups:
            self._check_rounding(group)

    # ------------------------------------------------------------------ what a subclass defines
    def _state_keys(self, group: dict[str, Any]) -> tuple[str | None, ...]:
        raise NotImplementedError(f"{type(self).__name__} must define _state_keys(group)")

    def _check_options(self, options: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define _check_options(options)")

    def _kernel_args(
        self, group: dict[str, Any], found_inf: int | None, inv_scale: int | None
    ) -> ctypes.Structure:
        raise NotImplementedError(f"{type(self).__name__} must define _kernel_args(...)")

    def _torch_update(
        self, group: dict[str, Any], tensor_lists: list[list[torch.Tensor]], found_inf: torch.Tensor | None
    ) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define _torch_update(...)")

    # ------------------------------------------------------------------ the inherited machinery
    @torch.compiler.disable  # Note [compile boundary] in optimizer.py
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Performs a single optimization step (no skipping: see :meth:`unscale_and_step`).

        Args:
            closure: optional, re-evaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pending = self.__dict__.pop(_PENDING, None)
        if pending is None:
            pending = (self._plan_step(), None, None, None)
        plan, found_inf, inv_scale, scale_update = pending
        plan.commit(found_inf, inv_scale, scale_update)
        return loss

    def _plan_step(self) -> _FusedStepPlan:
        check_param_groups(self)
        backend = select(self._params_device())
        for group in self.param_groups:
            self._check_options(group)
            self._check_rounding(group)
        cache = self.__dict__.get(_STEP_CACHE)
        plan = cache.plan(self, backend) if cache is not None else None
        if plan is None:
            plan = self._build_step_plan(backend)
            self.__dict__[_STEP_CACHE] = StepCache.of(self, plan)
        return plan

    def _plans_only_lists(self) -> bool:
        """Whether planning a step only builds lists, so that the plan may be reused (an
        optimizer with its own ``_extra_lists`` or ``_prepare_kernel_launches`` may do more)."""
        cls = type(self)
        return (
            cls._extra_lists is FusedOptimizer._extra_lists
            and cls._prepare_kernel_launches is FusedOptimizer._prepare_kernel_launches
        )

    def _lists_key(self, group: dict[str, Any]) -> tuple[Any, ...]:
        """What, besides the params and their state, decides a group's tensor lists."""
        return (
            self._state_keys(group),
            bool(group.get("master_weights", False)),
            bool(group.get("stochastic_rounding", False)),
        )

    def _build_step_plan(self, backend: Backend) -> _FusedStepPlan:
        """The step's plan from scratch: every param, grad and state entry validated, new state
        built on the side, every group's update and the epilogue prepared."""
        plan = _FusedStepPlan(self, backend)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                plan.groups.append((group, params, []))
                continue
            for param in params:
                check_param(param)
            check_param_grads(params, self._params_device())
            plan.params += params
            plan.grads += [p.grad for p in params]
            # Updates walk param, grad and state storage in lockstep, so a grad whose strides
            # differ from its param's is copied into the param's layout (torch 2.13's CPU fused
            # AdamW silently mixes up the elements of a transposed grad).
            grads = [
                p.grad
                if p.grad.stride() == p.stride()
                else torch.empty_like(p, dtype=p.grad.dtype).copy_(p.grad)
                for p in params
            ]
            plan.grads_copied |= any(g is not p.grad for g, p in zip(grads, params))
            keys = self._state_keys(group)
            state_lists: list[list[torch.Tensor]] = [[] for key in keys if key is not None]
            steps = []
            for param in params:
                tensors, step, replacement = stage_state(param, self.state.get(param, {}), keys)
                for state_list, tensor in zip(state_lists, tensors):
                    state_list.append(tensor)
                steps.append(step)
                if replacement is not None:
                    plan.new_state[param] = replacement
            extra = self._extra_lists(group, params, grads)
            rounding = self._stage_rounding(group, params, plan.new_state)
            lists = [params, grads, *_with_empty_lists(keys, state_lists), *extra, *rounding, steps]
            plan.groups.append((group, params, lists))
            for part_backend, picked in _split_by_support(backend, params):
                # The group's own lists when one backend takes every param, so that an update
                # reading other groups' lists (LAMB's global norm) sees the grads as unscaled.
                chosen = (
                    lists
                    if len(picked) == len(params)
                    else [[tensors[i] for i in picked] if tensors else [] for tensors in lists]
                )
                part = plan.part(part_backend)
                part.updates.append(part_backend.prepare(self, group, chosen))
                part.grad_lists.append(chosen[1])
                part.steps += chosen[-1]
        if plan.new_state:
            refuse_during_capture("Creating or converting optimizer state")
        plan.part(backend)  # the device's backend ends the step (and moves the scale) always
        for part_backend, part in plan.parts.items():
            part.unscale = part_backend.prepare_unscale(part.grad_lists)
            part.epilogue = part_backend.prepare_epilogue(part.steps)
        return plan

    # ------------------------------------------- updates of several launches (LAMB's norms)
    def _extra_lists(
        self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor]
    ) -> list[list[torch.Tensor]]:
        """Lists of the kernel between the state lists and the rounding lists that are not
        state (e.g. per-tensor scratch), for one group's update; called while the step is
        planned, group by group. None by default."""
        return []

    def _prepare_kernel_launches(
        self, group: dict[str, Any], tensor_lists: list[list[torch.Tensor]]
    ) -> Callable[[int | None, int | None], None] | None:
        """For an update that is more than ``kernel`` then the step counters: its launches,
        validated, as ``run(found_inf_pointer, inv_scale_pointer)`` (the step's epilogue
        advances the counters after it). ``None`` (the default): the kernel backend launches ``kernel`` with
        :meth:`_kernel_args`."""
        return None

    # ------------------------------------------------ the param rounding options (rounding.py)
    def _takes_rounding_lists(self) -> bool:
        return self.kernel.lists[-3:-1] == ROUNDING_LISTS

    def _check_rounding(self, group: dict[str, Any]) -> None:
        check_rounding_options(group, self._takes_rounding_lists())
        check_rounding_params(group)

    def _stage_rounding(
        self, group: dict[str, Any], params: list[torch.Tensor], new_state: dict[torch.Tensor, dict[str, Any]]
    ) -> list[list[torch.Tensor]]:
        """The kernel's ``master_params`` and ``sr_seeds`` lists for ``params`` (none for a kernel
        without them), recording created or dropped state entries in ``new_state``."""
        if not self._takes_rounding_lists():
            return []
        # A param's index seeds its stochastic rounding: only built when a group asks for it,
        # since this runs on every step of every group.
        index = (
            {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
            if group.get("stochastic_rounding", False)
            else {}
        )
        masters, seeds = [], []
        for param in params:
            state = new_state.get(param, self.state.get(param, {}))
            master, seed, changes = stage_rounding_state(param, state, group, index.get(param, -1))
            if changes:
                updated = {**state, **changes}
                new_state[param] = {k: v for k, v in updated.items() if v is not None}
            if master is not None:
                masters.append(master)
            if seed is not None:
                seeds.append(seed.view(torch.float32))  # the kernel reads its bits
        return [masters, seeds]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`scaledoptim.Optimizer.load_state_dict`, keeping state fp32 for 16-bit params.

        torch would cast loaded moments to the param's dtype (and lose bits that a bit-exact
        resume needs), so the per-param state is cast here instead: floating state to float32
        (or the param's dtype if wider), everything on the param's device, every tensor a copy.
        Load-state-dict hooks run as torch runs them: pre-hooks on the state_dict given (they
        may replace it), post-hooks once every param's state is in place.
        """
        # The step cache holds the state it validated: let the old state go with the load.
        self.__dict__.pop(_STEP_CACHE, None)
        hooks = self.__dict__
        pre_hooks = hooks["_optimizer_load_state_dict_pre_hooks"]
        post_hooks = hooks["_optimizer_load_state_dict_post_hooks"]
        for pre_hook in list(pre_hooks.values()):
            replaced = pre_hook(self, state_dict)
            if replaced is not None:
                state_dict = replaced
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
            raise ValueError("Corrupt optimizer state_dict: it needs a 'state' dict")
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            raise ValueError(
                "loaded state dict has a different number of parameter groups than the optimizer"
            )
        saved_ids = [i for g in saved_groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        if len(saved_ids) != len(params):
            raise ValueError("loaded state dict contains a parameter group that doesn't match")
        by_id = dict(zip(saved_ids, params))
        loaded = {
            by_id[i]: {key: cast_loaded_state(by_id[i], key, value) for key, value in s.items()}
            for i, s in state_dict["state"].items()
            if i in by_id
        }
        # torch's loader gets no state (it would round 16-bit params' moments) and no hooks
        # (they ran above, and run below once the state is in place).
        hooks["_optimizer_load_state_dict_pre_hooks"] = type(pre_hooks)()
        hooks["_optimizer_load_state_dict_post_hooks"] = type(post_hooks)()
        try:
            super().load_state_dict({**state_dict, "state": {}})
        finally:
            hooks["_optimizer_load_state_dict_pre_hooks"] = pre_hooks
            hooks["_optimizer_load_state_dict_post_hooks"] = post_hooks
        self.state.update(loaded)
        for post_hook in list(post_hooks.values()):
            post_hook(self)

    #: Options a checkpoint of an older version may lack, with the value that version behaved
    #: as (torch.optim's ``__setstate__`` fills the same); other missing options take
    #: ``self.defaults``.
    _legacy_options: ClassVar[dict[str, Any]] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # As torch.optim's classes do: groups saved by older versions lack newer options.
        super().__setstate__(state)
        self._fill_legacy_options()

    def _fill_legacy_options(self) -> None:
        for group in self.param_groups:
            for key, value in {**self.defaults, **self._legacy_options}.items():
                group.setdefault(key, value)


def _with_empty_lists(
    keys: tuple[str | None, ...], state_lists: list[list[torch.Tensor]]
) -> list[list[torch.Tensor]]:
    filled = iter(state_lists)
    return [[] if key is None else next(filled) for key in keys]


def check_hyperparameter(name: str, value: Any, low: float = 0.0, high: float | None = None) -> None:
    """``ValueError(f"Invalid {name}: {value}")`` unless ``low <= value (< high)``, torch's style."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a Python float, not a tensor (got {value!r})")
    if not (low <= value and (high is None or value < high)):
        raise ValueError(f"Invalid {name}: {value}")
