"""``torch.amp.GradScaler`` with its scale, growth tracker and settings held by one
:class:`~scaledoptim.scale.LossScale`: the base of ``scaledoptim.GradScaler`` (*Where the scale
lives* in Note [GradScaler facade], gradscaler.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..scale import LossScale, ScalingConfig

__all__ = ["LossScaleGradScaler"]


class LossScaleGradScaler(torch.amp.GradScaler):
    """:class:`torch.amp.GradScaler` whose scale, growth tracker and settings are one
    :class:`~scaledoptim.scale.LossScale`'s (created by the first ``scale()``)."""

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        self._loss_scale: LossScale | None = None
        # Whether the scale was loaded or moved by update(): adopting an optimizer whose scale
        # came from a checkpoint, a fresh scaler warns (that scale would be dropped).
        self._touched = False
        if enabled:
            # The settings, validated before torch's __init__ stores them (through the
            # properties below) and kept here until the first scale() makes the LossScale.
            self._config = ScalingConfig(
                init_scale=init_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
            )
        super().__init__(
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled
        )

    def _scaling_config(self) -> ScalingConfig:
        return self._loss_scale.config if self._loss_scale is not None else self._config

    def _set_config(self, **changes: Any) -> None:
        config = dataclasses.replace(self._scaling_config(), **changes)  # validates
        self._config = config
        if self._loss_scale is not None:
            self._loss_scale.config = config

    # torch's GradScaler keeps these as plain attributes; here they are the LossScale's config,
    # which the optimizers the scaler steps share (Note [GradScaler facade] in gradscaler.py).
    @property
    def _growth_factor(self) -> float:
        return self._scaling_config().growth_factor

    @_growth_factor.setter
    def _growth_factor(self, value: float) -> None:
        self._set_config(growth_factor=value)

    @property
    def _backoff_factor(self) -> float:
        return self._scaling_config().backoff_factor

    @_backoff_factor.setter
    def _backoff_factor(self, value: float) -> None:
        self._set_config(backoff_factor=value)

    @property
    def _growth_interval(self) -> int:
        return self._scaling_config().growth_interval

    @_growth_interval.setter
    def _growth_interval(self, value: int) -> None:
        self._set_config(growth_interval=value)

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        config = dataclasses.replace(self._config, init_scale=self._init_scale)
        loss_scale = LossScale(config, torch.device(dev))
        loss_scale.growth_tracker.fill_(self._init_growth_tracker)
        self._loss_scale = loss_scale
        self._scale = loss_scale.scale
        self._growth_tracker = loss_scale.growth_tracker

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # torch's: refuses mid-iteration, reads the scale
        if self._enabled:
            # The LossScale is rebuilt, from _init_scale and _init_growth_tracker, at the next
            # scale() (as torch rebuilds _scale); a copy does not step the original's optimizers.
            state["_config"] = self._scaling_config()
            state["_loss_scale"] = None
        return state
