"""Owning a dynamic loss scale: the scale itself, its configuration, and its checkpoints."""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from . import checkpoint
from .backward_check import BackwardCheck
from .distributed import check_process_group
from .gradscaler_state import gradscaler_state_from_loss_scale, loss_scale_from_gradscaler_state
from .scaling import LossScale, ScalingConfig, ScalingState, Stage
from .validation import refuse_during_capture

__all__ = ["ScaleOwner"]

_Self = TypeVar("_Self", bound="ScaleOwner")


class ScaleOwner:
    """The loss-scale half of :class:`scaledoptim.Optimizer`, mixed into a torch optimizer."""

    # Per-instance bookkeeping lives under this attribute so that classes made by
    # ``with_scaling`` (whose ``__init__`` we do not own) and patched instances get it lazily.
    _SCALING_ATTR = "_scaledoptim_scaling"
    _BACKWARD_CHECK_ATTR = "_scaledoptim_backward_check"

    def _scaling(self) -> ScalingState:
        state = self.__dict__.get(self._SCALING_ATTR)
        if state is None:
            refuse_during_capture("Creating the loss scale")
            state = ScalingState(LossScale(ScalingConfig(), self._params_device()))
            self.__dict__[self._SCALING_ATTR] = state
        return state

    def _params_device(self) -> torch.device:
        for group in self.param_groups:
            for param in group["params"]:
                return param.device
        raise RuntimeError("The optimizer holds no parameters, so it has no device for its scale")

    @property
    def scale(self) -> torch.Tensor:
        """The current recommended loss scale: a 0-dim float32 tensor on the params' device.

        It is updated in place by :meth:`~scaledoptim.Optimizer.unscale`; ``opt.scale.clone()`` keeps a snapshot.
        """
        return self._scaling().loss_scale.scale

    def configure_scaling(
        self: _Self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = ScalingConfig.min_scale,
        max_scale: float = ScalingConfig.max_scale,
        max_replays: int = ScalingConfig.max_replays,
        process_group: Any = None,
        check_during_backward: bool = False,
    ) -> _Self:
        r"""Sets the dynamic loss scale's hyper-parameters and resets it to ``init_scale``.

        The defaults reproduce :class:`torch.amp.GradScaler`'s scale sequence exactly. See
        :class:`scaledoptim.ScalingConfig` for the other arguments.

        Args:
            process_group: a :class:`torch.distributed.ProcessGroup` whose ranks must agree on
                overflow (DDP, FSDP, sharded optimizers). Every :meth:`~scaledoptim.Optimizer.unscale` then all-reduces
                ``found_inf`` with MAX over it, on device with no host read, before the scale
                moves or anything steps: if one rank overflows, every rank skips and every
                rank's scale moves the same way. Every rank of the group must unscale once per
                iteration. ``None`` (default): no agreement (single process).
            check_during_backward: fold each grad into ``found_inf`` as backward produces it
                (a post-accumulate-grad hook per param), so that the step reads each grad once
                instead of twice on our kernels; grads set or changed after backward are checked
                in the step as usual (the docs' *Concepts* page explains when it helps). Does
                nothing once torch.distributed is initialized: collectives rewrite grads without
                moving their version counters. Not kept in the ``state_dict`` or in copies:
                configure it again after loading or copying.

        Returns:
            the optimizer itself, so ``opt = AdamW(...).configure_scaling(...)`` reads well.
        """
        check_process_group(process_group)
        config = ScalingConfig(
            init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale,
            max_scale=max_scale, max_replays=max_replays,
        )  # fmt: skip
        current = self.__dict__.get(self._SCALING_ATTR)
        if current is not None and current.loss_scale.sharers > 1:
            raise RuntimeError(
                "configure_scaling() on an optimizer that shares its scale: configure the first "
                "optimizer, then call scaledoptim.share_scale(...)"
            )
        self.__dict__[self._SCALING_ATTR] = ScalingState(
            LossScale(config, self._params_device()), process_group=process_group
        )
        previous = self.__dict__.pop(self._BACKWARD_CHECK_ATTR, None)
        if previous is not None:
            previous.remove()
        if check_during_backward:
            self.__dict__[self._BACKWARD_CHECK_ATTR] = BackwardCheck(self)
        return self

    def state_dict(self) -> dict[str, Any]:
        """As :meth:`torch.optim.Optimizer.state_dict`, plus ``"loss_scale"``: the scale, its
        growth and hysteresis trackers and its config. Loading it resumes bit for bit.

        The process group given to :meth:`~scaledoptim.Optimizer.configure_scaling` is not saved (it belongs to the
        run): configure the resumed optimizer with its own, then load.

        Raises:
            RuntimeError: between :meth:`~scaledoptim.Optimizer.unscale` and :meth:`~scaledoptim.Optimizer.step_after_unscale`. A checkpoint
                taken there could not resume exactly: the pending step needs the unscaled grads,
                which no optimizer state_dict holds, and the scale has already moved for it.
                Save before :meth:`~scaledoptim.Optimizer.unscale` or after the step.
        """
        checkpoint.check_between_steps(self, "state_dict()")
        state_dict = super().state_dict()
        state_dict["loss_scale"] = self._scaling().loss_scale.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`torch.optim.Optimizer.load_state_dict`, restoring the loss scale too.

        A plain ``torch.optim`` state_dict (no ``"loss_scale"``) loads with this optimizer's
        scale reset to its configured ``init_scale``. The scale state is validated before
        anything changes. The process group given to :meth:`~scaledoptim.Optimizer.configure_scaling` is kept.

        Raises:
            RuntimeError: between :meth:`~scaledoptim.Optimizer.unscale` and :meth:`~scaledoptim.Optimizer.step_after_unscale` (see
                :meth:`~scaledoptim.Optimizer.state_dict`).
        """
        loss_scale, torch_state_dict = checkpoint.split_scale_state(self, state_dict)
        super().load_state_dict(torch_state_dict)
        self.__dict__[self._SCALING_ATTR] = ScalingState(
            loss_scale, process_group=self._scaling().process_group
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As :meth:`torch.optim.Optimizer.zero_grad`; on a shared scale it also lets the next
        unscale end a round this optimizer's iteration abandoned (see ``LossScale.end_round``)."""
        super().zero_grad(set_to_none)
        state = self.__dict__.get(self._SCALING_ATTR)
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
        scaling = self.__dict__.get(self._SCALING_ATTR)
        if scaling is not None:
            state[self._PICKLED_SCALING] = {
                "loss_scale": scaling.loss_scale.state_dict(),
                "stage": scaling.stage.value,
                "found_inf": None if scaling.found_inf is None else scaling.found_inf.clone(),
            }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        pickled = state.pop(self._PICKLED_SCALING, None)
        super().__setstate__(state)
        if pickled is not None:
            loss_scale = pickled["loss_scale"]
            restored = LossScale.from_state_dict(loss_scale, loss_scale["scale"].device)
            self.__dict__[self._SCALING_ATTR] = ScalingState(
                restored, stage=Stage(pickled["stage"]), found_inf=pickled["found_inf"]
            )

    # ------------------------------------------------------------------ torch.amp.GradScaler state
    def load_gradscaler_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continues a :class:`torch.amp.GradScaler`'s scale: loads ``scaler.state_dict()``.

        Takes its scale, growth tracker, growth/backoff factors and growth interval; keeps this
        optimizer's hysteresis, scale bounds and process group. With their defaults the run
        continues the scale sequence GradScaler would have produced. Validated before anything
        changes.

        Raises:
            TypeError, ValueError: for anything but a valid enabled GradScaler's state_dict.
            RuntimeError: between :meth:`~scaledoptim.Optimizer.unscale` and :meth:`~scaledoptim.Optimizer.step_after_unscale`, or on a
                shared scale.
        """
        checkpoint.check_between_steps(self, "load_gradscaler_state_dict()")
        current = self._scaling()
        if current.loss_scale.sharers > 1:
            raise RuntimeError(
                "load_gradscaler_state_dict() on a shared scale: load it into each optimizer, "
                "then call scaledoptim.share_scale(...) again"
            )
        loaded = loss_scale_from_gradscaler_state(
            state_dict, current.loss_scale.config, self._params_device()
        )
        self.__dict__[self._SCALING_ATTR] = ScalingState(loaded, process_group=current.process_group)

    def gradscaler_state_dict(self) -> dict[str, Any]:
        """The scale as ``torch.amp.GradScaler.state_dict()`` holds it (to go back to GradScaler).

        Reads the scale on the host. Warns if hysteresis or scale bounds are configured
        (GradScaler has neither).

        Raises:
            RuntimeError: between :meth:`~scaledoptim.Optimizer.unscale` and :meth:`~scaledoptim.Optimizer.step_after_unscale`.
        """
        checkpoint.check_between_steps(self, "gradscaler_state_dict()")
        return gradscaler_state_from_loss_scale(self._scaling().loss_scale)
