"""The dynamic loss-scale state machine, kept in device tensors and updated with no host sync.

It knows no optimizer: a reporter is any object id that reports ``found_inf`` once per round.

Note [scale handles]
~~~~~~~~~~~~~~~~~~~~
Users take ``S = opt.scale`` once and pass it to every call, so a scale tensor is a *handle*:
it must stay the scale in use. The scale of a :class:`LossScale` is updated in place, and a
checkpoint load or a new configuration is copied into the LossScale in use
(:meth:`LossScale.assign_`), so its tensors stay. Where the tensor cannot stay (another
optimizer's tensor after ``share_scale``, a scale that moved to another device) it is
*retired*: the protocol refuses it with the reason, before anything changes, instead of copying
its stale value over the newer state.

The tensor carries a small dict, its handle state (:data:`HANDLE_ATTR`):

* ``"scaled"``: set by ``scale_outputs(outputs, S)``: a backward is being scaled by this scale.
  Cleared when the scale moves for that backward (the reports of a round complete, or a
  GradScaler's ``update()``). A plain ``step()`` reads it to unscale instead of stepping on
  scaled grads (the GradScaler habit).
* ``"retired"``: ``None``, or why the tensor is no longer any optimizer's scale.

A dict of a bool and a string: it pickles and loads under ``torch.load(weights_only=True)``
with the tensor, and ``torch.compile`` traces the write in ``scale_outputs`` without a graph
break or a guard on its value. ``clone()`` (and so every ``state_dict``) does not copy it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from .checks import is_float32_scale
from .config import ScalingConfig

__all__ = ["HANDLE_ATTR", "LossScale", "ScaleUpdate", "handle_state"]

_FLOAT32 = torch.finfo(torch.float32)

#: The attribute of a scale tensor that holds its handle state (Note [scale handles]).
HANDLE_ATTR = "_scaledoptim_handle"


def handle_state(tensor: torch.Tensor) -> dict[str, Any] | None:
    """The handle state of a scale tensor (Note [scale handles]), ``None`` for any other tensor."""
    return getattr(tensor, HANDLE_ATTR, None)


class LossScale:
    r"""The scale, its growth tracker and its hysteresis tracker, as 0-dim device tensors.

    :meth:`update_` writes the next recommended scale *in place*, so the tensor returned by
    :attr:`scale` is stable (CUDA-graph friendly) and always holds the current recommendation.
    Several optimizers may share one ``LossScale`` (see :func:`scaledoptim.share_scale`): then the
    scale moves once per round, after every sharer has reported its ``found_inf``.
    """

    def __init__(self, config: ScalingConfig, device: torch.device) -> None:
        self.config = config
        self.scale = torch.full((), config.init_scale, dtype=torch.float32, device=device)
        self.handle: dict[str, Any] = {"scaled": False, "retired": None}
        setattr(self.scale, HANDLE_ATTR, self.handle)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.hysteresis_tracker = torch.full(
            (), config.tracked_hysteresis, dtype=torch.int32, device=device
        )
        self.sharers = 1
        self._round: set[int] = set()
        # Sharers that called zero_grad() since the current round began (see end_round).
        self._zeroed: set[int] = set()
        self._round_found_inf = torch.zeros((), dtype=torch.float32, device=device)

    @property
    def device(self) -> torch.device:
        return self.scale.device

    # ------------------------------------------------------------------ the handle
    def assign_(self, other: LossScale) -> bool:
        """Takes ``other``'s config, scale and trackers *in place*, so that this object, its
        tensors and every handle to its scale stay the ones in use (Note [scale handles]).
        Returns ``False``, changing nothing, when ``other`` lives on another device: the caller
        then replaces this LossScale and retires its scale."""
        if other.device != self.device:
            return False
        self.config = other.config
        for name in ("scale", "growth_tracker", "hysteresis_tracker"):
            getattr(self, name).copy_(getattr(other, name))
        self.handle["scaled"] = False  # a new state: nothing was scaled by it yet
        return True

    def retire(self, reason: str) -> None:
        """Marks this scale's tensor as no longer in use; the protocol refuses it with
        ``reason``."""
        self.handle["retired"] = reason

    def scaled_for(self, reporter: int) -> bool:
        """Whether a backward was scaled by this scale (``scale_outputs``) that ``reporter`` has
        not unscaled yet (Note [scale handles])."""
        return bool(self.handle["scaled"]) and reporter not in self._round

    def check_can_report(self, reporter: int) -> None:
        """Raises if ``reporter`` already reported in the current round of a shared scale
        (and no new iteration began since: see :meth:`end_round`)."""
        if reporter in self._round and not self._abandoned():
            raise RuntimeError(
                "This optimizer already unscaled in the current round of a shared loss scale, but "
                f"only {len(self._round)} of the {self.sharers} optimizers sharing it did. Every "
                "optimizer that shares a scale must call unscale()/unscale_and_step() once per "
                "iteration before any of them unscales again."
            )

    def round_move(
        self, reporter: int, scaled_by: torch.Tensor, found_inf: torch.Tensor, *,
        force_backoff: bool,
    ) -> ScaleUpdate | None:
        """The move of a shared scale that ``reporter``'s report completes, or ``None`` while the
        round waits for other sharers; changes nothing (:meth:`record_report` records the report
        once the step ran). An unshared scale moves at every report: ``ScaleUpdate(self, ...)``."""
        if reporter in self._round or len(self._round) + 1 < self.sharers:
            # (A reporter already in the round starts an abandoned one over: check_can_report.)
            return None
        # A new tensor: the round's flag is cleared when the report is recorded.
        found = torch.maximum(self._round_found_inf, found_inf)
        return ScaleUpdate(self, scaled_by, found, force_backoff)

    def record_report(self, reporter: int, found_inf: torch.Tensor) -> None:
        """Records ``reporter``'s report to a shared scale's round, whose move, when it completes
        the round, :meth:`round_move` gave and the step applied."""
        if reporter in self._round:  # check_can_report let it through: the round was abandoned
            self._clear_round()
        torch.maximum(self._round_found_inf, found_inf, out=self._round_found_inf)
        self._round.add(reporter)
        if len(self._round) == self.sharers:
            self.handle["scaled"] = False  # every sharer unscaled the scaled backward
            self._clear_round()

    def _clear_round(self) -> None:
        self._round_found_inf.zero_()
        self._round.clear()
        self._zeroed.clear()

    def end_round(self, reporter: int) -> None:
        """``reporter`` called ``zero_grad()``. Once every sharer has called it since a round
        began, a new iteration has begun: the pending round was abandoned (an exception between
        the sharers' unscales, say) and ends, unmoved, when a sharer that reported in it
        reports again, instead of wedging every later iteration.

        The round is not dropped at once: ``opt_g.step(); opt_g.zero_grad()`` before ``opt_d``
        unscales is a common order, and its round must still count both; and one optimizer
        unscaling twice while another never did stays an error.
        """
        if self._round:
            self._zeroed.add(reporter)

    def _abandoned(self) -> bool:
        return len(self._zeroed) == self.sharers

    @torch.no_grad()
    def update_(
        self, scaled_by: torch.Tensor, found_inf: torch.Tensor, *, force_backoff: bool = False
    ) -> None:
        r"""Sets the scale recommended after a step whose grads were scaled by ``scaled_by``.

        Sync-free. ``scaled_by * factor`` is computed in float64 and rounded once to float32, as
        ``torch._amp_update_scale_`` does, so any factor gives GradScaler's exact sequence. With
        GradScaler's semantics (hysteresis 1, no upper bound, no forced backoff) this is
        ``torch._amp_update_scale_`` itself plus the ``min_scale`` clamp; otherwise a few
        ``torch.where``\ s. With hysteresis 1 the hysteresis tracker is never written (it stays 1:
        nothing is tolerated either way). ``force_backoff`` ignores the hysteresis allowance
        (closure replay: replaying the same batch at the same scale would overflow again).
        ``cuda/step_epilogue.cu`` implements the same rules.
        """
        # See Note [scale update] in cuda/step_epilogue.cu: the kernel applies the same rules.
        c = self.config
        if (
            c.hysteresis == 1
            and not force_backoff
            and c.max_scale == _FLOAT32.max
            and c.growth_interval < _INT32_MAX
        ):
            if scaled_by is not self.scale:
                self.scale.copy_(scaled_by)
            # The tracker stops at the int32 maximum instead of wrapping, as in the epilogue;
            # below the interval (the only case that grows) this clamp changes nothing.
            self.growth_tracker.clamp_(max=_INT32_MAX - 1)
            torch._amp_update_scale_(
                self.scale, self.growth_tracker, found_inf,
                c.growth_factor, c.backoff_factor, c.tracked_growth_interval,
            )
            self.scale.clamp_(min=c.min_scale)
            return
        overflow = found_inf > 0
        hysteresis_left = torch.where(
            overflow, (self.hysteresis_tracker - 1).clamp_(min=0), c.tracked_hysteresis
        ).to(torch.int32)
        back_off = overflow if force_backoff else overflow & (hysteresis_left <= 0)
        # In 64 bits: torch would cast the interval to the int32 tracker's dtype (sys.maxsize
        # to -1: growth at every step). The tracker stops at its maximum, as in the epilogue.
        # torch's rule: grow when the count *reaches* the interval (Note [growth tracker past
        # the interval]).
        clean_steps = self.growth_tracker.long() + 1
        grow = ~overflow & (clean_steps == c.tracked_growth_interval)
        wide = scaled_by.double()
        grown = (wide * c.growth_factor).float()
        grown = torch.where(torch.isfinite(grown), grown.clamp(max=c.max_scale), scaled_by)
        backed_off = (wide * c.backoff_factor).float().clamp_(min=c.min_scale)
        new_scale = torch.where(back_off, backed_off, torch.where(grow, grown, scaled_by))
        self.scale.copy_(new_scale)
        self.growth_tracker.copy_(
            torch.where(overflow | grow, 0, clean_steps.clamp(max=torch.iinfo(torch.int32).max))
        )
        if c.hysteresis > 1:
            self.hysteresis_tracker.copy_(hysteresis_left)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit for bit: tensors are cloned, config is plain data."""
        return {
            "scale": self.scale.detach().clone(),
            "growth_tracker": self.growth_tracker.detach().clone(),
            "hysteresis_tracker": self.hysteresis_tracker.detach().clone(),
            "config": dataclasses.asdict(self.config),
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], device: torch.device) -> LossScale:
        """Builds a ``LossScale`` from :meth:`state_dict` output, validating every field.

        Reads the values on the host (this is a checkpoint load, not a training step). The
        scale must be a real floating one-element tensor, the trackers integer ones; a growth
        tracker at or past ``growth_interval`` loads, and (as in torch.amp.GradScaler) the scale
        does not grow again until an overflow resets it. Every key is required, and no other.

        Raises:
            TypeError: ``state`` is not a dict, or a tensor has the wrong kind of dtype.
            ValueError: a missing or unknown key, or a value out of range, naming it.
        """
        if not isinstance(state, Mapping):
            raise TypeError(
                f"Corrupt optimizer state_dict: 'loss_scale' must be a dict, got a "
                f"{type(state).__name__}; {_FIX}"
            )
        missing, unknown = _STATE_KEYS - set(state), set(map(str, state)) - _STATE_KEYS
        if missing or unknown:
            raise ValueError(
                f"Corrupt loss_scale state: missing {sorted(missing)}, unknown "
                f"{sorted(unknown)} (it holds {sorted(_STATE_KEYS)}); {_FIX}"
            )
        if not isinstance(state["config"], Mapping):
            raise TypeError(
                f"Corrupt loss_scale state: 'config' must be a dict, got a "
                f"{type(state['config']).__name__}; {_FIX}"
            )
        # Every field, since the first release wrote them all: a missing one would silently
        # take its default instead of the saved setting.
        known = {f.name for f in dataclasses.fields(ScalingConfig)}
        missing_fields = known - set(state["config"])
        unknown_fields = set(map(str, state["config"])) - known
        if missing_fields or unknown_fields:
            raise ValueError(
                f"Corrupt loss_scale state: missing config keys {sorted(missing_fields)}, "
                f"unknown config keys {sorted(unknown_fields)}; {_FIX}"
            )
        try:
            config = ScalingConfig(**state["config"])
        except (TypeError, ValueError) as error:
            raise type(error)(f"Corrupt loss_scale state: 'config': {error}; {_FIX}") from error
        values = {name: _read_one(state, name) for name in _TENSOR_DTYPES}
        scale = values["scale"]
        in_bounds = config.min_scale <= scale <= config.max_scale
        if not (math.isfinite(scale) and in_bounds and is_float32_scale(scale)):
            raise ValueError(
                f"Corrupt loss_scale state: scale {scale} is not finite and > 0 in float32 "
                f"with a finite float32 reciprocal, or outside [min_scale={config.min_scale}, "
                f"max_scale={config.max_scale}]; {_FIX}"
            )
        # Note [growth tracker past the interval]
        # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        # A growth tracker at or past growth_interval is a state torch.amp.GradScaler and the
        # library write (set_growth_interval(n) below the clean steps counted), so it loads.
        # Every path moves it by torch's rule, ``_amp_update_scale_``'s: grow when tracker + 1
        # == interval. Such a tracker counts on and the scale does not grow until an overflow
        # resets it, in torch.amp.GradScaler, scaledoptim.GradScaler, the optimizer's own
        # protocol (update_ here, both branches, and cuda/step_epilogue.cu) and after
        # load_gradscaler_state_dict: one behaviour, torch's (a quirk matched: it loses no
        # data). A hysteresis tracker beyond its config would tolerate more overflows than
        # configured: refused.
        limits = {"growth_tracker": _INT32_MAX, "hysteresis_tracker": config.tracked_hysteresis}
        for name, limit in limits.items():
            if not 0 <= values[name] <= limit:
                raise ValueError(
                    f"Corrupt loss_scale state: {name} = {values[name]} is not an integer in "
                    f"[0, {limit}] for its config; {_FIX}"
                )
        loss_scale = cls(config, device)
        loss_scale.scale.copy_(state["scale"].reshape(()))
        loss_scale.growth_tracker.fill_(int(values["growth_tracker"]))
        loss_scale.hysteresis_tracker.fill_(int(values["hysteresis_tracker"]))
        return loss_scale


_STATE_KEYS = frozenset({"scale", "growth_tracker", "hysteresis_tracker", "config"})
_FIX = (
    "load the 'loss_scale' a scaledoptim optimizer's state_dict() wrote, or delete the key to "
    "start from the configured init_scale"
)
#: What each tensor of a loss_scale state holds: a real floating scale, integer trackers (a bool
#: or complex scale would be read as 1.0 or lose its imaginary part).
_TENSOR_DTYPES = {"scale": "a real floating", "growth_tracker": "an integer",
                  "hysteresis_tracker": "an integer"}
_INT32_MAX = torch.iinfo(torch.int32).max


def _read_one(state: Mapping[str, Any], name: str) -> float:
    """The value of the one-element tensor ``state[name]``, read on the host, after checking its
    kind (:data:`_TENSOR_DTYPES`)."""
    value = state[name]
    wanted = _TENSOR_DTYPES[name]
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.is_meta:
        raise ValueError(
            f"Corrupt loss_scale state: {name!r} must be a one-element tensor with data, got "
            f"{_describe(value)}; pass the 'loss_scale' a scaledoptim optimizer's state_dict() "
            "wrote, or drop the key to start from the configured init_scale"
        )
    floating = value.is_floating_point()
    integer = not (floating or value.is_complex() or value.dtype == torch.bool)
    if not (floating if name == "scale" else integer):
        raise TypeError(
            f"Corrupt loss_scale state: {name!r} must be {wanted} tensor, got a {value.dtype} "
            "one; pass the 'loss_scale' a scaledoptim optimizer's state_dict() wrote"
        )
    return float(value.detach().reshape(()).to("cpu", torch.float64).item())


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        kind = "meta tensor" if value.is_meta else "tensor"
        return f"a {value.dtype} {kind} of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


@dataclasses.dataclass(frozen=True)
class ScaleUpdate:
    """A move of ``loss_scale`` decided by a round of reports, not yet applied: the step's
    epilogue kernel applies it on the kernel backend (one launch instead of several ops)."""

    loss_scale: LossScale
    scaled_by: torch.Tensor
    found_inf: torch.Tensor
    force_backoff: bool

    def apply(self) -> None:
        """Applies it with torch ops (Note [scale update] in cuda/step_epilogue.cu)."""
        self.loss_scale.update_(self.scaled_by, self.found_inf, force_backoff=self.force_backoff)
