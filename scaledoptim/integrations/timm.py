"""A loss scaler with ``timm.utils.NativeScaler``'s call convention, scaling with scaledoptim.

timm's ``train.py`` creates its loss scaler in one line and hands it to ``train_one_epoch`` as
``loss_scaler=``, which calls it once per micro-batch (backward, then, at the end of an
accumulation window, clip and step) and checkpoints it under ``state_dict_key``. This one takes
the same calls and keeps the same checkpoint entry (``torch.amp.GradScaler``'s ``state_dict``),
with :class:`scaledoptim.GradScaler` inside: the scale lives in the optimizer, and clipping by
norm happens inside the step (``scaler.step(opt, max_grad_norm=clip_grad)``) instead of
``unscale_`` + ``clip_grad_norm_`` + ``step``. timm is not imported (only for ``clip_mode="agc"``,
which is timm's own).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..protocol import GradScaler

__all__ = ["NativeScaler"]


class NativeScaler:
    r"""A drop-in for ``timm.utils.NativeScaler`` whose scaler is :class:`scaledoptim.GradScaler`.

    ``loss_scaler(loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None,
    create_graph=False, need_update=True)`` runs ``scaler.scale(loss).backward()``; when
    ``need_update`` is true it clips and steps, then ``scaler.update()``. With
    ``clip_mode="norm"`` (timm's default) the clip happens inside the step:
    ``scaler.step(optimizer, max_grad_norm=clip_grad)``, which for a scaledoptim optimizer clips
    the global norm of the optimizer's unscaled grads without a pass of its own and keeps the norm
    in ``optimizer.grad_norm`` (``parameters`` is then not read: the clip covers the optimizer's
    params, which are the model's in timm's loop). ``"value"`` and timm's ``"agc"`` unscale the
    grads first (``scaler.unscale_``), then clip ``parameters`` in place.

    The checkpoint entry (``state_dict_key = "amp_scaler"``) is ``torch.amp.GradScaler``'s
    ``state_dict``: timm's own ``NativeScaler`` resumes it, and this one resumes timm's.

    Args:
        device: the device type of the scale (``"cuda"``, ``"cpu"``, ...).
        **gradscaler_kwargs: :class:`scaledoptim.GradScaler`'s other arguments (``init_scale``,
            ``growth_interval``, ...).

    Attributes:
        scaler: the :class:`scaledoptim.GradScaler`.

    Example::

        >>> loss_scaler = NativeScaler(device="cuda")   # was: timm.utils.NativeScaler(...)
        >>> optimizer = scaledoptim.AdamW(model.parameters())
        >>> loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters())
    """

    #: The key timm's checkpoints keep the loss scaler's state under.
    state_dict_key = "amp_scaler"

    def __init__(self, device: str = "cuda", **gradscaler_kwargs: Any) -> None:
        self.scaler = GradScaler(device, **gradscaler_kwargs)

    def __call__(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        clip_grad: float | None = None,
        clip_mode: str = "norm",
        parameters: Iterable[torch.Tensor] | None = None,
        create_graph: bool = False,
        need_update: bool = True,
    ) -> None:
        """Backward of the scaled loss; with ``need_update``, clip, step and update."""
        self.scaler.scale(loss).backward(create_graph=create_graph)
        if not need_update:  # inside a gradient accumulation window
            return
        if clip_grad is not None and clip_mode == "norm":
            self.scaler.step(optimizer, max_grad_norm=clip_grad)
        else:
            if clip_grad is not None:
                if parameters is None:
                    raise ValueError(
                        f"clip_mode={clip_mode!r} clips the parameters given: pass parameters="
                    )
                self.scaler.unscale_(optimizer)
                _clip_in_place(parameters, clip_grad, clip_mode)
            self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """``torch.amp.GradScaler``'s ``state_dict`` (timm saves it under ``state_dict_key``)."""
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a ``state_dict`` of this class, of timm's ``NativeScaler`` or of a GradScaler."""
        self.scaler.load_state_dict(state_dict)


def _clip_in_place(parameters: Iterable[torch.Tensor], value: float, mode: str) -> None:
    if mode == "value":
        torch.nn.utils.clip_grad_value_(parameters, value)
        return
    try:
        from timm.utils import dispatch_clip_grad
    except ImportError as error:
        raise ValueError(
            f"clip_mode={mode!r} is timm's (timm.utils.dispatch_clip_grad), and timm is not "
            'installed: install timm, or use clip_mode="norm" or "value"'
        ) from error
    dispatch_clip_grad(parameters, value, mode=mode)
