"""A Lightning precision plugin that scales with the optimizer's own scale (closures included).

Note [Lightning precision plugin]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Lightning calls the plugin at three points: ``forward_context`` (the autocast region),
``backward`` (the loss of one micro-batch, with the optimizer or, under manual optimization,
``None``) and ``optimizer_step`` (with Lightning's closure, which runs ``training_step`` and
``backward``). The scale the backward multiplies by is the optimizer's ``opt.scale``, which
only moves in ``unscale``: every micro-batch of an accumulation window is scaled by the same
``S``. Inside ``optimizer_step`` the closure evaluation in progress may use another ``S``
(a replay), so the plugin passes it to ``backward`` through ``_scale_override``.

Two step paths:

* one closure evaluation (every torch.optim and scaledoptim optimizer but LBFGS): run the
  closure, ``unscale``, Lightning's ``on_before_optimizer_step`` and clipping on the unscaled
  grads, then ``step_after_unscale`` -- sync-free on fused optimizers, as GradScaler would;
  with ``gradient_clip_val`` and ``gradient_clip_algorithm="norm"`` (and ``clip_in_step``):
  run the closure, the hooks on the grads as the backward left them (``clip_gradients`` only
  records the value), then ``unscale_and_step(grads_scaled_by=S, max_grad_norm=value)``, which
  unscales and clips inside the step (Note [clipping in the step] in protocol/clipping.py);
* closure replay (LBFGS and optimizers we cannot see into): ``step_after_unscale(closure)``
  with a closure that runs Lightning's closure, unscales, and calls the same hooks, so the
  hooks see unscaled grads on every evaluation, and an overflowed evaluation is replayed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any, Literal

import torch

from ..amp import autocast
from ..protocol import Optimizer, scale_outputs
from ..protocol.clipping import to_max_grad_norm

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "scaledoptim.integrations.lightning needs Lightning, the lightning extra: "
        'pip install -e ".[lightning]" in a checkout, or pip install "scaledoptim[lightning]" '
        "where scaledoptim was installed from a wheel"
    ) from error

__all__ = ["ScaledMixedPrecision"]

_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


class ScaledMixedPrecision(Precision):
    r"""Mixed precision for ``lightning.pytorch``, with the loss scale inside the optimizer.

    ``Trainer(plugins=[ScaledMixedPrecision("16-mixed")])`` runs the forward under
    :func:`scaledoptim.autocast`, scales each backward by the optimizer's :attr:`~Optimizer.scale`
    and steps with :meth:`~Optimizer.unscale` / :meth:`~Optimizer.step_after_unscale`, skipping
    overflowed steps. ``configure_optimizers`` may return any :class:`scaledoptim.Optimizer`,
    :class:`scaledoptim.LBFGS` included (its closure is replayed with a smaller scale until its
    grads are finite). Norm clipping (``Trainer(gradient_clip_val=c)``, the default
    ``gradient_clip_algorithm="norm"``) runs inside the step:
    ``opt.unscale_and_step(grads_scaled_by=S, max_grad_norm=c)`` clips the global norm of the
    unscaled grads as ``torch.nn.utils.clip_grad_norm_`` does without writing the grads, and
    the norm before clipping is logged as ``scaledoptim/grad_norm``; ``on_before_optimizer_step``
    then sees the grads scaled and not clipped (``clip_in_step=False`` unscales them first, as
    before). Otherwise gradient clipping (by value too) and ``on_before_optimizer_step`` see
    unscaled grads, on every closure evaluation. Gradient accumulation works (one ``S`` per
    window); manual optimization works when the backward's scale is unambiguous (one
    optimizer, or optimizers sharing one scale through :func:`scaledoptim.share_scale`). The
    scale is saved in the optimizer's state_dict, so Lightning checkpoints resume it; the
    plugin's own state is the count of skipped steps. Each step logs ``scaledoptim/scale`` and
    ``scaledoptim/skipped_steps`` (suffixed ``_<i>`` for optimizer ``i`` when there are
    several) to the loggers and the progress bar.

    ``"bf16-mixed"`` needs no scale: the forward runs under bf16 autocast and any optimizer
    steps as usual.

    Args:
        precision: ``"16-mixed"`` (float16, scaled) or ``"bf16-mixed"`` (bfloat16, unscaled).
        device: the autocast device type (``"cpu"``, ``"cuda"``); ``None``: the model's.
        closure_replay: ``True`` replays the closure on overflow (needed when ``step``
            evaluates the closure more than once); ``False`` evaluates it once, before the
            step. ``None`` (default) replays for :class:`torch.optim.LBFGS` and for optimizers
            whose ``step`` is neither torch's nor scaledoptim's.
        clip_in_step: ``True`` (default) clips by norm inside the step (see above); ``False``
            unscales the grads in place before the hooks and Lightning's own clipping.

    Example::

        >>> trainer = lightning.pytorch.Trainer(plugins=[ScaledMixedPrecision("16-mixed")])
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed",
        device: str | None = None,
        closure_replay: bool | None = None,
        clip_in_step: bool = True,
    ) -> None:
        if precision not in _DTYPES:
            raise ValueError(
                f"Invalid precision: {precision!r} (ScaledMixedPrecision takes '16-mixed' or "
                "'bf16-mixed'; for full precision drop the plugin)"
            )
        if closure_replay not in (None, True, False):
            raise TypeError(f"closure_replay must be None or a bool, got {closure_replay!r}")
        if not isinstance(clip_in_step, bool):
            raise TypeError(f"clip_in_step must be a bool, got {clip_in_step!r}")
        self.clip_in_step = clip_in_step
        # Set while the hooks run before a step that clips: what clip_gradients recorded.
        self._clipping: list[float] | None = None
        self.precision = precision
        self.device = device
        self._closure_replay = closure_replay
        self._scale_override: torch.Tensor | None = None
        self._skipped: dict[int, torch.Tensor] = {}

    @property
    def _scaled(self) -> bool:
        return self.precision == "16-mixed"

    # ------------------------------------------------------------------ setup
    def connect(
        self, model: torch.nn.Module, optimizers: list[Any], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[Any], list[Any]]:
        """Checks the optimizers and picks the autocast device from the model's parameters."""
        if self._scaled:
            for optimizer in optimizers:
                _require_scaling(optimizer)
        if self.device is None:
            param = next(model.parameters(), None)
            self.device = param.device.type if param is not None else None
        return super().connect(model, optimizers, lr_schedulers)

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """The :func:`scaledoptim.autocast` region of every forward."""
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        with autocast(device, dtype=_DTYPES[self.precision], cache_enabled=False):
            yield

    # ------------------------------------------------------------------ backward
    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: pl.LightningModule,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Runs ``model.backward`` on the loss scaled by the scale of this step."""
        scale = self._backward_scale(model, optimizer) if self._scaled else None
        model.backward(scale_outputs(tensor, scale), *args, **kwargs)

    def _backward_scale(self, model: pl.LightningModule, optimizer: Any) -> torch.Tensor:
        if self._scale_override is not None:
            return self._scale_override
        if optimizer is not None:
            return _require_scaling(optimizer).scale
        # Manual optimization: Lightning does not say which optimizer this backward is for.
        scales = {id(s): s for s in (_require_scaling(o).scale for o in model.trainer.optimizers)}
        if len(scales) != 1:
            raise RuntimeError(
                "manual_backward() with several optimizers that have scales of their own: "
                "ScaledMixedPrecision cannot tell which scale to multiply the loss by. Share one "
                "scale in configure_optimizers (scaledoptim.share_scale(opt_a, opt_b)), or use "
                "automatic optimization."
            )
        return scales.popitem()[1]

    # ------------------------------------------------------------------ step
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Evaluates the closure, unscales, runs the hooks and steps, skipping on overflow."""
        if not self._scaled:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        opt = _require_scaling(optimizer)
        if kwargs:
            raise TypeError(
                f"ScaledMixedPrecision steps with opt.step_after_unscale(), which takes no extra "
                f"arguments; got optimizer.step(**{sorted(kwargs)})"
            )
        if self._replays(opt):
            return self._step_replaying(opt, model, closure)
        scale = opt.scale
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: no backward ran, so there is nothing to step.
            self._after_closure(model, opt)
            return closure_result
        if self._clips_in_step(model):
            self._clipping = []
            try:
                self._after_closure(model, opt)  # the hooks; clip_gradients records the value
                clip = self._clipping[-1] if self._clipping else None
            finally:
                self._clipping = None
            _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=scale, max_grad_norm=clip)
            self._record(model, opt, found_inf, opt.grad_norm if clip is not None else None)
            return closure_result
        found_inf, _ = opt.unscale(grads_scaled_by=scale)
        self._after_closure(model, opt)  # on_before_optimizer_step and clipping: unscaled grads
        opt.step_after_unscale()
        self._record(model, opt, found_inf)
        return closure_result

    def _clips_in_step(self, model: pl.LightningModule) -> bool:
        """Whether this step clips inside ``unscale_and_step``: norm clipping configured
        (``gradient_clip_val`` 0 and ``None`` do not clip; negative, nan and inf raise)."""
        trainer = model.trainer
        value, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        try:
            value = to_max_grad_norm(value)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"Invalid Trainer(gradient_clip_val={value!r}): the norm or value to clip the "
                "grads to must be finite and > 0 (0 or None: no clipping)"
            ) from error
        return (
            self.clip_in_step
            and model.automatic_optimization
            and value is not None
            and algorithm in (None, "norm")
        )

    def clip_gradients(
        self, optimizer: Any, clip_val: int | float = 0.0, gradient_clip_algorithm: Any = "norm"
    ) -> None:
        """Clips the grads; before a step that clips by norm inside ``unscale_and_step`` it
        records ``clip_val`` for that step instead (the grads are still scaled)."""
        if self._clipping is None or clip_val is None or clip_val <= 0:
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
        if gradient_clip_algorithm != "norm":
            raise RuntimeError(
                f"ScaledMixedPrecision clips by norm inside the step, where the grads are still "
                f"scaled: clipping by {gradient_clip_algorithm!r} there would clip scaled "
                "values. Pass ScaledMixedPrecision(clip_in_step=False) to unscale the grads "
                "before configure_gradient_clipping, or clip by norm."
            )
        self._clipping.append(float(clip_val))
        return None

    def _replays(self, opt: Optimizer) -> bool:
        if self._closure_replay is not None:
            return self._closure_replay
        if isinstance(opt, torch.optim.LBFGS):
            return True
        module = getattr(type(opt).step, "__module__", None) or ""
        return not module.startswith(("torch.optim.", "scaledoptim."))

    def _step_replaying(
        self, opt: Optimizer, model: pl.LightningModule, closure: Callable[[], Any]
    ) -> Any:
        trainer = model.trainer
        if model.automatic_optimization and trainer.accumulate_grad_batches > 1:
            raise RuntimeError(
                "Closure replay cannot be combined with accumulate_grad_batches > 1: a replay "
                "re-runs only the last micro-batch, while the others were scaled by the old "
                "scale. Set accumulate_grad_batches=1, or pass "
                "ScaledMixedPrecision(closure_replay=False) if the optimizer evaluates its "
                "closure once."
            )

        def evaluate(scale: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
            self._scale_override = scale
            try:
                loss = closure()
            finally:
                self._scale_override = None
            found_inf, next_scale = opt.unscale(grads_scaled_by=scale)
            self._after_closure(model, opt)
            return loss, found_inf, next_scale

        stepped = opt.step_after_unscale(evaluate, current_grad_scale=opt.scale)
        assert stepped is not None  # a closure's step returns (loss, found_inf, scale)
        loss, found_inf, _ = stepped
        self._record(model, opt, found_inf)
        return loss

    def _record(
        self,
        model: pl.LightningModule,
        opt: Optimizer,
        found_inf: torch.Tensor,
        grad_norm: torch.Tensor | None = None,
    ) -> None:
        """Counts a skipped step on device (no host read) and logs the scale, the count and the
        norm of a step that clipped."""
        optimizers = [getattr(o, "_optimizer", o) for o in model.trainer.optimizers]
        index = next((i for i, o in enumerate(optimizers) if o is opt), 0)
        skipped = self._skipped.get(index)
        if skipped is None or skipped.device != found_inf.device:
            start = 0 if skipped is None else skipped
            skipped = self._skipped[index] = torch.zeros_like(found_inf).add_(start)
        skipped.add_(found_inf)
        suffix = "" if len(optimizers) == 1 else f"_{index}"
        logged = [("scale", opt.scale), ("skipped_steps", skipped)]
        if grad_norm is not None:
            logged.append(("grad_norm", grad_norm))
        for name, value in logged:
            model.log(
                f"scaledoptim/{name}{suffix}",
                value,
                on_step=True,
                on_epoch=False,
                prog_bar=True,
                batch_size=1,
            )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The skipped-step counts (host reads); the scale itself is in the optimizer's state."""
        return {"skipped_steps": {i: int(count.item()) for i, count in self._skipped.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the skipped-step counts saved by :meth:`state_dict`."""
        counts = state_dict.get("skipped_steps", {}) if isinstance(state_dict, dict) else None
        if not isinstance(counts, dict):
            raise TypeError(
                "ScaledMixedPrecision state must be {'skipped_steps': {index: count}}, got "
                f"{type(state_dict).__name__}; pass what its state_dict() returned"
            )
        self._skipped = {
            int(i): torch.tensor(float(count), dtype=torch.float32) for i, count in counts.items()
        }


def _require_scaling(optimizer: Any) -> Optimizer:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's optimizer
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"ScaledMixedPrecision('16-mixed') needs optimizers that own a loss scale, got "
            f"{type(optimizer).__name__}. Return a scaledoptim optimizer from "
            "configure_optimizers (scaledoptim.AdamW, scaledoptim.LBFGS, ...), or wrap yours: "
            "scaledoptim.patch_optimizer(opt)."
        )
    return optimizer
