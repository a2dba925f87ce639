"""The dynamic loss scale; it knows no optimizer.

* :class:`ScalingConfig`: its hyper-parameters, validated.
* :class:`LossScale`: the state machine in device tensors (scale, growth and hysteresis
  trackers), moved with no host sync; several reporters may share one.
* :func:`as_scale_tensor` / :func:`is_float32_scale`: what a usable scale is.
* :func:`handle_state`: what a scale tensor a user holds says of itself (Note [scale handles]).
* GradScaler state import/export and ``found_inf`` agreement across a process group.
"""

from .checks import as_scale_tensor, is_float32_scale
from .config import ScalingConfig
from .distributed import agree_on_found_inf, check_process_group
from .gradscaler_state import gradscaler_state_from_loss_scale, loss_scale_from_gradscaler_state
from .loss_scale import LossScale, ScaleUpdate, handle_state

__all__ = [
    "LossScale",
    "ScaleUpdate",
    "ScalingConfig",
    "agree_on_found_inf",
    "as_scale_tensor",
    "check_process_group",
    "gradscaler_state_from_loss_scale",
    "handle_state",
    "is_float32_scale",
    "loss_scale_from_gradscaler_state",
]
