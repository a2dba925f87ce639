"""The loss scale in checkpoints: when one may be taken, and reading it back safely."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .scaling import LossScale, Stage

if TYPE_CHECKING:
    from .optimizer import Optimizer

__all__ = ["check_between_steps", "split_scale_state"]


def check_between_steps(optimizer: Optimizer, method: str) -> None:
    """Refuses a checkpoint between ``unscale()`` and the step that consumes it."""
    state = optimizer.__dict__.get(optimizer._SCALING_ATTR)
    if state is not None and state.stage is Stage.UNSCALED:
        raise RuntimeError(
            f"{method} was called between unscale() and step_after_unscale(): a checkpoint "
            "cannot hold the pending step (its unscaled grads are not optimizer state). Call "
            "step_after_unscale() (or zero_grad() to drop the step) first."
        )


def split_scale_state(
    optimizer: Optimizer, state_dict: dict[str, Any]
) -> tuple[LossScale, dict[str, Any]]:
    """Validates ``state_dict``'s ``"loss_scale"`` and returns it as a :class:`LossScale` with
    the rest of the state_dict; changes nothing. A state_dict without one (a plain torch.optim
    checkpoint) gives a fresh scale of the optimizer's configuration."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    check_between_steps(optimizer, "load_state_dict()")
    current = optimizer._scaling()
    if current.loss_scale.sharers > 1:
        raise RuntimeError(
            "load_state_dict() on an optimizer that shares its scale: load every optimizer, "
            "then call scaledoptim.share_scale(...) again"
        )
    state_dict = dict(state_dict)
    scale_state = state_dict.pop("loss_scale", None)
    device = optimizer._params_device()
    if scale_state is None:
        return LossScale(current.loss_scale.config, device), state_dict
    return LossScale.from_state_dict(scale_state, device), state_dict
