"""The hyper-parameters of the dynamic loss scale, validated."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from .checks import is_float32_scale

__all__ = ["ScalingConfig"]

_FLOAT32 = torch.finfo(torch.float32)
# The trackers are int32 tensors, as GradScaler's growth tracker is.
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class ScalingConfig:
    r"""Hyper-parameters of the dynamic loss scale.

    The defaults give exactly :class:`torch.amp.GradScaler`'s sequence of scales: start at
    ``2**16``, halve on every overflow, double after 2000 consecutive clean steps, never grow to
    inf. ``min_scale`` defaults to the smallest normal float32 so that it never binds before
    torch's scale would have underflowed.

    Args:
        init_scale: the scale before the first step.
        growth_factor: multiplies the scale after ``growth_interval`` clean steps (> 1).
        backoff_factor: multiplies the scale when an overflow is not tolerated (in (0, 1)).
        growth_interval: consecutive clean steps before the scale grows; ``2**31`` or more
            (``sys.maxsize``, GradScaler's idiom) never grows it: the growth tracker is an int32,
            as GradScaler's, and stops at its maximum.
        hysteresis: consecutive overflows needed before the scale backs off; ``N`` tolerates
            ``N - 1`` (DeepSpeed/Megatron semantics). Any clean step restores the allowance.
            The int32 hysteresis tracker holds at most ``2**31 - 1``: a larger value tolerates
            as many overflows in a row, which is to say all of them.
        min_scale: the scale never backs off below this.
        max_scale: the scale never grows above this.
        max_replays: how many times a closure may be replayed with a smaller scale in one step
            before :class:`ClosureReplayError` is raised.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    # Literals, not _FLOAT32's attributes: the API reference renders the source of a default,
    # and a reader wants the value. They are float32's tiny and max (a test checks it).
    min_scale: float = 1.1754943508222875e-38
    max_scale: float = 3.4028234663852886e38
    max_replays: int = 32

    def __post_init__(self) -> None:
        def positive_finite(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a Python float, got {type(value).__name__}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"Invalid {name}: {value} (must be finite and > 0 in float32)")
            return float(value)

        def positive_int(name: str, minimum: int) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < minimum:
                raise ValueError(f"Invalid {name}: {value} (must be >= {minimum})")

        for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            object.__setattr__(self, name, positive_finite(name))
        for name in ("init_scale", "min_scale", "max_scale"):
            # The scale lives in float32 and grads are unscaled by its float32 reciprocal: a
            # subnormal scale's reciprocal is inf, and would turn every param NaN unnoticed.
            if not is_float32_scale(getattr(self, name)):
                raise ValueError(
                    f"Invalid {name}: {getattr(self, name)} (a loss scale must be finite and > 0 "
                    "in float32 with a finite float32 reciprocal: between "
                    f"{_FLOAT32.tiny} and {_FLOAT32.max})"
                )
        positive_int("growth_interval", 1)
        positive_int("hysteresis", 1)
        positive_int("max_replays", 0)
        if self.growth_factor <= 1.0:
            raise ValueError(f"Invalid growth_factor: {self.growth_factor} (must be > 1)")
        if self.backoff_factor >= 1.0:
            raise ValueError(f"Invalid backoff_factor: {self.backoff_factor} (must be < 1)")
        if not self.min_scale <= self.init_scale <= self.max_scale:
            raise ValueError(
                f"Invalid scale bounds: need min_scale <= init_scale <= max_scale, got "
                f"{self.min_scale} <= {self.init_scale} <= {self.max_scale}"
            )

    @functools.cached_property  # read at every step: computed once (the config is frozen)
    def tracked_growth_interval(self) -> int:
        """``growth_interval`` as an int64 (the epilogue's and torch's argument); beyond it, as
        beyond 2**31, the int32 growth tracker never gets there."""
        return min(self.growth_interval, _INT64_MAX)

    @functools.cached_property
    def tracked_hysteresis(self) -> int:
        """``hysteresis`` as the int32 hysteresis tracker holds it."""
        return min(self.hysteresis, _INT32_MAX)
