"""What a backend is: the same two operations, with the same signatures, on every backend."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    from ..optim.fused import FusedOptimizer
    from ..scaling import ScaleUpdate

#: ``update(found_inf, inv_scale)`` runs one prepared group update (Note [found_inf contract]):
#: nothing changes when ``found_inf`` is non-zero; ``inv_scale`` (or ``None``) is applied to the
#: grads in registers by a backend that :attr:`Backend.folds_unscale`.
PreparedUpdate = Callable[[Tensor | None, Tensor | None], None]
#: ``unscale(found_inf, inv_scale, checked)`` checks the grads of a prepared step for inf/nan into
#: ``found_inf``, unscaling them unless the update folds the unscale in, and returns the
#: ``inv_scale`` the updates must still apply (``None``: the grads they read are unscaled).
#: ``checked``: ids of grads already folded into ``found_inf`` (Note [overlapped overflow
#: check]); a backend that only checks may skip them.
PreparedUnscale = Callable[[Tensor, Tensor, frozenset[int]], "Tensor | None"]
#: ``epilogue(found_inf, scale_update)`` ends a step: advances what the updates left to it and
#: applies ``scale_update`` (a :class:`~scaledoptim.scaling.ScaleUpdate`, or ``None``).
PreparedEpilogue = Callable[[Tensor | None, "ScaleUpdate | None"], None]


class Backend(abc.ABC):
    """Runs the update of a :class:`~scaledoptim.FusedOptimizer` on some device.

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

    @abc.abstractmethod
    def check_(self, grads: list[Tensor], found_inf: Tensor) -> None:
        """Sets ``found_inf`` to 1.0 if any of ``grads`` holds inf/nan; reads them only."""

    @abc.abstractmethod
    def prepare_unscale(self, grad_lists: list[list[Tensor]]) -> PreparedUnscale:
        """The inf/nan check (and unscale, unless the update folds it in) of a prepared step's
        grads, validated; changes nothing.

        ``grad_lists`` are the lists given to :meth:`prepare`, one per group, dense and in their
        params' layout; running the result may replace their entries (e.g. by unscaled fp32
        copies) for the updates to read.
        """

    @abc.abstractmethod
    def prepare(
        self,
        optimizer: FusedOptimizer,
        group: dict[str, Any],
        tensor_lists: list[list[Tensor]],
    ) -> PreparedUpdate:
        """Validates one group's update and returns it, ready to run; changes nothing.

        Args:
            optimizer: the optimizer whose update this is (its kernel and its torch math).
            group: the param group (hyper-parameters, already validated).
            tensor_lists: ``[params, grads, *state lists, steps]`` in the order of the
                optimizer's kernel; a state list may be empty (an option turned it off).
                Grads have their param's strides and state is float32 (or the param's
                dtype if wider).

        Raises:
            ValueError, TypeError: when the tensors cannot run on this backend.
        """

    @abc.abstractmethod
    def prepare_epilogue(self, steps: list[Tensor]) -> PreparedEpilogue:
        """Validates the end of a step over every group's step counters; changes nothing."""
