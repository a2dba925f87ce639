"""What a backend is: the same operations, with the same signatures, on every backend.

A backend prepares (validates, and builds whatever a launch needs) before anything runs. A
prepared object holds no grad (a freed grad's memory must return to the allocator): it gets
the step's grads when it runs, and :meth:`~PreparedUpdate.repoint` moves it to grads at new
data pointers of the same dtypes, shapes, strides and device. That is how a step plan is reused
when backward reallocated the grads (Note [step cache] in ``scaledoptim/fused/plan.py``).
"""

from __future__ import annotations

import abc
from typing import Protocol

from torch import Tensor

from ...scale import ScaleUpdate
from ..update import GradReduction, Group, TensorLists, Update

__all__ = ["Backend", "PreparedEpilogue", "PreparedReduction", "PreparedUnscale", "PreparedUpdate"]


class PreparedUpdate(Protocol):
    """One prepared group update: ``update(found_inf, inv_scale, grads)`` runs it over the
    group's ``grads`` as the unscale left them (Note [found_inf contract]: nothing changes when
    ``found_inf`` is non-zero; ``inv_scale``, or ``None``, is applied to the grads in registers
    by a backend that :attr:`Backend.folds_unscale`)."""

    def __call__(
        self, found_inf: Tensor | None, inv_scale: Tensor | None, grads: list[Tensor]
    ) -> None: ...

    def repoint(self, pointers: list[int]) -> None:
        """Moves it to grads at data ``pointers``, which the caller validated to have the
        dtypes, shapes, strides and device of the grads it was prepared for."""
        ...


class PreparedUnscale(Protocol):
    """``unscale(found_inf, inv_scale, checked, grad_lists)`` checks the grads of a prepared
    step for inf/nan into ``found_inf``, unscaling them unless the update folds the unscale in,
    and returns the ``inv_scale`` the updates must still apply (``None``: the grads they read
    are unscaled). It may replace entries of ``grad_lists`` (by unscaled fp32 copies) for the
    updates to read. ``checked``: ids of grads already folded into ``found_inf`` (Note
    [overlapped overflow check]); a backend that only checks may skip them. ``norm_sq``, when
    given, receives (added in place) the sum of squares of the unscaled grads, of every grad
    whatever ``checked`` says (Note [clipping in the step] in protocol/clipping.py). What it
    unscales in place goes into ``unscaled`` as it is written; a grad in it already (a failed
    check's) is checked only (Note [atomic step] in protocol/steps.py)."""

    def __call__(
        self,
        found_inf: Tensor,
        inv_scale: Tensor,
        checked: frozenset[int],
        grad_lists: list[list[Tensor]],
        norm_sq: Tensor | None = None,
        unscaled: list[list[Tensor]] | None = None,
    ) -> Tensor | None: ...

    def repoint(self, pointers: list[int]) -> None:
        """As :meth:`PreparedUpdate.repoint`, ``pointers`` of every list in order."""
        ...


class PreparedReduction(Protocol):
    """A prepared :class:`~scaledoptim.fused.update.GradReduction` over a step's grads:
    ``reduce(found_inf, inv_scale, grad_lists)`` zeroes its output and runs it, after the
    unscale."""

    def __call__(
        self, found_inf: Tensor | None, inv_scale: Tensor | None, grad_lists: list[list[Tensor]]
    ) -> None: ...

    def repoint(self, pointers: list[int]) -> None:
        """As :meth:`PreparedUnscale.repoint`."""
        ...


class PreparedEpilogue(Protocol):
    """``epilogue(found_inf, scale_update)`` ends a step: advances what the updates left to it
    and applies ``scale_update`` (or nothing for ``None``)."""

    def __call__(self, found_inf: Tensor | None, scale_update: ScaleUpdate | None) -> None: ...


class Backend(abc.ABC):
    """Runs the update of a fused optimizer (an :class:`~scaledoptim.fused.update.Update`).

    Attributes:
        name: shown in messages and benchmarks.
        folds_unscale: whether the update multiplies scaled grads by ``inv_scale`` in
            registers, so that ``unscale_and_step`` only needs a read-only check of the grads
            (they stay scaled) instead of an in-place unscale.
        applies_scale_update: whether the step's epilogue moves the loss scale (in the same
            launch that advances the step counters) rather than torch ops before the step.
    """

    name: str
    folds_unscale: bool
    applies_scale_update: bool

    def supports(self, param: Tensor) -> bool:
        """Whether this backend can update ``param`` (the plan sends others to torch's ops)."""
        return True

    def check_(self, grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor | None) -> None:
        """Sets ``found_inf`` to 1.0 if any of ``grads`` times ``inv_scale`` (``None``: as they
        are) is inf/nan, which is what the update would read; reads them only. Called on a
        backend that :attr:`folds_unscale` only (Note [overlapped overflow check])."""
        raise NotImplementedError

    @abc.abstractmethod
    def prepare_unscale(
        self, grad_lists: list[list[Tensor]], updates: list[PreparedUpdate]
    ) -> PreparedUnscale:
        """The inf/nan check (and unscale, unless the update folds it in) of a prepared step's
        grads, validated; changes nothing.

        ``grad_lists`` are the grads given to :meth:`prepare`, one list per group, dense and in
        their params' layout, and ``updates`` what :meth:`prepare` returned for those groups.
        """

    @abc.abstractmethod
    def prepare(
        self, update: Update, group: Group, lists: TensorLists, scratch: list[Tensor]
    ) -> PreparedUpdate:
        """Validates one group's update and returns it, ready to run; changes nothing.

        Args:
            update: the optimizer's update (its kernel and its torch form).
            group: the param group (hyper-parameters, already validated).
            lists: the update's :data:`~scaledoptim.fused.update.TensorLists`. Grads have their
                param's strides and state is float32 (or the param's dtype if wider). The
                prepared update keeps no reference to the grads.
            scratch: the tensors of its scratch lists, to zero before each run where the
                kernels accumulate into them.

        Raises:
            ValueError, TypeError: when the tensors cannot run on this backend.
        """

    @abc.abstractmethod
    def prepare_reduction(
        self, reduction: GradReduction, grad_lists: list[list[Tensor]]
    ) -> PreparedReduction:
        """Validates a reduction over the grads of ``grad_lists`` (as for
        :meth:`prepare_unscale`), to run after the unscale and before the updates."""

    @abc.abstractmethod
    def prepare_epilogue(self, steps: list[Tensor]) -> PreparedEpilogue:
        """Validates the end of a step over every group's step counters; changes nothing."""
