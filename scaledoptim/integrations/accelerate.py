"""Reaching scaledoptim's methods through ``accelerate``'s optimizer wrapper.

``accelerator.prepare(opt)`` returns an ``AcceleratedOptimizer`` that forwards ``step`` and
``zero_grad`` (as no-ops while gradients accumulate) but none of scaledoptim's methods. Keep
both: zero grads through the wrapper, and unscale and step through the optimizer it wraps, on
the iterations where ``accelerator.sync_gradients`` is true (``docs/integrations/accelerate.md``).
"""

from __future__ import annotations

from typing import Any

from ..protocol import Optimizer

__all__ = ["unwrap_optimizer"]


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    r"""Returns the :class:`scaledoptim.Optimizer` inside ``accelerator.prepare``\ 's wrapper.

    Accepts an ``accelerate.optimizer.AcceleratedOptimizer`` or the optimizer itself. Does not
    import ``accelerate``.

    Example::

        >>> model, opt = accelerator.prepare(model, scaledoptim.AdamW(model.parameters()))
        >>> scaled_opt = scaledoptim.integrations.accelerate.unwrap_optimizer(opt)
        >>> _, found_inf, S = scaled_opt.unscale_and_step(grads_scaled_by=S)

    Raises:
        RuntimeError: the wrapper holds a ``GradScaler`` (``Accelerator(mixed_precision="fp16")``):
            the loss would be scaled twice.
        TypeError: the optimizer has no loss-scaling protocol.
    """
    if getattr(optimizer, "scaler", None) is not None and hasattr(optimizer, "optimizer"):
        raise RuntimeError(
            "This optimizer was prepared by an Accelerator with its own GradScaler "
            "(mixed_precision='fp16'), so the loss would be scaled twice. Create the Accelerator "
            "with mixed_precision='no' and let scaledoptim autocast and scale."
        )
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, Optimizer):
        raise TypeError(
            f"{type(inner).__name__} has no loss-scaling protocol: create a scaledoptim optimizer "
            "(scaledoptim.AdamW, ...) before accelerator.prepare, or wrap yours with "
            "scaledoptim.patch_optimizer(opt)."
        )
    return inner
