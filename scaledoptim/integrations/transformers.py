"""A ``transformers.Trainer`` that autocasts and scales with scaledoptim, on any device.

Note [ScaledTrainer hooks]
~~~~~~~~~~~~~~~~~~~~~~~~~~
``Trainer(fp16=True)`` hands mixed precision to accelerate, whose ``GradScaler`` drives the
optimizer as a plain one (its ``opt.scale`` is then not the scale in use), and which trains in
fp32 on CPU. ``ScaledTrainer`` keeps accelerate out of it and does the work itself, at the
Trainer's and the Accelerator's public methods:

* ``create_accelerator_and_postprocess``: the Accelerator is created with
  ``mixed_precision="no"`` (``args.mixed_precision`` reads ``"no"`` during the call, and is
  restored after), then checked (no ``GradScaler``, no mixed precision: a transformers release
  that builds it otherwise fails here, loudly) and given the public overrides of
  ``trainer_accelerator.py`` (``clip_grad_norm_`` and ``prepare_optimizer`` below):
  ``backward`` multiplies the loss by the optimizer's ``opt.scale``, and
  ``optimizer_step_was_skipped`` (which the Trainer asks before stepping the LR scheduler) says
  whether the last unscale found inf/nan. This class swap is the one place that reaches past
  the Trainer's own methods: ``tests/integrations/test_transformers_trainer.py`` checks it.
* ``autocast_smart_context_manager``: the :func:`scaledoptim.autocast` region of every
  ``compute_loss`` (training and evaluation).
* ``clip_grad_norm_`` (Accelerator, public) and ``step`` (of accelerate's ``AcceleratedOptimizer``,
  public): with ``args.max_grad_norm`` set (not 0) the Trainer asks the Accelerator to clip before
  it calls ``optimizer.step()``. Under ``fp16=True`` that call records the clip instead and returns
  a tensor the step fills with ``opt.grad_norm``; the optimizer's ``step()`` then runs
  ``opt.unscale_and_step(grads_scaled_by=S, max_grad_norm=args.max_grad_norm)`` (Note [clipping
  in the step] in protocol/clipping.py), so the grads are unscaled and clipped inside the fused
  step, never in place. The Trainer logs that tensor as ``grad_norm`` after the step.
* ``training_step``: with ``max_grad_norm`` 0 or ``None`` (no clipping), after the backward of the
  last micro-batch of an accumulation window, ``opt.unscale(grads_scaled_by=S)``, so the Trainer's
  logged ``grad_norm`` sees unscaled grads; the Trainer's ``optimizer.step()`` then honours the
  ``found_inf`` it recorded, as ``opt.step_after_unscale()`` does.
* ``create_optimizer``: a :class:`scaledoptim.AdamW` from the arguments (the AdamW optimizers);
  an optimizer given through ``optimizers=`` must have the loss-scaling protocol.
* ``log``: adds ``loss_scale`` to the training logs.
* ``_save_scaler`` and ``_load_scaler``, the Trainer's two private methods overridden: a stock
  ``Trainer(fp16=True)`` saves ``self.accelerator.scaler`` (a GradScaler, which ScaledTrainer
  has not) as ``scaler.pt`` and loads it back. Here ``scaler.pt`` is the optimizer's scale in
  GradScaler's format (``gradscaler_state_dict``), and on resume, after the Trainer loaded
  ``optimizer.pt``, a ``scaler.pt`` that differs from the scale ``optimizer.pt`` gave is
  imported into it (``load_gradscaler_state_dict``): the checkpoint of a stock Trainer, or of
  one that resumed ours and stepped on (the scale our param groups carry is then stale). A
  transformers release without the methods simply never calls them.

The scale is in the optimizer's ``state_dict``, which the Trainer saves as ``optimizer.pt`` and
loads on resume (with hysteresis and bounds, which GradScaler's format lacks), and in
``scaler.pt``, so that a stock Trainer resumes a ScaledTrainer checkpoint with its scale, and the
reverse. The AdamW built here saves the ``fused`` flag of the stock Trainer's AdamW for
``optim``: torch's ``AdamW(fused=True)`` + GradScaler cannot step after loading a state saved
with ``fused=None`` ("Expected grad_scale and found_inf to be None").
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any

import torch

from ..amp import autocast
from ..optim import AdamW
from ..protocol import Optimizer, patch_optimizer
from ..protocol.clipping import to_max_grad_norm
from ..scale import ScalingConfig

try:
    import transformers
    from transformers.trainer import SCALER_NAME  # a stock fp16 Trainer's GradScaler state

    from .trainer_accelerator import ScalingRun, scaled_accelerator_class
except ImportError as error:  # pragma: no cover - exercised only without the extras
    raise ImportError(
        "scaledoptim.integrations.transformers needs transformers and accelerate: "
        'pip install -e ".[examples-hf,accelerate]" in a checkout, or pip install '
        '"scaledoptim[examples-hf,accelerate]" where scaledoptim was installed from a wheel'
    ) from error

__all__ = ["ScaledTrainer"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# TrainingArguments.optim values that ScaledTrainer replaces by scaledoptim.AdamW.
_FUSED_NAME = "adamw_torch_fused"
_ADAMW_NAMES = frozenset({"adamw_torch", _FUSED_NAME, "adamw_hf"})


class ScaledTrainer(transformers.Trainer):
    r"""A :class:`transformers.Trainer` whose mixed precision is scaledoptim's, on any device.

    With ``TrainingArguments(fp16=True)`` every ``compute_loss`` runs under
    :func:`scaledoptim.autocast` with float16 on the training device, **CPU included**, each
    backward is scaled by the optimizer's :attr:`~scaledoptim.Optimizer.scale`, and the step
    unscales and clips in one: with ``max_grad_norm`` set (the Trainer's default, 1.0) it is
    ``opt.unscale_and_step(grads_scaled_by=S, max_grad_norm=args.max_grad_norm)``, which clips the
    global norm of the unscaled grads as ``torch.nn.utils.clip_grad_norm_`` does, without writing
    the grads (the Trainer's own clipping is skipped), and the logged ``grad_norm`` is
    :attr:`~scaledoptim.Optimizer.grad_norm`, the unscaled norm before clipping (inf or nan on an
    overflowed step). Callbacks' ``on_pre_optimizer_step`` then see the grads as the backward left
    them: scaled, not clipped.

    With ``max_grad_norm=0`` (or ``None``; negative, nan and inf raise) the grads are unscaled in
    place with :meth:`~scaledoptim.Optimizer.unscale` after the last backward of each accumulation
    window, and the logged ``grad_norm`` is unscaled.

    A step whose grads overflowed is skipped (the parameters and optimizer state stay as they
    were), the scale backs off, and the LR scheduler does not advance. Training logs carry
    ``loss_scale`` (the scale of the next step) in ``trainer.state.log_history``; the scale is in
    the optimizer's ``state_dict``, so checkpoints save it and
    ``train(resume_from_checkpoint=...)`` continues the run exactly, and in ``scaler.pt``,
    GradScaler's format, with the ``fused`` flag of ``optim`` in the optimizer's param groups: a
    stock ``Trainer(fp16=True)`` resumes the checkpoint with its scale, as this one resumes a stock
    checkpoint (below). Accelerate is given ``mixed_precision="no"``: it creates no ``GradScaler``
    and no autocast of its own.

    With ``bf16=True`` the loss is computed under bfloat16 autocast and nothing is scaled (any
    optimizer works). Without either, it is a plain Trainer.

    The optimizer is the one passed as ``optimizers=(optimizer, scheduler)``, which under
    ``fp16=True`` must be a :class:`scaledoptim.Optimizer` (a torch optimizer can be given
    the protocol with :func:`scaledoptim.patch_optimizer`), or else, for ``optim="adamw_torch"``
    / ``"adamw_torch_fused"`` (the default), a :class:`scaledoptim.AdamW` with the arguments'
    ``learning_rate``, ``adam_beta1``/``adam_beta2``, ``adam_epsilon`` and ``weight_decay``,
    with the Trainer's parameter groups (no weight decay for biases and norms). Other
    ``optim`` values build the Trainer's optimizer, which ``fp16=True`` gives the protocol with
    :func:`scaledoptim.patch_optimizer`.

    Every method it overrides is public (``create_accelerator_and_postprocess``,
    ``create_optimizer``, ``autocast_smart_context_manager``, ``training_step``, ``log``) but the
    two that save and load ``scaler.pt``, and so are the methods of ``accelerate.Accelerator`` it
    overrides on the Trainer's Accelerator (``backward``, ``optimizer_step_was_skipped``,
    ``clip_grad_norm_``, ``prepare_optimizer``) and of the ``AcceleratedOptimizer`` it prepares
    (``step``), by giving those objects a subclass of their class.

    Not supported with ``fp16=True``: DeepSpeed (which scales by itself) and
    gradient-accumulation settings that make the Trainer call backward outside ``training_step``.
    Several processes under DDP need nothing more: DDP's all-reduce leaves every rank the same
    grads, so every rank finds the same overflow and the same norm (see the DDP recipe for when an
    optimizer needs ``process_group``).

    The dynamic scale's settings (``init_scale``, ``growth_interval``, ``hysteresis``, ...) are
    one argument, ``scaling_config``. Resuming a checkpoint of a stock ``Trainer(fp16=True)``
    works: its ``optimizer.pt`` (a torch.optim state_dict) loads with the configured
    ``init_scale``, then the scale and growth tracker of its ``scaler.pt`` (accelerate's
    GradScaler) are imported, keeping ``scaling_config``'s hysteresis and bounds, so the run
    continues the stock run's scale sequence.

    Args:
        *args: :class:`transformers.Trainer`'s arguments.
        scaling_config: the settings of the optimizer's loss scale under ``fp16=True``, given to
            its :meth:`~scaledoptim.Optimizer.configure_scaling` once the optimizer is built
            (also an optimizer passed with ``optimizers=``: a process group it was configured
            with is then dropped, so configure that one yourself instead). ``None`` (default):
            the optimizer's own, :class:`~scaledoptim.ScalingConfig`'s defaults for the AdamW
            built here.
        **kwargs: :class:`transformers.Trainer`'s keyword arguments.

    Example::

        >>> args = transformers.TrainingArguments("out", fp16=True, use_cpu=True, max_steps=10)
        >>> trainer = ScaledTrainer(model=model, args=args, train_dataset=dataset)
        >>> trainer.train()
        >>> trainer.state.log_history[-2]["loss_scale"]
        65536.0
    """

    _scaledoptim_run: ScalingRun

    def __init__(
        self, *args: Any, scaling_config: ScalingConfig | None = None, **kwargs: Any
    ) -> None:
        if scaling_config is not None and not isinstance(scaling_config, ScalingConfig):
            raise TypeError(
                "ScaledTrainer(scaling_config=...) takes a scaledoptim.ScalingConfig, got a "
                f"{type(scaling_config).__name__}: scaling_config=ScalingConfig(init_scale=..., "
                "growth_interval=..., hysteresis=...)"
            )
        #: The loss scale's settings under ``fp16=True`` (see the class docstring).
        self.scaling_config = scaling_config
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ setup
    def create_accelerator_and_postprocess(self) -> None:
        """Creates the Trainer's Accelerator with no mixed precision of its own (Note
        [ScaledTrainer hooks])."""
        precision = self.args.mixed_precision
        if precision not in ("no", "fp16", "bf16"):
            raise ValueError(
                f"ScaledTrainer does fp16 and bf16 itself; mixed_precision={precision!r} is "
                "not supported"
            )
        self._scaledoptim_run = ScalingRun(_DTYPES.get(precision))
        if self._scaledoptim_run.scaled:  # 0, None: no clipping
            self._scaledoptim_run.max_grad_norm = to_max_grad_norm(self.args.max_grad_norm)
        self.args.mixed_precision = "no"
        try:
            super().create_accelerator_and_postprocess()
        finally:
            self.args.mixed_precision = precision
        accelerator = self.accelerator
        if accelerator.mixed_precision != "no" or getattr(accelerator, "scaler", None) is not None:
            raise RuntimeError(
                "ScaledTrainer could not keep accelerate's mixed precision off (the Accelerator "
                f"has mixed_precision={accelerator.mixed_precision!r}): this transformers "
                f"release ({transformers.__version__}) builds its Accelerator in a way "
                "ScaledTrainer does not know"
            )
        if self._scaledoptim_run.dtype is not None and self.is_deepspeed_enabled:
            raise ValueError("ScaledTrainer does not support DeepSpeed with fp16/bf16")
        accelerator.__class__ = scaled_accelerator_class(type(accelerator))
        accelerator._scaledoptim_run = self._scaledoptim_run

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """A :class:`scaledoptim.AdamW` from the arguments, or the optimizer given (see the
        class docstring)."""
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        if (
            self.optimizer is None
            and self.optimizer_cls_and_kwargs is None
            and optim in _ADAMW_NAMES
        ):
            opt_model = self.model if model is None else model
            if opt_model is None:
                raise ValueError("ScaledTrainer.create_optimizer() needs a model")
            decay = set(self.get_decay_parameter_names(opt_model))
            named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            groups = [
                {
                    "params": [p for n, p in named if n in decay],
                    "weight_decay": self.args.weight_decay,
                },
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            ]
            # The fused flag the stock Trainer's AdamW is built with, saved in the param groups:
            # its AdamW(fused=True) + GradScaler resumes our optimizer.pt only with it.
            self.optimizer = AdamW(
                [g for g in groups if g["params"]],
                lr=self.args.learning_rate,
                betas=(self.args.adam_beta1, self.args.adam_beta2),
                eps=self.args.adam_epsilon,
                fused=True if optim == _FUSED_NAME else None,
            )
        given = self.optimizer is not None
        optimizer = super().create_optimizer(model)
        if self._scaledoptim_run.scaled and not isinstance(_unwrap(optimizer), Optimizer):
            if given:
                raise TypeError(
                    f"ScaledTrainer(fp16=True) needs an optimizer with the loss-scaling protocol, "
                    f"got {type(_unwrap(optimizer)).__name__}: pass a scaledoptim optimizer "
                    "(scaledoptim.AdamW, ...), or scaledoptim.patch_optimizer(opt)"
                )
            patch_optimizer(_unwrap(optimizer))
        if self._scaledoptim_run.scaled and self.scaling_config is not None:
            _unwrap(optimizer).configure_scaling(**dataclasses.asdict(self.scaling_config))
        self._scaledoptim_run.optimizer = optimizer
        return optimizer

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Imports a checkpoint's ``scaler.pt`` into the optimizer's scale when it differs from
        the scale ``optimizer.pt`` gave it (Note [ScaledTrainer hooks]); nothing to do without
        ``scaler.pt`` or under bf16/fp32."""
        path = None if checkpoint is None else os.path.join(checkpoint, SCALER_NAME)
        if path is None or not os.path.isfile(path) or not self._scaledoptim_run.scaled:
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        optimizer = self._scaledoptim_run.scaled_optimizer()
        if _gradscaler_state(optimizer) != state:  # another Trainer stepped on
            optimizer.load_gradscaler_state_dict(state)

    def _save_scaler(self, output_dir: str) -> None:
        """Writes ``scaler.pt``, the optimizer's scale in ``torch.amp.GradScaler``'s format,
        where a stock fp16 Trainer looks for it on resume (Note [ScaledTrainer hooks])."""
        run = self._scaledoptim_run
        if not (run.scaled and run.optimizer is not None and self.args.should_save):
            return
        torch.save(_gradscaler_state(run.scaled_optimizer()), os.path.join(output_dir, SCALER_NAME))

    # ------------------------------------------------------------------ the step
    def autocast_smart_context_manager(
        self, cache_enabled: bool | None = True
    ) -> contextlib.AbstractContextManager[Any]:
        """The :func:`scaledoptim.autocast` region of ``compute_loss`` under fp16/bf16."""
        dtype = self._scaledoptim_run.dtype
        if dtype is None:
            return super().autocast_smart_context_manager(cache_enabled)
        return autocast(self.args.device.type, dtype=dtype, cache_enabled=bool(cache_enabled))

    def training_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """The Trainer's step (forward under autocast, backward scaled by ``opt.scale``), then,
        at the end of an accumulation window, :meth:`~scaledoptim.Optimizer.unscale`."""
        run = self._scaledoptim_run
        run.optimizer = self.optimizer  # accelerate's wrapper once train() prepared it
        loss = super().training_step(model, inputs, num_items_in_batch)
        if run.scaled and run.max_grad_norm is None and self.accelerator.sync_gradients:
            opt = run.scaled_optimizer()
            run.found_inf, _ = opt.unscale(grads_scaled_by=opt.scale)
            run.skipped = False
        return loss

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log, with ``loss_scale`` added to training logs under fp16."""
        run = self._scaledoptim_run
        if run.scaled and run.optimizer is not None and "loss" in logs:
            logs = {**logs, "loss_scale": float(run.scaled_optimizer().scale)}
        super().log(logs, start_time)


def _gradscaler_state(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's scale as GradScaler's ``state_dict``, without the warning that GradScaler
    lacks hysteresis and scale bounds: ``optimizer.pt`` keeps them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="GradScaler has no", category=UserWarning)
        return optimizer.gradscaler_state_dict()


def _unwrap(optimizer: Any) -> Any:
    """The optimizer inside accelerate's wrapper (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)
