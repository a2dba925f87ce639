"""What a backend is: the same two operations, with the same signatures, on every backend."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    from ..optim.fused import FusedOptimizer

#: ``update(found_inf, inv_scale)`` runs one prepared group update (Note [found_inf contract]):
#: nothing changes when ``found_inf`` is non-zero; ``inv_scale`` (or ``None``) is applied to the
#: grads in registers by a backend that :attr:`Backend.folds_unscale`.
PreparedUpdate = Callable[[Tensor | None, Tensor | None], None]


class Backend(abc.ABC):
    """Runs the update of a :class:`~scaledoptim.FusedOptimizer` on some device.

    Attributes:
        name: shown in messages and benchmarks.
        folds_unscale: whether the update multiplies scaled grads by ``inv_scale`` in
            registers, so that ``unscale_and_step`` only needs a read-only check of the grads
            (they stay scaled) instead of an in-place unscale.
    """

    name: str
    folds_unscale: bool

    @abc.abstractmethod
    def check_(self, grads: Sequence[Tensor], found_inf: Tensor) -> None:
        """Sets ``found_inf`` to 1.0 if any grad holds inf/nan; reads the grads only.

        Only called on a backend that :attr:`folds_unscale`. ``grads`` are dense.
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
