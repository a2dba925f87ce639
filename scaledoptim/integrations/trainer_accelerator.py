"""The Accelerator a :class:`~scaledoptim.integrations.transformers.ScaledTrainer` drives, and the
optimizer wrapper it prepares: their public methods overridden (Note [ScaledTrainer hooks] in
transformers.py) by giving each object a subclass of its class, and the state they share with the
Trainer. transformers.py imports this module where it says which extras are missing.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from ..protocol import Optimizer, scale_outputs
from .accelerate import unwrap_optimizer

__all__ = ["ScalingRun", "scaled_accelerator_class"]


class ScalingRun:
    """What the Trainer and its Accelerator share: the dtype and the last ``found_inf``."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype
        self.optimizer: Any = None  # the Trainer's optimizer (maybe accelerate's wrapper)
        self.found_inf: torch.Tensor | None = None
        self.skipped = False
        #: ``args.max_grad_norm`` when the step clips (fp16, not 0 or None), else ``None``.
        self.max_grad_norm: float | None = None
        #: What the Accelerator's ``clip_grad_norm_`` returned, filled by the next step.
        self.grad_norm: torch.Tensor | None = None

    @property
    def scaled(self) -> bool:
        return self.dtype is torch.float16

    def scaled_optimizer(self) -> Optimizer:
        if self.optimizer is None:
            raise RuntimeError("ScaledTrainer has no optimizer yet: call trainer.train()")
        return unwrap_optimizer(self.optimizer)


class _ScaledAcceleration:
    """The Accelerator's overrides of Note [ScaledTrainer hooks], on top of an Accelerator class."""

    _scaledoptim_run: ScalingRun

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        run = self._scaledoptim_run
        if run.scaled:
            loss = scale_outputs(loss, run.scaled_optimizer().scale)
        super().backward(loss, **kwargs)  # type: ignore[misc]

    @property
    def optimizer_step_was_skipped(self) -> bool:
        run = self._scaledoptim_run
        if run.found_inf is not None:  # one host read per optimizer step, when asked
            run.skipped = bool(run.found_inf.item())
            run.found_inf = None
        return run.skipped or bool(super().optimizer_step_was_skipped)  # type: ignore[misc]

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        run = self._scaledoptim_run
        if run.max_grad_norm is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)  # type: ignore[misc]
        if float(max_norm) != run.max_grad_norm or norm_type != 2:
            raise RuntimeError(
                f"ScaledTrainer(fp16=True) clips inside the optimizer step, to "
                f"args.max_grad_norm={run.max_grad_norm} in the 2-norm; clip_grad_norm_ was "
                f"asked for max_norm={max_norm}, norm_type={norm_type}. Set "
                "TrainingArguments(max_grad_norm=...) instead, or max_grad_norm=0 and clip "
                "yourself (the grads are then unscaled before the step)."
            )
        # Filled by the step (Note [ScaledTrainer hooks]); the Trainer logs it after the step.
        device = run.scaled_optimizer().scale.device
        run.grad_norm = torch.full((), float("nan"), dtype=torch.float32, device=device)
        return run.grad_norm

    def prepare_optimizer(self, optimizer: Any, device_placement: Any = None) -> Any:
        prepared = super().prepare_optimizer(optimizer, device_placement)  # type: ignore[misc]
        if isinstance(prepared, AcceleratedOptimizer):
            prepared.__class__ = _with_overrides(type(prepared), _ScaledStep)
            prepared._scaledoptim_run = self._scaledoptim_run
        return prepared


class _ScaledStep:
    """The step override of Note [ScaledTrainer hooks], on top of an AcceleratedOptimizer."""

    _scaledoptim_run: ScalingRun
    gradient_state: Any

    def step(self, closure: Any = None) -> Any:
        run = self._scaledoptim_run
        if run.max_grad_norm is None or not self.gradient_state.sync_gradients:
            return super().step(closure)  # type: ignore[misc]
        if closure is not None:
            raise TypeError(
                "ScaledTrainer(fp16=True) with max_grad_norm > 0 steps with "
                "opt.unscale_and_step(), without a closure; got optimizer.step(closure)"
            )
        opt = run.scaled_optimizer()
        _, run.found_inf, _ = opt.unscale_and_step(
            grads_scaled_by=opt.scale, max_grad_norm=run.max_grad_norm
        )
        run.skipped = False
        if run.grad_norm is not None and opt.grad_norm is not None:
            run.grad_norm.copy_(opt.grad_norm)  # on device: the Trainer reads it when it logs
        run.grad_norm = None
        return None


class _ScaledAccelerator(_ScaledAcceleration, Accelerator):
    """The Trainer's Accelerator, with the overrides of :class:`_ScaledAcceleration`."""


def scaled_accelerator_class(cls: type) -> type:
    """``cls`` (an Accelerator class) with :class:`_ScaledAcceleration`'s overrides."""
    if not issubclass(cls, Accelerator):
        raise TypeError(f"ScaledTrainer needs an accelerate.Accelerator, got {cls.__name__}")
    return _with_overrides(cls, _ScaledAcceleration)


# One subclass per class given the overrides (an Accelerator's or an AcceleratedOptimizer's).
_SUBCLASSES: dict[type, type] = {Accelerator: _ScaledAccelerator}


def _with_overrides(cls: type, overrides: type) -> type:
    """``cls`` with ``overrides`` on top: ``cls`` itself when it has them already."""
    if issubclass(cls, overrides):
        return cls
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"Scaled{cls.__name__}", (overrides, cls), {})
    return _SUBCLASSES[cls]
