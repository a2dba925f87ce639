"""Moving a dynamic loss scale between :class:`torch.amp.GradScaler`'s state_dict and a LossScale.

Note [GradScaler state]
~~~~~~~~~~~~~~~~~~~~~~~
``GradScaler.state_dict()`` holds five keys: ``scale`` (a Python float), ``growth_factor``,
``backoff_factor`` (floats), ``growth_interval`` and ``_growth_tracker`` (ints); a disabled
scaler returns ``{}``. Its update rule is our :class:`~scaledoptim.scaling.LossScale` with
``hysteresis=1`` and the default ``min_scale``/``max_scale``, so a scale and tracker imported
from it continue the same sequence of scales and skips, a tracker at or past
``growth_interval`` included (``set_growth_interval(n)`` below the tracker leaves one: the scale
does not grow again until an overflow resets it, in torch as here; Note [growth tracker past
the interval] in loss_scale.py). GradScaler has no hysteresis: an
imported scale starts with the full allowance (``hysteresis_tracker = config.hysteresis``).
Exporting the other way cannot carry hysteresis or scale bounds; that loses behaviour, not
state, so it warns rather than refuses (the scale and tracker it exports are exact).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from .config import ScalingConfig
from .loss_scale import LossScale

__all__ = ["gradscaler_state_from_loss_scale", "loss_scale_from_gradscaler_state"]

_FLOAT_KEYS = ("scale", "growth_factor", "backoff_factor")
_INT_KEYS = ("growth_interval", "_growth_tracker")
_KEYS = _FLOAT_KEYS + _INT_KEYS
_INT32_MAX = 2**31 - 1  # GradScaler's growth tracker is an int32 tensor


def loss_scale_from_gradscaler_state(
    state: Mapping[str, Any],
    base_config: ScalingConfig,
    device: torch.device,
    method: str = "load_gradscaler_state_dict()",
) -> LossScale:
    """Builds a :class:`LossScale` from ``GradScaler.state_dict()``, validating every key first
    (``method``: the public method loading it, for the errors).

    ``growth_factor``, ``backoff_factor`` and ``growth_interval`` come from ``state``; the scale
    also becomes ``init_scale`` (as ``GradScaler.load_state_dict`` does). ``hysteresis``,
    ``min_scale``, ``max_scale`` and ``max_replays`` are kept from ``base_config``.

    Raises:
        TypeError: ``state`` is not a dict (the GradScaler itself, say) or a value has the wrong
            type.
        ValueError: ``state`` is empty (a disabled GradScaler), has missing or unknown keys, or
            a value is out of range.
    """
    if isinstance(state, torch.amp.GradScaler):
        raise TypeError(
            f"{method} takes the scaler's state, not the GradScaler: pass scaler.state_dict()"
        )
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{method} takes the dict GradScaler.state_dict() returned, got a "
            f"{type(state).__name__}: pass scaler.state_dict() (torch.load it from the "
            "checkpoint file)"
        )
    if not state:
        raise ValueError(
            "The GradScaler state is empty: it was saved by a disabled GradScaler "
            "(enabled=False), which never scaled. There is no scale to carry over: train "
            "without scaling (S = None) or keep this optimizer's own scale."
        )
    keys = set(state)
    missing, unknown = set(_KEYS) - keys, keys - set(_KEYS)
    if missing or unknown:
        raise ValueError(
            f"Not a GradScaler state: missing keys {sorted(missing)}, unknown keys "
            f"{sorted(unknown)}. Pass exactly what torch.amp.GradScaler.state_dict() returned "
            f"(keys {list(_KEYS)})."
        )
    for key in _FLOAT_KEYS:
        _check_number(state, key, (int, float))
    for key in _INT_KEYS:
        _check_number(state, key, (int,))
    _check_ranges(state, base_config)
    config = dataclasses.replace(
        base_config,
        init_scale=float(state["scale"]),
        growth_factor=float(state["growth_factor"]),
        backoff_factor=float(state["backoff_factor"]),
        growth_interval=state["growth_interval"],
    )
    loss_scale = LossScale(config, device)  # scale = init_scale; hysteresis_tracker = hysteresis
    loss_scale.growth_tracker.fill_(state["_growth_tracker"])
    return loss_scale


def gradscaler_state_from_loss_scale(loss_scale: LossScale) -> dict[str, Any]:
    """Returns ``loss_scale`` as ``GradScaler.state_dict()`` would hold it (reads the host).

    Warns when the config uses what GradScaler lacks (hysteresis > 1, a non-default
    ``min_scale``/``max_scale``): the state loads, but GradScaler continues without them.
    """
    config = loss_scale.config
    default = ScalingConfig()
    lost = [
        f"{name}={getattr(config, name)}"
        for name in ("hysteresis", "min_scale", "max_scale")
        if getattr(config, name) != getattr(default, name)
    ]
    if lost:
        warnings.warn(
            f"GradScaler has no {', '.join(lost)}: the exported scale and growth tracker are "
            "exact, but a GradScaler resuming from them will back off on every overflow and "
            "never clamp the scale, so its scale sequence can differ from this optimizer's.",
            UserWarning,
            stacklevel=3,
        )
    return {
        "scale": loss_scale.scale.item(),
        "growth_factor": config.growth_factor,
        "backoff_factor": config.backoff_factor,
        "growth_interval": config.growth_interval,
        "_growth_tracker": int(loss_scale.growth_tracker.item()),
    }


def _check_number(state: Mapping[str, Any], key: str, types: tuple[type, ...]) -> None:
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, types):
        wanted = "an int" if types == (int,) else "a Python float"
        raise TypeError(
            f"GradScaler state {key!r} must be {wanted}, got {type(value).__name__}; pass the "
            "dict GradScaler.state_dict() returned, unmodified"
        )


def _check_ranges(state: Mapping[str, Any], base: ScalingConfig) -> None:
    scale, interval, tracker = state["scale"], state["growth_interval"], state["_growth_tracker"]
    problems = {
        "scale": (
            math.isfinite(scale) and base.min_scale <= scale <= base.max_scale,
            f"must be finite and in [min_scale={base.min_scale:g}, max_scale={base.max_scale:g}] "
            "(widen them with opt.configure_scaling(min_scale=..., max_scale=...) first)",
        ),
        "growth_factor": (
            math.isfinite(state["growth_factor"]) and state["growth_factor"] > 1,
            "must be finite and > 1",
        ),
        "backoff_factor": (0 < state["backoff_factor"] < 1, "must be in (0, 1)"),
        "growth_interval": (interval >= 1, "must be >= 1"),
        # At or past the interval after set_growth_interval(n) below it: torch loads that
        # state (Note [growth tracker past the interval]).
        "_growth_tracker": (0 <= tracker <= _INT32_MAX, "must be in [0, 2**31 - 1]"),
    }
    for key, (ok, rule) in problems.items():
        if not ok:
            raise ValueError(f"Invalid GradScaler state {key!r}: {state[key]!r} {rule}")
