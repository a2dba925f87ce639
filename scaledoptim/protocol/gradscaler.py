"""``scaledoptim.GradScaler``: ``torch.amp.GradScaler``'s object, with the scale inside the
optimizers it steps.

Note [GradScaler facade]
~~~~~~~~~~~~~~~~~~~~~~~~
Frameworks pass a scaler object around (timm's ``loss_scaler``, Lightning's
``MixedPrecision(scaler=...)``, accelerate's ``accelerator.scaler``). This one is a subclass of
``torch.amp.GradScaler`` with its constructor, methods, return values and checkpoint format, so
whatever takes torch's takes it.

*Where the scale lives.* In one :class:`~scaledoptim.scale.LossScale`, created by the first
``scale()`` on the device of what it scales. torch's ``_scale`` and ``_growth_tracker`` are that
LossScale's tensors, and its growth/backoff settings are that LossScale's config (the private
attributes are properties), so torch's own code paths (plain optimizers, ``update()``,
``state_dict()``) read and move the same state. The first ``unscale_``/``step`` of a scaledoptim
optimizer makes that LossScale the optimizer's scale (the optimizer's own scale tensor is
retired, Note [scale handles]): ``opt.scale`` is the scaler's tensor, ``opt.state_dict()``
carries it, and loading either checkpoint loads the one scale. The optimizer's own unscale
methods then refuse (the scaler moves the scale, in ``update()``).

*Several optimizers.* Each one's ``found_inf`` comes from its own grads, so each skips on its
own; ``update()`` is torch's: it sums every optimizer's ``found_inf`` and backs off once.

*scaledoptim optimizers* are stepped through the protocol (Note [step requests] in
guard.py): ``step(opt)`` hands ``opt.step()`` a request to check and unscale by the scaler's
scale without moving it (or, after ``unscale_``, to skip on the ``found_inf`` found then). A
fused optimizer reads ``found_inf`` on device and never reads the host in ``scale``,
``unscale_``, ``step`` or ``update``; since it cannot know on the host whether a step was
skipped, ``step`` returns what ``opt.step()`` returned (as torch's GradScaler does for torch's
fused optimizers). *Other optimizers* get torch's GradScaler code unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from ..scale import LossScale, ScalingConfig, is_float32_scale, loss_scale_from_gradscaler_state
from . import gradscaler_steps, steps
from .clipping import to_max_grad_norm
from .gradscaler_clip import check_no_unscale_before_clip, step_clipping_torch_optimizer
from .optimizer import Optimizer
from .outputs import first_tensor, scale_outputs
from .values import GradPass, Request

__all__ = ["GradScaler"]


def _config_field(name: str) -> Any:
    """A property over the field ``name`` of the scaler's :class:`ScalingConfig`."""

    def get(scaler: GradScaler) -> Any:
        return getattr(scaler._scaling_config(), name)

    def set_(scaler: GradScaler, value: Any) -> None:
        scaler._set_config(**{name: value})

    return property(get, set_)


class GradScaler(torch.amp.GradScaler):
    r"""A drop-in :class:`torch.amp.GradScaler` whose scale is the scale of the scaledoptim
    optimizers it steps.

    Same constructor, methods, return values and ``state_dict`` format as
    :class:`torch.amp.GradScaler` (it is a subclass), so any framework that takes a GradScaler
    takes this one. With scaledoptim's optimizers:

    * ``opt.scale`` and ``get_scale()`` are the same scale once the scaler has stepped
      ``opt``, and ``opt.state_dict()`` carries it;
    * the run follows :class:`torch.amp.GradScaler` + the matching ``torch.optim`` optimizer
      exactly: the same scales, the same skipped iterations, the same params within kernel
      rounding;
    * :meth:`scale`, :meth:`unscale_`, :meth:`step` and :meth:`update` never read the host with
      a fused optimizer (:class:`scaledoptim.AdamW`, ...): a skipped step is skipped on device.
      A generic scaledoptim optimizer (:func:`scaledoptim.with_scaling`) costs one host read per
      :meth:`step`, as under torch's GradScaler.

    With any other optimizer it is :class:`torch.amp.GradScaler`. Differences: :meth:`scale`
    also takes dicts (torch's returns an iterator over the keys) and lets ``None`` entries of a
    list, tuple or dict through; invalid settings raise ``ValueError``/``TypeError`` (torch
    asserts, or accepts a growth factor of 0.5); a bad state_dict is refused before anything
    changes.

    A growth tracker at or past the growth interval (``set_growth_interval(n)`` below the
    clean iterations counted so far) is torch's state, and checkpoints holding it (the
    scaler's and its optimizers') load. :meth:`update` is torch's: it grows the scale only when
    ``tracker + 1 == interval``, so such a tracker counts on without growing the scale until an
    overflow resets it, exactly as torch.amp.GradScaler (torch 2.13); so does an optimizer that
    loads the state and steps with its own protocol.

    Args:
        device: the device type of the scale (``"cuda"``, ``"cpu"``, ...). As torch's, a
            ``"cuda"`` scaler on a machine without CUDA warns and disables itself.
        init_scale: the scale before the first step.
        growth_factor: multiplies the scale after ``growth_interval`` clean iterations (> 1).
        backoff_factor: multiplies the scale after an iteration with inf/nan grads (in (0, 1)).
        growth_interval: consecutive clean iterations before the scale grows.
        enabled: ``False`` makes every method a pass-through: :meth:`scale` returns its input,
            :meth:`step` is ``optimizer.step()``, ``state_dict()`` is ``{}``.

    Example::

        >>> scaler = scaledoptim.GradScaler("cuda")
        >>> opt = scaledoptim.AdamW(model.parameters())
        >>> with torch.autocast("cuda", dtype=torch.float16):
        ...     loss = loss_fn(model(x), y)
        >>> scaler.scale(loss).backward()
        >>> scaler.unscale_(opt)                      # optional: to clip unscaled grads
        >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        >>> scaler.step(opt)                          # skipped on device if found_inf
        >>> scaler.update()
        >>> assert opt.scale.item() == scaler.get_scale()
    """

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

    # ------------------------------------------------------------------ one place for the state
    def _scaling_config(self) -> ScalingConfig:
        return self._loss_scale.config if self._loss_scale is not None else self._config

    def _set_config(self, **changes: Any) -> None:
        config = dataclasses.replace(self._scaling_config(), **changes)  # validates
        self._config = config
        if self._loss_scale is not None:
            self._loss_scale.config = config

    # torch's GradScaler keeps these as plain attributes; here they are the LossScale's config,
    # which the optimizers the scaler steps share (Note [GradScaler facade]).
    _growth_factor = _config_field("growth_factor")
    _backoff_factor = _config_field("backoff_factor")
    _growth_interval = _config_field("growth_interval")

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        config = dataclasses.replace(self._config, init_scale=self._init_scale)
        loss_scale = LossScale(config, torch.device(dev))
        loss_scale.growth_tracker.fill_(self._init_growth_tracker)
        self._loss_scale = loss_scale
        self._scale = loss_scale.scale
        self._growth_tracker = loss_scale.growth_tracker

    # ------------------------------------------------------------------ the iteration
    def scale(self, outputs: Any) -> Any:
        r"""Multiplies a tensor, or every tensor of nested lists/tuples/dicts, by the scale.

        As :meth:`torch.amp.GradScaler.scale` (the scale is created on the device of the first
        tensor, and a 0-dim scale keeps each output's dtype; another iterable comes back as a
        lazy ``map``); dicts come back as dicts, ``None`` entries pass through. Returns
        ``outputs`` unchanged when the scaler is disabled.

        Raises:
            ValueError: ``outputs`` is neither a tensor nor an iterable (a float, ``None``), as
                torch raises.
        """
        if not self._enabled:
            return outputs
        if not isinstance(outputs, (torch.Tensor, list, tuple, Mapping)):
            if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Iterable):
                raise ValueError("outputs must be a Tensor or an iterable of Tensors")
            return map(self.scale, outputs)  # another iterable: scaled lazily, as torch does
        if self._scale is None:
            first = first_tensor(outputs)
            if first is None:
                return outputs  # nothing to scale (torch does not create the scale either)
            self._lazy_init_scale_growth_tracker(first.device)
        return scale_outputs(outputs, self._scale)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's grads by the scale, in place, and checks them for inf/nan.

        As :meth:`torch.amp.GradScaler.unscale_`: optional (to clip or inspect unscaled grads
        before :meth:`step`), once per optimizer per iteration, no host sync; fp16 grads are
        refused (``ValueError``: :meth:`step` without ``unscale_`` takes them, unscaling in fp32
        inside the update). For a scaledoptim optimizer every check runs before anything
        changes, and the optimizer takes the scaler's scale as its own.
        """
        if not self._enabled:
            return
        if not isinstance(optimizer, Optimizer):
            super().unscale_(optimizer)
            return
        self._check_scale_growth_tracker("unscale_")
        gradscaler_steps.check_stage(self, optimizer, "unscale_")
        assert self._loss_scale is not None
        found_inf = gradscaler_steps.unscale(self, optimizer, self._loss_scale, self._touched)
        state = self._per_optimizer_states[id(optimizer)]
        # With no grads nothing was checked (as torch), and step() will say so.
        state["found_inf_per_device"] = {} if found_inf is None else {found_inf.device: found_inf}
        state["stage"] = OptState.UNSCALED

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *args: Any,
        max_grad_norm: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """Unscales the grads (unless :meth:`unscale_` did) and steps, skipping on inf/nan; with
        ``max_grad_norm``, clips the global norm of the unscaled grads inside the step.

        As :meth:`torch.amp.GradScaler.step`; ``*args``/``**kwargs`` go to ``optimizer.step``
        and closures are refused. A scaledoptim optimizer steps through ``optimizer.step()``
        (hooks, schedulers and the profiler see it) with the scaler's ``found_inf``: a fused one
        skips on device (no host read) and the return value is ``optimizer.step()``'s, skipped or
        not; a generic one reads ``found_inf`` on the host and returns ``None`` when skipped.

        ``max_grad_norm=c`` stands for ``unscale_(opt)`` + ``clip_grad_norm_(params, c)`` +
        ``step(opt)``. A scaledoptim optimizer clips inside the step as
        ``opt.unscale_and_step(grads_scaled_by=S, max_grad_norm=c)`` does (no pass of its own,
        no host read) and keeps the norm before clipping in ``opt.grad_norm``; its params are
        those of the three calls within one float32 rounding of each grad the update reads
        (``1 / S`` and the clip factor multiply it once, not twice). Another optimizer runs the
        three calls. ``0`` and ``None`` do not clip; a disabled scaler still clips.

        Returns:
            what ``optimizer.step()`` returned, or ``None`` for a step skipped on the host.

        Raises:
            AssertionError: the optimizer has no grads to check (torch's "No inf checks were
                recorded for this optimizer."), before anything changes.
            RuntimeError: ``max_grad_norm`` after :meth:`unscale_` (the grads are unscaled
                already: clip them yourself, or drop ``unscale_``), before anything changes.
            TypeError, ValueError: a ``max_grad_norm`` that is not a finite Python number >= 0,
                before anything changes.
        """
        max_grad_norm = to_max_grad_norm(max_grad_norm)
        if "closure" in kwargs and (self._enabled or max_grad_norm is not None):
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if max_grad_norm is not None:
            check_no_unscale_before_clip(self, optimizer)
            if not isinstance(optimizer, Optimizer):
                return step_clipping_torch_optimizer(
                    self, optimizer, max_grad_norm, *args, **kwargs
                )
            if not self._enabled:  # not scaled: the optimizer's own step clips
                optimizer.unscale_and_step(max_grad_norm=max_grad_norm)
                return None
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if not isinstance(optimizer, Optimizer):
            return super().step(optimizer, *args, **kwargs)
        self._check_scale_growth_tracker("step")
        stage = gradscaler_steps.check_stage(self, optimizer, "step")
        found_infs = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        if stage is OptState.UNSCALED and found_infs:
            (found_inf,) = found_infs.values()
            request = Request(pending=GradPass(found_inf))
        elif stage is OptState.UNSCALED or not gradscaler_steps.has_grads(optimizer):
            # torch's assertion: an iteration with nothing checked is not a clean one.
            raise AssertionError("No inf checks were recorded for this optimizer.")
        else:
            assert self._loss_scale is not None
            request = gradscaler_steps.step_request(
                self, optimizer, self._loss_scale, self._touched, max_grad_norm
            )
        result, outcome = steps.run_step(optimizer, request, *args, **kwargs)
        state = self._per_optimizer_states[id(optimizer)]
        found_inf = outcome.found_inf
        assert found_inf is not None  # a scale or a found_inf was given
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        state["stage"] = OptState.STEPPED
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Moves the scale once for the iteration: backs off if any optimizer's grads held
        inf/nan, grows after ``growth_interval`` clean iterations (torch's
        ``_amp_update_scale_``, on device); or sets ``new_scale``.

        As :meth:`torch.amp.GradScaler.update`; a Python ``new_scale`` must be a usable float32
        scale (finite, > 0, with a finite reciprocal). The optimizers the scaler steps move with
        it: their scale is this one.
        """
        if not self._enabled:
            return
        if isinstance(new_scale, (int, float)) and not isinstance(new_scale, bool):
            if not is_float32_scale(new_scale):
                raise ValueError(
                    f"Invalid new_scale {new_scale}: a loss scale must be finite and > 0 in "
                    "float32, with a finite float32 reciprocal"
                )
            new_scale = float(new_scale)
        super().update(new_scale)
        if self._loss_scale is not None:
            self._loss_scale.handle["scaled"] = False  # the scale moved for the scaled backward
        self._touched = True

    # ------------------------------------------------------------------ checkpoints and copies
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a ``state_dict()`` of this class or of :class:`torch.amp.GradScaler` (the same
        format): the run continues as the scaler that saved it would have.

        Every key is validated before anything changes. The optimizers the scaler steps see the
        loaded scale at once (it is theirs). A no-op when the scaler is disabled.

        Raises:
            RuntimeError: an empty state_dict (saved by a disabled scaler), as torch raises.
            TypeError, ValueError: anything but a valid GradScaler state_dict (missing or
                unknown keys, wrong types, a scale that is not a usable float32 scale, a growth
                tracker not below ``growth_interval``), naming the key.
        """
        if not self._enabled:
            return
        if isinstance(state_dict, Mapping) and len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled "
                "instance of GradScaler."
            )
        device = self._loss_scale.device if self._loss_scale is not None else torch.device("cpu")
        loaded = loss_scale_from_gradscaler_state(
            state_dict, self._scaling_config(), device, "GradScaler.load_state_dict()"
        )
        # Validated: now change.
        self._config = loaded.config
        self._init_scale = float(state_dict["scale"])
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        if self._loss_scale is not None:
            self._loss_scale.assign_(loaded)
        self._touched = True

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # torch's: refuses mid-iteration, reads the scale
        if self._enabled:
            # The LossScale is rebuilt, from _init_scale and _init_growth_tracker, at the next
            # scale() (as torch rebuilds _scale); a copy does not step the original's optimizers.
            state["_config"] = self._scaling_config()
            state["_loss_scale"] = None
        return state
