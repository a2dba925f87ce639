"""``FusedOptimizer``: the public base of optimizers whose update is one multi-tensor op that
reads ``found_inf`` on device, so that skipping an overflowed step needs no host sync.

A subclass implements the :class:`~scaledoptim.fused.update.Update` protocol (its state, its
kernel's arguments, its torch form); the engine (``planning.py``, ``plan.py``, ``backends/``)
does the rest, and the protocol (``scaledoptim.protocol``) runs the step.
"""

from __future__ import annotations

import abc
import ctypes
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, ClassVar

import torch

from ..kernels import ROUNDING_LISTS, MultiTensorKernel
from ..protocol import Optimizer
from ..protocol.backward_check import GradCheck
from ..protocol.plans import check_param_groups
from ..protocol.steps import planned_step
from .backends import select
from .loading import check_torch_flags, plan_loaded_groups, plan_loaded_state
from .lowbit import check_float32_states, lowbit_new
from .options import Options
from .options import check_options as check_declared
from .plan import FusedStepPlan, StepCache, declared_kernel_args, hyperparameter
from .planning import build_plan
from .rounding import MasterWatch, check_rounding_options, check_rounding_params
from .state import StateLayout
from .update import GradReduction, Group, TensorLists

__all__ = ["FusedOptimizer"]


class FusedOptimizer(Optimizer, abc.ABC):
    r"""Base of scaledoptim's fused optimizers, and of yours: subclass it, declare the state,
    point it at a kernel. A :class:`scaledoptim.Optimizer` (the whole loss-scaling protocol),
    abstract until the hooks below are defined.

    A subclass implements the :class:`~scaledoptim.fused.update.Update` protocol:

    * ``kernel``: a ``scaledoptim.kernels.MultiTensorKernel`` whose tensor lists are
      ``(params, grads, *state lists, steps)``; the docs' kernel-author guide, *Writing a fused
      kernel* (``docs/kernels.md``), builds one.
    * ``state_keys(group)``: the names of the per-param state tensors, in the order of the
      kernel's state lists (``None`` for a list the group's options turn off). They are created
      as float32 zeros shaped like the param (or filled with a constructor option named in
      ``initial_state_options``); ``state["step"]`` (a 0-dim float32 tensor counting taken
      steps) is added and advanced for every optimizer.
    * ``options``: a frozen dataclass of the group's hyper-parameters declared with
      ``scaledoptim.fused.options.option`` (default, valid range, swept values); the
      inherited ``check_options(options)`` refuses a value out of its range (torch's
      messages). It is called by the constructor, and on a param group before a step whenever
      one of its values changed; override it (calling ``super()``) for checks across options.
    * ``kernel_args(group, found_inf, inv_scale)``: the kernel's argument struct for a group
      (``found_inf``/``inv_scale`` are device pointers or ``None``); or ``args``, a
      ``staticmethod`` making it from the group's ``options`` read.
    * its torch form, for the torch-native backend (16-bit params arrive as fp32 working
      copies, grads unscaled), one of two: ``torch_form_in_place = True`` and
      ``torch_form_(group, tensor_lists)``, the update written once, in place and taken
      unconditionally (the backend reads the skip on the host on a CPU, or runs it on working
      copies and copies them back unless skipped, on device); or
      ``torch_update(group, tensor_lists, found_inf)`` over ops that take ``found_inf``
      themselves (torch's fused Adam(W), SGD, Adagrad), which must skip on it and advance
      ``steps`` itself, on device. Optionally, with
      ``torch_update_takes_grad_scale = True``, it also takes a keyword ``grad_scale`` (a 0-dim
      float32 tensor) and then gets grads still scaled by it, as torch's fused
      Adam(W)/SGD/Adagrad do: on a CPU the step then reads the grads once to check them and
      once to update.
    * optionally ``torch_optim`` (the torch.optim class of the same update) with
      ``torch_optim_update`` and ``check_torch_optim``: then params the fused update cannot
      serve (complex, sparse grads, views with gaps, ``differentiable=True``, hyper-parameter
      tensors on an accelerator) take torch.optim's own implementation in the same step (the
      migration guide, "What takes torch.optim's own implementation"); without it they are refused.

    Everything else (the loss-scaling protocol, validation before any change, backend choice,
    state creation and checkpoints) is inherited, and so are two options of every group when the
    class declares ``rounds = True``, its kernel's lists then ending with
    ``(..., "master_params", "sr_seeds", "steps")`` (the docs' recipe *Pure bf16 training*
    shows both at work):

    * ``master_weights`` (default False): 16-bit params keep an fp32 copy in
      ``state["master_param"]``; the update reads and writes it and stores the param rounded
      from it in the same pass. fp32 params ignore it. An edit of the param between steps
      (clipping, re-init, ``model.load_state_dict``, an outer optimizer's step) is kept: the
      next step first copies every element the edit changed into the master (seen through the
      param's version counter and data pointer, so not for edits through ``p.data``; the
      concepts page, "Master weights and edits to params").
    * ``stochastic_rounding`` (default False, bfloat16 params only, exclusive with
      ``master_weights``): the param is stored rounded stochastically, unbiased, from a hash of
      ``state["sr_seed"]`` (an int32 per param), the step and the element index: reproducible,
      resumed bit-exactly, identical on both backends and under CUDA-graph replay.
    """

    kernel: ClassVar[MultiTensorKernel]
    #: The group's hyper-parameters, declared once (``fused/options.py``); ``None``: the
    #: subclass checks them in its own ``check_options``.
    options: ClassVar[type[Options] | None] = None
    #: Whether it takes ``master_weights`` and ``stochastic_rounding``: its kernel's lists
    #: then end with ``(..., *ROUNDING_LISTS, "steps")``.
    rounds: ClassVar[bool] = False
    #: ``args(found_inf, inv_scale, options)``: the kernel's argument struct from the group's
    #: :attr:`options` (what the default ``kernel_args`` returns; a ``staticmethod``).
    args: ClassVar[Callable[..., ctypes.Structure] | None] = None
    #: The kernel of its 8-bit states, which ``state_bits=8`` selects (the guide *8-bit
    #: optimizer states*); none.
    lowbit_kernel: ClassVar[MultiTensorKernel | None] = None
    #: Kernels launched before ``kernel`` over the same lists and arguments (usually none).
    kernels_before: ClassVar[tuple[MultiTensorKernel, ...]] = ()
    #: The torch.optim class whose implementation takes what the fused update cannot (none).
    torch_optim: ClassVar[type[torch.optim.Optimizer] | None] = None
    #: State created filled with a constructor option rather than zeros: state key -> the
    #: option in ``defaults`` (Adagrad's ``sum`` starts at ``initial_accumulator_value``).
    initial_state_options: ClassVar[dict[str, str]] = {}
    #: Whether each element's update reads only that element of the param, grad and state
    #: (and scalars): then a DTensor param's torch form, or our kernels, run on its local shard
    #: (no). LAMB's per-tensor norms read the whole tensor: its torch form sums them over the mesh.
    elementwise: ClassVar[bool] = False
    #: Whether the torch form is ``torch_form_`` (in place, skipped by the backend; no:
    #: ``torch_update``).
    torch_form_in_place: ClassVar[bool] = False
    #: Whether ``torch_update`` also takes ``grad_scale=`` (grads still scaled by it; no).
    torch_update_takes_grad_scale: ClassVar[bool] = False
    #: The update plans itself in ``step()``, after the step pre-hooks (Note [step requests] in
    #: protocol/guard.py): the protocol's step.
    _plans_in_step: ClassVar[bool] = True
    step = planned_step
    #: The params with an fp32 master as the last step left them (Note [param edits under
    #: master weights] in rounding.py); not pickled either: a copy trusts its masters.
    _master_watch: MasterWatch | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The engine reads `rounds` alone; a kernel whose lists disagree would be handed one
        # list too many or too few.
        kernel = getattr(cls, "kernel", None)
        if kernel is not None and (kernel.lists[-3:-1] == ROUNDING_LISTS) != cls.rounds:
            raise TypeError(
                f"{cls.__name__} declares rounds = {cls.rounds}, but its kernel's lists "
                f"{kernel.lists} {'do not ' if cls.rounds else ''}end with "
                f"(..., *ROUNDING_LISTS, 'steps'): declare rounds = {not cls.rounds}"
            )

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # With 8-bit states declared, ``state_bits=8`` makes the low-bit variant.
        return object.__new__(cls) if cls.lowbit_kernel is None else lowbit_new(cls, kwargs)

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        form = "torch_form_" if self.torch_form_in_place else "torch_update"
        if getattr(type(self), form) is getattr(FusedOptimizer, form):
            raise TypeError(
                f"{type(self).__name__} defines no torch form: define torch_update(group, "
                "tensor_lists, found_inf), or torch_form_(group, tensor_lists) with "
                "torch_form_in_place = True"
            )
        self.check_options(defaults)
        check_rounding_options(defaults, self.rounds)
        super().__init__(params, defaults)
        for group in self.param_groups:
            check_rounding_options(group, self.rounds)
            check_rounding_params(group)
        check_torch_flags(defaults, constructing=True)  # torch.optim's, after its groups

    # ------------------------------------------------------------- the Update a subclass defines
    @abc.abstractmethod
    def state_keys(self, group: Group) -> tuple[str | None, ...]:
        """The per-param state names, in the order of the kernel's state lists."""

    def check_options(self, options: dict[str, Any]) -> None:
        """Raises ``ValueError``/``TypeError`` for hyper-parameters outside the ranges
        :attr:`options` declares (and for 8-bit states asked of float32 ones)."""
        if self.lowbit_kernel is not None:
            check_float32_states(self, options)
        if self.options is not None:
            check_declared(self.options, options)

    #: ``kernel_args(group, found_inf, inv_scale)``: the kernel's argument struct for ``group``,
    #: by default :attr:`args` of its :attr:`options` read at every step. The default is defined
    #: in ``plan.py`` beside the reading of options, which a steady step already enters.
    kernel_args = declared_kernel_args

    def torch_update(
        self, group: Group, lists: TensorLists, found_inf: torch.Tensor | None
    ) -> None:
        """The update with torch ops that skip on ``found_inf`` themselves (see the class
        docs); not called with :attr:`torch_form_in_place`."""
        raise NotImplementedError(f"{type(self).__name__} defines torch_form_, not torch_update")

    def torch_form_(self, group: Group, lists: TensorLists) -> None:
        """The update with torch ops in place, taken unconditionally (see the class docs);
        called only with :attr:`torch_form_in_place`."""
        raise NotImplementedError(f"{type(self).__name__} defines torch_update, not torch_form_")

    def torch_optim_update(
        self, group: Group, lists: TensorLists, found_inf: torch.Tensor | None
    ) -> None:
        """torch.optim's implementation of the update (see :attr:`torch_optim`)."""
        raise NotImplementedError(f"{type(self).__name__} has no torch.optim implementation")

    def check_torch_optim(self, group: Group, params: list[torch.Tensor]) -> None:
        """Raises what torch.optim's step would raise for ``params`` (nothing by default)."""

    def state_layouts(self, group: Group) -> Mapping[str, StateLayout]:
        """The state names whose tensors are not float32 ones shaped like the param, and their
        layouts (none by default; a low-bit state's codes and scales)."""
        return {}

    def scratch_lists(self, group: Group, params: list[torch.Tensor]) -> TensorLists:
        """Per-param scratch lists of the kernel after the state lists (none by default)."""
        return []

    def grad_reduction(self, grads: list[torch.Tensor]) -> GradReduction | None:
        """A reduction over every grad of the step before the updates (none by default)."""
        return None

    # ------------------------------------------------------------------ the inherited machinery
    def _plan_step(self, run: Callable[[], Any] | None = None) -> FusedStepPlan:
        """The step planned in full (``steps.plan`` renews the kept plan first: Note [step
        cache] in plan.py), kept for the next step."""
        check_param_groups(self)
        for group in self.param_groups:
            self._check_group(group)
        plan = build_plan(self)
        self._step_cache = StepCache.of(self, plan)
        return plan

    def _check_group(self, group: Group) -> None:
        """A group's options, before any group steps (edited or loaded since the last step):
        :meth:`check_options`, and torch.optim's refusal of ``fused`` with ``differentiable``."""
        self.check_options(group)
        check_torch_flags(group)

    def _overlapped_check(self, device: torch.device) -> GradCheck | None:
        backend = select(device)
        return backend.check_ if backend.folds_unscale else None

    def initial_state_fill(self) -> dict[str, float]:
        """The value each state of :attr:`initial_state_options` starts at (a one-element CPU
        tensor option read on the host), for every param: torch.optim reads the constructor's
        (``self.defaults``), never a group's."""
        return {
            key: hyperparameter(option, self.defaults[option])
            for key, option in self.initial_state_options.items()
        }

    def _plan_load_state(
        self, state_dict: dict[str, Any], by_id: dict[Hashable, torch.Tensor]
    ) -> dict[torch.Tensor, dict[str, Any]]:
        """Validates every option and state entry the next step reads (``fused/loading.py``)
        and returns the per-param state to install, kept fp32 for 16-bit params.

        torch would cast loaded moments to the param's dtype (and lose bits that a bit-exact
        resume needs), so the per-param state is cast here instead: floating state to float32
        (or the param's dtype if wider), everything on the param's device, every tensor a copy.
        """
        groups = plan_loaded_groups(self, state_dict["param_groups"], self._legacy_options)
        planned = plan_loaded_state(self, groups, state_dict["state"], by_id)
        # The step cache holds the state it validated: let the old state go with the load. The
        # loaded masters are the truth, whatever was written to the params before.
        self._step_cache = None
        self._master_watch = None
        return planned

    #: Options a checkpoint of an older version may lack, with the value that version behaved
    #: as (torch.optim's ``__setstate__`` fills the same); other missing options take
    #: ``self.defaults``.
    _legacy_options: ClassVar[dict[str, Any]] = {}
    #: Whether torch.optim reads this update's state entry by entry (SGD's: no ``step``, a
    #: momentum buffer made when missing): a loaded state without ``step`` counts one step
    #: taken, and one of only a ``step`` starts its moments afresh; otherwise both are refused,
    #: as torch's step would fail on them (an empty state starts afresh in every class).
    _state_may_lack_step: ClassVar[bool] = False

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch.optim's __setstate__ (a load_state_dict, an unpickle) gives the defaults a
        # `differentiable`; an optimizer without that option (LAMB, Lion) must not gain it, in its
        # defaults or, below, in its groups (DCP's set_optimizer_state_dict would then see groups
        # that differ from the saved ones).
        own = "differentiable" in state.get("defaults", getattr(self, "defaults", {}))
        super().__setstate__(state)
        if not own:
            self.defaults.pop("differentiable", None)
        # As torch.optim's classes do: groups saved by older versions lack newer options.
        self._fill_legacy_options()

    def _fill_legacy_options(self) -> None:
        for group in self.param_groups:
            for key, value in {**self.defaults, **self._legacy_options}.items():
                group.setdefault(key, value)


