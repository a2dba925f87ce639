"""Stand-ins for the pieces of timm (``timm.utils``, ``timm.optim``) that
timm's ``train.py`` uses around its loss scaler, written for the port test from
timm's documented behaviour: timm does not install next to the torch this
project tests with.

* :class:`NativeScaler`: ``timm.utils.NativeScaler``'s call convention
  (``loss_scaler(loss, optimizer, clip_grad=, clip_mode=, parameters=,
  create_graph=, need_update=)``, ``state_dict_key``,
  ``state_dict``/``load_state_dict``) around ``torch.amp.GradScaler``:
  backward; then, when ``need_update``, ``unscale_`` + clip + ``step`` +
  ``update``.
* :func:`param_groups_weight_decay`, :func:`optimizer_kwargs` and
  :func:`create_optimizer_v2` for ``opt="adamw"``: no weight decay for biases
  and other 1-d params, ``torch.optim.AdamW`` over the two groups."""

from __future__ import annotations

from typing import Any

import torch


class NativeScaler:
    state_dict_key = "amp_scaler"

    def __init__(self, device: str = "cuda", **kwargs: Any) -> None:
        self._scaler = torch.amp.GradScaler(device, **kwargs)

    def __call__(
        self,
        loss,
        optimizer,
        clip_grad=None,
        clip_mode="norm",
        parameters=None,
        create_graph=False,
        need_update=True,
    ) -> None:
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert clip_mode == "norm" and parameters is not None
                self._scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scaler.load_state_dict(state_dict)


def param_groups_weight_decay(
    model: torch.nn.Module, weight_decay: float
) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        {
            "params": [p for p in params if p.ndim > 1],
            "weight_decay": weight_decay,
        },
    ]


def optimizer_kwargs(cfg) -> dict[str, Any]:
    return {"opt": cfg.opt, "lr": cfg.lr, "weight_decay": cfg.weight_decay}


def create_optimizer_v2(
    model: torch.nn.Module, opt: str, lr: float, weight_decay: float
):
    if opt != "adamw":
        raise ValueError(f"the stand-in builds timm's adamw only, not {opt!r}")
    return torch.optim.AdamW(
        param_groups_weight_decay(model, weight_decay), lr=lr
    )
