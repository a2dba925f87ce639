"""Owning a dynamic loss scale: its configuration, its checkpoints and copies, and GradScaler
state in and out. The per-step half of the protocol is in optimizer.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..scale import (
    LossScale,
    ScalingConfig,
    check_process_group,
    gradscaler_state_from_loss_scale,
    loss_scale_from_gradscaler_state,
)
from .backward_check import BackwardCheck
from .clipping import check_grads_across_ranks
from .loads import check_layout, nothing_loaded_on_failure
from .plans import StepOutcome, StepRequest
from .scale_carrying import (
    GROUP_SCALE_KEY,
    _carries_scale,
    _pop_group_scale_state,
)

__all__ = ["GROUP_SCALE_KEY", "ScaleOwner", "ScalingState"]


_Self = TypeVar("_Self", bound="ScaleOwner")


@dataclasses.dataclass
class ScalingState:
    """One optimizer's loss scale (possibly shared) and its place in the protocol."""

    loss_scale: LossScale
    # What unscale() found, for the step that consumes it; None when no unscale is pending
    # (Note [found_inf contract]). The protocol's stage is this field alone, so recording and
    # forgetting an unscale is one write.
    found_inf: torch.Tensor | None = None
    # Set while closure replay runs: every overflow backs off, hysteresis notwithstanding.
    replaying: bool = False
    # Not part of the state_dict: a process group belongs to this run, not to the checkpoint.
    process_group: Any = None
    # How the grads relate across process_group's ranks, for clipping: "replicated" (DDP) or
    # "sharded" (each rank's optimizer holds its own part); None: not said (Note [clipping in
    # the step] in clipping.py). Not in the state_dict either: it describes this run's layout.
    grads_across_ranks: str | None = None
    # Who moves the scale when not this optimizer's own protocol: a scaledoptim.GradScaler
    # stepping it (its name, for messages); the optimizer's own unscale methods then refuse.
    driver: str | None = None
    # The scale came from a checkpoint (a GradScaler that adopts the optimizer warns if its own
    # was never loaded: the optimizer's checkpointed scale would be dropped).
    loaded: bool = False

    @property
    def unscaled(self) -> bool:
        """Whether an unscale is pending (between ``unscale()`` and its step)."""
        return self.found_inf is not None


class ScaleOwner(torch.optim.Optimizer):
    """The loss-scale half of :class:`scaledoptim.Optimizer`: configuration, checkpoints,
    copies and GradScaler state. Not used on its own."""

    # Per-instance, set lazily so that classes made by ``with_scaling`` (whose ``__init__`` we do
    # not own) and patched instances get them too.
    _scaledoptim_scaling: ScalingState | None = None
    _scaledoptim_backward_check: BackwardCheck | None = None
    #: Set once this optimizer warned that a torch.amp.GradScaler drives it.
    _scaledoptim_warned_torch_scaler: bool = False

    if TYPE_CHECKING:  # defined by scaledoptim.Optimizer, next to the per-step protocol

        def _scaling(self) -> ScalingState: ...

        def _params_device(self) -> torch.device: ...

        def _overlapped_check(self, device: torch.device) -> Any: ...

        # The surface scaledoptim.GradScaler steps an optimizer through (package-internal).
        def _unscale_for_scaler(
            self, scaled_by: torch.Tensor, loss_scale: LossScale, driver: str
        ) -> torch.Tensor | None: ...

        def _run_step(
            self, request: StepRequest, *args: Any, **kwargs: Any
        ) -> tuple[Any, StepOutcome | None]: ...

    @property
    def scaling_state(self) -> ScalingState:
        """This optimizer's loss scale and its place in the protocol (read-only).

        The :class:`~scaledoptim.scale.LossScale` in use (``scaling_state.loss_scale``, shared
        after :func:`~scaledoptim.share_scale` or once a :class:`scaledoptim.GradScaler` steps
        the optimizer), the ``found_inf`` an :meth:`~scaledoptim.Optimizer.unscale` left for its
        step, and the process group overflow is agreed over. Created on first use, on the
        params' device. For inspection: change the scale through :meth:`configure_scaling`,
        :meth:`load_state_dict` and the protocol's methods.
        """
        return self._scaling()

    def _current_scale(self) -> torch.Tensor:
        """The scale tensor in use now (``opt.scale``)."""
        return self._scaling().loss_scale.scale

    def configure_scaling(
        self: _Self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        # Literals, not ScalingConfig's attributes: the API reference renders the source of a
        # default, and a reader wants the value (a test checks that the two agree).
        min_scale: float = 1.1754943508222875e-38,
        max_scale: float = 3.4028234663852886e38,
        max_replays: int = 32,
        process_group: Any = None,
        check_during_backward: bool = False,
        grads_across_ranks: str | None = None,
    ) -> _Self:
        r"""Sets the dynamic loss scale's hyper-parameters and resets it to ``init_scale``.

        The defaults reproduce :class:`torch.amp.GradScaler`'s scale sequence exactly
        (:class:`scaledoptim.ScalingConfig` checks the values). The new scale is written into
        :attr:`~scaledoptim.Optimizer.scale`'s tensor: a handle taken before stays live.

        Args:
            init_scale: the scale before the first step. Default: ``2**16``.
            growth_factor: multiplies the scale after ``growth_interval`` clean steps (> 1).
                Default: ``2.0``.
            backoff_factor: multiplies the scale when an overflow is not tolerated (in (0, 1)).
                Default: ``0.5``.
            growth_interval: consecutive clean steps before the scale grows; ``2**31`` or more
                never grows it. Default: ``2000``.
            hysteresis: consecutive overflows needed before the scale backs off; ``N``
                tolerates ``N - 1``. Default: ``1`` (back off on every overflow, as GradScaler).
            min_scale: the scale never backs off below this. Default: the smallest normal
                float32 (``torch.finfo(torch.float32).tiny``, about ``1.2e-38``).
            max_scale: the scale never grows above this. Default: the largest float32
                (``torch.finfo(torch.float32).max``, about ``3.4e38``).
            max_replays: how many times a closure may be replayed with a smaller scale in one
                step before :class:`~scaledoptim.ClosureReplayError` is raised. Default: ``32``.
            process_group: a :class:`torch.distributed.ProcessGroup` whose ranks must agree on
                overflow (DDP, FSDP, sharded optimizers). Every
                :meth:`~scaledoptim.Optimizer.unscale` then all-reduces ``found_inf`` with MAX
                over it, on device with no host read, before the scale moves or anything steps:
                if one rank overflows, every rank skips and every rank's scale moves the same
                way. Every rank of the group must unscale once per
                iteration. Default: ``None``, no agreement (single process).
            grads_across_ranks: how this optimizer's plain (non-DTensor) grads relate across
                ``process_group``'s ranks, which clipping in the step
                (``unscale_and_step(..., max_grad_norm=c)``) needs to compute the whole model's
                norm: ``"replicated"`` when every rank holds the same grads of the whole model
                (DDP: the norm is this rank's), ``"sharded"`` when each rank's optimizer holds
                its own part of the model (ZeroRedundancyOptimizer, FSDP1's flat shards: the
                ranks' sums of squares are added on device). DTensor grads (FSDP2, tensor
                parallel) need neither: their norm is over their mesh. Default: ``None``, not
                said: clipping under ``process_group`` with plain params is then refused.
            check_during_backward: fold each grad into ``found_inf`` as backward produces it
                (a post-accumulate-grad hook per param), so that the step reads each grad once
                instead of twice on our kernels; grads set or changed after backward are checked
                in the step as usual (the docs' *Concepts* page explains when it helps). Does
                nothing once torch.distributed is initialized: collectives rewrite grads without
                moving their version counters. Not kept in the ``state_dict`` or in copies:
                configure it again after loading or copying. Default: ``False``.

        Returns:
            the optimizer itself, so ``opt = AdamW(...).configure_scaling(...)`` reads well.

        Raises:
            RuntimeError: on an optimizer that shares its scale (configure the first, then
                share), or one a :class:`scaledoptim.GradScaler` steps (configure the scaler).
            ValueError: ``grads_across_ranks`` other than ``None``, ``"replicated"`` or
                ``"sharded"``, or given without ``process_group``.
        """
        check_process_group(process_group)
        check_grads_across_ranks(grads_across_ranks, process_group)
        config = ScalingConfig(
            init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale,
            max_scale=max_scale, max_replays=max_replays,
        )
        current = self._scaledoptim_scaling
        if current is not None and current.loss_scale.sharers > 1:
            raise RuntimeError(
                "configure_scaling() on an optimizer that shares its scale: configure the first "
                "optimizer, then call scaledoptim.share_scale(...)"
            )
        if current is not None and current.driver is not None:
            raise RuntimeError(
                f"configure_scaling() on an optimizer stepped by a {current.driver}, which owns "
                "its scale: configure the scaler (its constructor, set_growth_factor(), ...)"
            )
        self._scaledoptim_scaling = ScalingState(
            self._keep_handle(LossScale(config, self._params_device())),
            process_group=process_group,
            grads_across_ranks=grads_across_ranks,
        )
        if self._scaledoptim_backward_check is not None:
            self._scaledoptim_backward_check.remove()
        self._scaledoptim_backward_check = (
            BackwardCheck(self.param_groups, self._overlapped_check, self._current_scale)
            if check_during_backward
            else None
        )
        return self

    def state_dict(self) -> dict[str, Any]:
        """As :meth:`torch.optim.Optimizer.state_dict`, plus ``"loss_scale"``: the scale, its
        growth and hysteresis trackers and its config. Loading it resumes bit for bit. Each
        param group holds a copy under the same key, which
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` keeps (it drops
        the top-level one), so a DCP checkpoint carries the scale too.

        The process group given to :meth:`~scaledoptim.Optimizer.configure_scaling` is not saved (it
        belongs to the run): configure the resumed optimizer with its own, then load.

        Raises:
            RuntimeError: between :meth:`~scaledoptim.Optimizer.unscale` and
                :meth:`~scaledoptim.Optimizer.step_after_unscale`. A checkpoint taken there could
                not resume exactly: the pending step needs the unscaled grads, which no optimizer
                state_dict holds, and the scale has already moved for it. Save before
                :meth:`~scaledoptim.Optimizer.unscale` or after the step.
        """
        self._check_between_steps("state_dict()")
        state_dict = super().state_dict()
        loss_scale = self._scaling().loss_scale
        state_dict["loss_scale"] = loss_scale.state_dict()
        # See Note [the scale through DCP] in scale_carrying.py
        for group in state_dict["param_groups"]:
            group[GROUP_SCALE_KEY] = loss_scale.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`torch.optim.Optimizer.load_state_dict`, restoring the loss scale too.

        A plan, then a commit, as a step: the load-state-dict pre-hooks run on the state_dict
        given (they may replace it), then its layout, every value the optimizer will read and
        the scale state are validated; only then is anything installed, and the post-hooks run.
        A refusal names the key and the fix and changes nothing.

        The scale state is the top-level ``"loss_scale"``, or else the copy every param group
        holds (what ``set_optimizer_state_dict`` passes), which must agree; it is never put into
        ``param_groups``. A plain ``torch.optim`` state_dict (neither) loads with this
        optimizer's scale reset to its configured ``init_scale`` (an optimizer a
        :class:`scaledoptim.GradScaler` steps keeps the scaler's scale, loaded with the
        scaler). The scale state is copied into :attr:`~scaledoptim.Optimizer.scale`'s tensor:
        ``S = opt.scale`` taken before the load resumes from the loaded scale. The process group
        given to :meth:`~scaledoptim.Optimizer.configure_scaling` is kept.

        Raises:
            RuntimeError: between :meth:`~scaledoptim.Optimizer.unscale` and
                :meth:`~scaledoptim.Optimizer.step_after_unscale` (see
                :meth:`~scaledoptim.Optimizer.state_dict`).
            TypeError, ValueError: a state_dict this optimizer did not write, or one whose
                values its next step would reject or turn into NaN, naming the key.
        """
        hooks = self.__dict__
        pre_hooks = hooks["_optimizer_load_state_dict_pre_hooks"]
        post_hooks = hooks["_optimizer_load_state_dict_post_hooks"]
        for pre_hook in list(pre_hooks.values()):
            replaced = pre_hook(self, state_dict)
            if replaced is not None:
                state_dict = replaced
        by_id = check_layout(self, state_dict)
        loss_scale, torch_state_dict = self._split_scale_state(state_dict)
        planned = self._plan_load_state(torch_state_dict, by_id)
        if planned is not None:  # torch's loader gets no state: it is installed as planned
            torch_state_dict = {**torch_state_dict, "state": {}}
        # torch's loader gets no hooks: they ran above, and run below once all is in place.
        hooks["_optimizer_load_state_dict_pre_hooks"] = type(pre_hooks)()
        hooks["_optimizer_load_state_dict_post_hooks"] = type(post_hooks)()
        try:
            with nothing_loaded_on_failure(self):
                super().load_state_dict(torch_state_dict)
        finally:
            hooks["_optimizer_load_state_dict_pre_hooks"] = pre_hooks
            hooks["_optimizer_load_state_dict_post_hooks"] = post_hooks
        if planned is not None:
            self.state.update(planned)
        state = self._scaling()
        if loss_scale is not None:  # None: a plain torch.optim state_dict into a GradScaler's
            state.loss_scale = self._keep_handle(loss_scale)
            state.loaded = "loss_scale" in state_dict or _carries_scale(state_dict)
        state.found_inf = None
        for post_hook in list(post_hooks.values()):
            post_hook(self)

    def _plan_load_state(
        self, state_dict: dict[str, Any], by_id: dict[Hashable, torch.Tensor]
    ) -> dict[torch.Tensor, dict[str, Any]] | None:
        """Validates the param groups and per-param state of ``state_dict`` (layout checked,
        ``by_id``: the param each saved id stands for) and returns the state to install, or
        ``None`` to let torch's loader cast and install it. Changes nothing.

        The hook an optimizer that knows its state answers (the fused ones); a generic
        optimizer's state is torch's business, and its options are checked at its next step.
        """
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As :meth:`torch.optim.Optimizer.zero_grad`; on a shared scale it also lets the next
        unscale end a round this optimizer's iteration abandoned (see ``LossScale.end_round``)."""
        super().zero_grad(set_to_none)
        state = self._scaledoptim_scaling
        if state is not None and state.loss_scale.sharers > 1:
            state.loss_scale.end_round(id(self))

    # ------------------------------------------------------------------ copy, pickle, torch.save
    # torch's Optimizer.__getstate__ keeps only defaults, state and param_groups: without these
    # two, a deepcopy, pickle or torch.save(opt) would come back with a fresh scale and the
    # default config.
    _PICKLED_SCALING = "_scaledoptim_pickled_scaling"

    def __getstate__(self) -> dict[str, Any]:
        """torch's state plus the loss scale (scale, trackers, config) and the protocol stage.

        Not kept: the process group (it belongs to the running job and cannot be pickled:
        configure the copy with its own) and sharing (a copy of a sharer owns a copy of the
        scale; call :func:`scaledoptim.share_scale` on the copies to share again).
        """
        state = super().__getstate__()
        scaling = self._scaledoptim_scaling
        if scaling is not None:
            state[self._PICKLED_SCALING] = {
                "loss_scale": scaling.loss_scale.state_dict(),
                "found_inf": None if scaling.found_inf is None else scaling.found_inf.clone(),
            }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        pickled = state.pop(self._PICKLED_SCALING, None)
        # torch.optim's __setstate__ adds "differentiable" to the defaults only; LBFGS,
        # Adafactor and SparseAdam groups stay without it, as in torch (a load must give back
        # the groups it was given: torch's test_state_dict_deterministic), and
        # Optimizer._check_param_groups lets a group lack it.
        super().__setstate__(state)
        if pickled is not None:
            loss_scale = pickled["loss_scale"]
            restored = LossScale.from_state_dict(loss_scale, loss_scale["scale"].device)
            self._scaledoptim_scaling = ScalingState(restored, found_inf=pickled["found_inf"])

    # ------------------------------------------------------------------ torch.amp.GradScaler state
    def load_gradscaler_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continues a :class:`torch.amp.GradScaler`'s scale: loads ``scaler.state_dict()``.

        Takes its scale, growth tracker, growth/backoff factors and growth interval; keeps this
        optimizer's hysteresis, scale bounds and process group. With their defaults the run
        continues the scale sequence GradScaler would have produced. Validated before anything
        changes.

        Raises:
            TypeError, ValueError: for anything but a valid enabled GradScaler's state_dict.
            RuntimeError: between :meth:`~scaledoptim.Optimizer.unscale` and
                :meth:`~scaledoptim.Optimizer.step_after_unscale`, or on a shared scale.
        """
        self._check_between_steps("load_gradscaler_state_dict()")
        current = self._scaling()
        if current.loss_scale.sharers > 1:
            raise RuntimeError(
                "load_gradscaler_state_dict() on a shared scale: load it into each optimizer, "
                "then call scaledoptim.share_scale(...) again"
            )
        loaded = loss_scale_from_gradscaler_state(
            state_dict, current.loss_scale.config, self._params_device()
        )
        current.loss_scale = self._keep_handle(loaded)
        current.loaded = True

    def gradscaler_state_dict(self) -> dict[str, Any]:
        """The scale as ``torch.amp.GradScaler.state_dict()`` holds it (to go back to GradScaler).

        Reads the scale on the host. Warns if hysteresis or scale bounds are configured
        (GradScaler has neither).

        Raises:
            RuntimeError: between :meth:`~scaledoptim.Optimizer.unscale` and
                :meth:`~scaledoptim.Optimizer.step_after_unscale`.
        """
        self._check_between_steps("gradscaler_state_dict()")
        return gradscaler_state_from_loss_scale(self._scaling().loss_scale)

    # ------------------------------------------------------------------ checkpoints, safely
    def _keep_handle(self, loaded: LossScale) -> LossScale:
        """The LossScale to use for ``loaded`` (validated, nothing changed yet): the one in use,
        holding ``loaded``'s state in its own tensors, so that ``S = opt.scale`` taken before
        stays the scale in use (Note [scale handles]); ``loaded`` itself when there is none yet,
        or when the params moved to another device (the old scale is then retired)."""
        current = self._scaledoptim_scaling
        if current is None:
            return loaded
        if current.loss_scale.assign_(loaded):
            return current.loss_scale
        current.loss_scale.retire(
            f"This scale tensor lived on {current.loss_scale.device}, but the optimizer's params "
            f"moved to {loaded.device}, and so did its scale: pass opt.scale as it is now."
        )
        return loaded

    def _check_between_steps(self, method: str) -> None:
        """Refuses a checkpoint between ``unscale()`` and the step that consumes it."""
        state = self._scaledoptim_scaling
        if state is not None and state.unscaled:
            raise RuntimeError(
                f"{method} was called between unscale() and step_after_unscale(): a checkpoint "
                "cannot hold the pending step (its unscaled grads are not optimizer state). Call "
                "step_after_unscale() (or zero_grad() to drop the step) first."
            )

    def _split_scale_state(
        self, state_dict: dict[str, Any]
    ) -> tuple[LossScale | None, dict[str, Any]]:
        """Validates ``state_dict``'s ``"loss_scale"`` and returns it as a :class:`LossScale` with
        the rest of the state_dict; changes nothing. A state_dict without one (a plain torch.optim
        checkpoint) gives a fresh scale of the optimizer's configuration, or ``None`` for an
        optimizer a GradScaler steps (its scale is the scaler's, loaded with the scaler)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        self._check_between_steps("load_state_dict()")
        current = self._scaling()
        if current.loss_scale.sharers > 1:
            raise RuntimeError(
                "load_state_dict() on an optimizer that shares its scale: load every optimizer, "
                "then call scaledoptim.share_scale(...) again"
            )
        state_dict = dict(state_dict)
        group_scale_state = _pop_group_scale_state(state_dict)
        given = "loss_scale" in state_dict
        scale_state = state_dict.pop("loss_scale", group_scale_state)
        if given and scale_state is None:
            raise TypeError(
                "Corrupt optimizer state_dict: 'loss_scale' is None. Load the 'loss_scale' "
                "state_dict() wrote, or delete the key to start from the configured init_scale"
            )
        device = self._params_device()
        if scale_state is None:
            if current.driver is not None:
                return None, state_dict  # the scaler's scale is the one in use: leave it
            return LossScale(current.loss_scale.config, device), state_dict
        return LossScale.from_state_dict(scale_state, device), state_dict
