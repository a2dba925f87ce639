"""Lion and LAMB against implementations that are not ours: ``lion-pytorch``'s ``Lion`` and
``pytorch_optimizer``'s ``Lamb`` (the ``test`` extra installs both).

A formula error written into both our kernel and our torch form passes every test that compares
the two (and the float64 form is the torch form); only an implementation written by someone
else sees it. Each :class:`OutsideConfig` is a configuration where the outside implementation
computes the same update as ours, and says how its options map to ours.

Where they agree, and where they differ (read from lion-pytorch 0.2.5 and pytorch_optimizer
4.1.0's sources):

Lion (lion-pytorch ``Lion``)
    The same update: ``c = beta1 * m + (1 - beta1) * g``, ``p *= 1 - lr * wd``,
    ``p -= lr * sign(c)``, ``m = beta2 * m + (1 - beta2) * g``; theirs with ``mul``/``add``
    where ours uses ``lerp`` (the same value, other roundings). Their
    ``decoupled_weight_decay=True`` divides ``weight_decay`` by the initial ``lr``: ours with
    ``weight_decay / lr``. Differences: they have no ``maximize`` (not run here); their
    ``exp_avg`` has the param's dtype (ours fp32: the reference here steps float64 copies of our
    params, whatever their dtype); ``lr`` must be > 0.

LAMB (pytorch_optimizer ``Lamb``, ``foreach=False``)
    The same update with ``bias_correction=False`` = their ``adam_debias=True`` (by default
    they divide the step size by ``1 - beta1^t``, the first moment's correction alone, which
    the trust ratio does not cancel; ours corrects both moments or neither),
    ``adam_w_mode=True`` = their ``weight_decouple=False`` (both add ``wd * p`` to the Adam
    direction before the trust ratio), ``use_nvlamb=True`` (they apply
    the trust ratio always; ``adam=True`` never, as ours with ``weight_decay=0`` and
    ``use_nvlamb=False``), ``max_grad_norm=c`` = their ``pre_norm=True, max_grad_norm=c``
    (``0``: no clipping, their ``pre_norm=False``). Differences: they add ``eps`` to the norm
    in the trust ratio (``||p|| / (||u|| + eps)``) and in the clip (``c / (norm + eps)``), ours
    does not: ``eps / ||u||`` relative, below the tolerance here; they clamp ``||p||`` at 10
    (the params here stay below); their decoupled decay (``weight_decouple=True``, their
    default) shrinks ``p`` before the trust ratio, a different update from Apex's (not run
    here); they have no L2-in-the-grad mode (our ``adam_w_mode=False``); their clipping reads
    the optimizer's defaults, not the group's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from tests.prerequisites import require_module

__all__ = ["OUTSIDE_CONFIGS", "OutsideConfig", "outside_configs"]


@dataclasses.dataclass(frozen=True)
class OutsideConfig:
    """Our optimizer ``optimizer`` with ``ours`` computes what ``theirs(params)`` computes."""

    name: str
    optimizer: str
    ours: dict[str, Any]
    reference: str
    theirs: Callable[[list[torch.Tensor]], torch.optim.Optimizer]

    def __str__(self) -> str:
        return self.name


def _lion(**kwargs: Any) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        lion_pytorch = require_module("lion_pytorch", "Lion's outside reference")
        return lion_pytorch.Lion(params, **kwargs)

    return make


def _lamb(**kwargs: Any) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        require_module("pytorch_optimizer", "LAMB's outside reference")
        from pytorch_optimizer import Lamb

        return Lamb(params, foreach=False, adam_debias=True, **kwargs)

    return make


_NO_BIAS_CORRECTION = dict(bias_correction=False, eps=1e-6)

OUTSIDE_CONFIGS: tuple[OutsideConfig, ...] = (
    OutsideConfig("lion-default", "Lion", dict(lr=1e-3), "lion-pytorch", _lion(lr=1e-3)),
    OutsideConfig(
        "lion-betas-wd", "Lion", dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.5),
        "lion-pytorch", _lion(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.5),
    ),
    OutsideConfig(
        "lion-decoupled-wd", "Lion", dict(lr=1e-2, weight_decay=0.5), "lion-pytorch",
        _lion(lr=1e-2, weight_decay=0.5 * 1e-2, decoupled_weight_decay=True),
    ),
    OutsideConfig(
        "lamb-nvlamb", "LAMB",
        dict(lr=1e-2, weight_decay=0.0, use_nvlamb=True, max_grad_norm=0.0, **_NO_BIAS_CORRECTION),
        "pytorch_optimizer",
        _lamb(lr=1e-2, weight_decay=0.0, max_grad_norm=0.0, pre_norm=False, eps=1e-6),
    ),
    OutsideConfig(
        "lamb-wd-clip", "LAMB",
        # A clip that binds for every grad of the table, after the step's clip to 0.02 too.
        dict(lr=1e-2, weight_decay=0.1, max_grad_norm=0.01, **_NO_BIAS_CORRECTION),
        "pytorch_optimizer",
        _lamb(lr=1e-2, weight_decay=0.1, weight_decouple=False, max_grad_norm=0.01,
              pre_norm=True, eps=1e-6),
    ),
    OutsideConfig(
        "lamb-no-trust-ratio-no-averaging", "LAMB",
        dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.0, grad_averaging=False,
             max_grad_norm=0.0, **_NO_BIAS_CORRECTION),
        "pytorch_optimizer",
        _lamb(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.0, grad_averaging=False, adam=True,
              max_grad_norm=0.0, pre_norm=False, eps=1e-6),
    ),
)


def outside_configs(optimizer: str) -> tuple[OutsideConfig, ...]:
    """The outside configurations of ``optimizer`` (by its name in optim_db)."""
    return tuple(config for config in OUTSIDE_CONFIGS if config.optimizer == optimizer)
