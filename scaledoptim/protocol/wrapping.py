"""Giving the protocol to optimizers we did not write: a subclass, or an existing instance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from .optimizer import Optimizer

__all__ = ["LBFGS", "patch_optimizer", "with_scaling"]

_O = TypeVar("_O", bound=torch.optim.Optimizer)


def with_scaling(optimizer_class: type[_O]) -> type[_O]:
    r"""Returns a subclass of ``optimizer_class`` that also is a :class:`scaledoptim.Optimizer`.

    Methods ``optimizer_class`` defines itself come first, so an optimizer that already
    implements ``unscale_and_step`` or ``step_after_unscale`` keeps its own. Its ``step`` is
    wrapped in the protocol's guard: after :meth:`~scaledoptim.Optimizer.unscale` it skips on
    ``found_inf``, and after a backward scaled by :attr:`~scaledoptim.Optimizer.scale` it
    unscales first. The same class object is returned for the same argument.

    Its ``step`` reads the grads as they are, so they are unscaled in place, in their own dtype:
    scaled fp16 grads are refused (``ValueError``, before anything changes), as
    :class:`torch.amp.GradScaler` refuses them, since unscaled in fp16 a small true grad flushes
    to zero unnoticed. For fp16 params use a fused class (:class:`scaledoptim.AdamW`, ...),
    which unscales in fp32 inside its update, with ``master_weights=True``; bf16 and fp32 grads,
    and unscaled fp16 grads (``grads_scaled_by=None``), step as usual.

    Example::

        >>> RMSprop = scaledoptim.with_scaling(torch.optim.RMSprop)
        >>> opt = RMSprop(model.parameters(), lr=1e-2)
        >>> _, found_inf, S = opt.unscale_and_step(grads_scaled_by=S)
    """
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(
            f"with_scaling() takes a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )
    if issubclass(optimizer_class, Optimizer):
        return optimizer_class
    scaled = _scaled_classes.get(optimizer_class)
    if scaled is None:
        # Its own ``step``, the class's, so that Optimizer.__init_subclass__ wraps it in the
        # protocol's guard (Note [step requests]): a plain step() after a scaled backward or an
        # unscale() must not apply scaled or overflowed grads.
        step: Any = optimizer_class.step
        if getattr(step, "hooked", False):  # torch's hooks wrapped it when X was first built
            step = step.__wrapped__
        scaled = _scaled_classes[optimizer_class] = type(
            optimizer_class.__name__,
            (optimizer_class, Optimizer),
            {
                "__module__": __name__,
                "__doc__": optimizer_class.__doc__,
                "__reduce_ex__": _reduce_ex,
                **_REPAIRS.get(optimizer_class, {}),
                "step": step,
            },
        )
    return scaled


#: with_scaling's classes, so that the same argument gives the same class (and isinstance works
#: across calls).
_scaled_classes: dict[type[Any], type[Any]] = {}


def _reduce_ex(self: Optimizer, protocol: int) -> tuple[Any, ...]:
    # A generated class has no importable name, so pickle (and copy, torch.save) rebuild its
    # instances from the class it was made from: with_scaling() returns the same class again.
    base = type(self).__mro__[1]
    return _new_scaled, (base,), self.__getstate__()


def _lbfgs_setstate(self: Optimizer, state: dict[str, Any]) -> None:
    Optimizer.__setstate__(self, state)
    # torch.optim.LBFGS keeps its params list (and a numel cache) outside what torch.optim
    # pickles, so a copy of torch's own class fails on its first step; rebuild them as its
    # __init__ does.
    self._params = self.param_groups[0]["params"]  # type: ignore[attr-defined]
    self._numel_cache = None  # type: ignore[attr-defined]


#: Methods a generated class adds for a torch class that does not survive a copy by itself.
_REPAIRS: dict[type[Any], dict[str, Any]] = {torch.optim.LBFGS: {"__setstate__": _lbfgs_setstate}}


def _new_scaled(optimizer_class: type[torch.optim.Optimizer]) -> Optimizer:
    """An empty instance of ``with_scaling(optimizer_class)`` for unpickling to fill."""
    # torch.optim has no __new__ of its own: object's makes the empty instance.
    return cast(Optimizer, object.__new__(with_scaling(optimizer_class)))


def patch_optimizer(optimizer: _O) -> _O:
    r"""Gives an existing optimizer instance the loss-scaling protocol, in place; returns it.

    The instance's class becomes :func:`with_scaling` of it: its params, state and hooks are
    untouched and methods its class defines are left alone (and scaled fp16 grads are refused,
    as there).

    Example::

        >>> opt = scaledoptim.patch_optimizer(torch.optim.Adagrad(model.parameters()))
        >>> found_inf, S = opt.unscale(grads_scaled_by=S)
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"patch_optimizer() takes an optimizer instance, got {type(optimizer).__name__}"
        )
    if not isinstance(optimizer, Optimizer):
        optimizer.__class__ = with_scaling(type(optimizer))
    return optimizer


if TYPE_CHECKING:  # what with_scaling's class is; typing has no intersection of two classes

    class _ScaledLBFGS(torch.optim.LBFGS, Optimizer): ...


LBFGS = cast("type[_ScaledLBFGS]", with_scaling(torch.optim.LBFGS))
LBFGS.__doc__ = r""":class:`torch.optim.LBFGS` with the loss-scaling protocol.

LBFGS evaluates its closure many times per step; give the closure to
:meth:`~scaledoptim.Optimizer.unscale_and_step` and every evaluation gets finite, unscaled grads
(replayed with a smaller scale when they overflow).

Example::

    >>> opt = scaledoptim.LBFGS(model.parameters(), lr=1)
    >>> def closure(S):
    ...     opt.zero_grad()
    ...     loss = loss_fn(model(x), y)
    ...     scaledoptim.scale_outputs(loss, S).backward()
    ...     return loss
    >>> loss, found_inf, S = opt.unscale_and_step(closure, grads_scaled_by=S)
"""
