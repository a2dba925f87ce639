"""The torch.optim backend: torch.optim's own implementation of an update, for the params the
fused path cannot serve, inside the same plan.

Note [torch.optim route]
~~~~~~~~~~~~~~~~~~~~~~~~
A fused optimizer whose update has a torch.optim counterpart (``Update.torch_optim``: Adam,
AdamW, SGD, Adagrad) takes whatever that class takes. What neither our kernels nor torch's fused
ops can update takes torch.optim's own implementation, its functional API (``torch.optim.adam.
adam``, ...) called as the class's ``step`` calls it, with the group's ``foreach``, ``fused``,
``capturable`` and ``differentiable``:

* every param of a group with ``differentiable=True`` (the step must stay differentiable: torch's
  implementation, under autograd when the optimizer's defaults say so, as torch's ``step``) or
  with a tensor hyper-parameter on an accelerator (our updates take hyper-parameters by value,
  so reading it would sync the device at every step; torch's ``fused``/``capturable``
  implementations read it on device);
* complex params, params with a sparse grad, and params that are views with gaps or overlaps.

It stays under the loss-scaling protocol. Their grads are unscaled with the others' into the same
``found_inf`` (a sparse grad through its values, a complex one as its real view) and the scale
moves once. torch's ``fused=True`` implementations take ``found_inf`` and skip on device; the
others cannot, so their update reads ``found_inf`` on the host first, the read
``torch.amp.GradScaler`` makes for them (free on the CPU). Their step counters live where
torch.optim keeps them, on the CPU unless the group is ``capturable`` or ``fused``, so its update
reads them without a sync. 16-bit params keep fp32 state and go through fp32 working copies, as on
torch's fused ops. Whatever torch's step would raise at run time (a sparse grad an update does not
take, ``fused=True`` on a device or dtype its kernels lack, a leaf updated in place under
autograd) is raised while the plan is built, before anything changes.

A plan with such params has several parts, so the step cache does not keep it (Note [step
cache]); ``route_key`` in ``fused/update.py`` is what of a group, besides its params, decides the
route.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim.optimizer import _get_capturable_supported_devices
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from ...kernels import is_dense
from ..state import check_param
from ..update import Group, TensorLists, Update
from .routes import TorchUpdate
from .torch_native import TorchNativeBackend

__all__ = ["TORCH_OPTIM", "TorchOptimBackend", "step_device", "torch_optim_indices"]


def torch_optim_indices(
    update: Update, group: Group, params: list[Tensor], whole_group: bool
) -> set[int]:
    """The indices of ``params`` (a group's params that have a grad) that take torch.optim's
    implementation (Note [torch.optim route]). Raises for a param no route can take, and as
    torch's step does for ``fused=True`` on a device or dtype its fused kernels lack."""
    if group.get("fused"):
        for param in params:
            _check_fused_param(param)
    if update.torch_optim is None:
        for param in params:
            check_param(param)
            if param.grad is not None and param.grad.is_sparse:
                raise RuntimeError(
                    f"{type(update).__name__} does not support sparse gradients; use a dense "
                    "layer (e.g. nn.Embedding(sparse=False))"
                )
        return set()
    if whole_group:
        routed = set(range(len(params)))
    else:
        routed = {
            i
            for i, p in enumerate(params)
            if p.is_complex() or (p.grad is not None and p.grad.is_sparse) or not is_dense(p)
        }
    for i, param in enumerate(params):
        if i not in routed or param.layout != torch.strided:
            check_param(param)
    return routed


def step_device(group: Group, param: Tensor) -> torch.device:
    """Where torch.optim keeps the step counter of a param its implementation updates: on the
    param's device for a ``capturable`` or ``fused`` group, on the CPU otherwise."""
    if group.get("capturable") or group.get("fused"):
        return param.device
    return torch.device("cpu")


def _check_fused_param(param: Tensor) -> None:
    """torch.optim's check of a param under ``fused=True``, which it makes in its step."""
    devices = _get_fused_kernels_supported_devices()
    if not (param.device.type in devices and torch.is_floating_point(param)):
        raise RuntimeError(
            "`fused=True` requires all the params to be floating point Tensors of supported "
            f"devices: {devices} but {param.dtype} and {param.device.type}. Pass fused=None "
            "(the default) for other params"
        )


class TorchOptimBackend(TorchNativeBackend):
    """Updates through ``Update.torch_optim_update``: torch.optim's own implementation (Note
    [torch.optim route]). Unscale, check and epilogue are the torch-native backend's."""

    name = "torch.optim"

    def prepare(
        self, update: Update, group: Group, lists: TensorLists, scratch: list[Tensor]
    ) -> TorchOptimUpdate:
        params = lists[0]
        grad_enabled = bool(update.defaults.get("differentiable"))
        name = type(update).__name__
        capturable_devices = _get_capturable_supported_devices()
        for param in params:
            if grad_enabled and param.is_leaf and param.requires_grad:
                raise RuntimeError(
                    f"{name}(differentiable=True) updates its params in place with autograd "
                    "recording, as torch.optim does, and a leaf that requires grad cannot be "
                    "updated in place (torch: 'a leaf Variable that requires grad is being used "
                    "in an in-place operation'). Step non-leaf params (p = w.clone()), or pass "
                    "differentiable=False"
                )
            if group.get("fused") and param.grad is not None and param.grad.is_sparse:
                raise RuntimeError(
                    f"{name}(fused=True) does not support sparse gradients; pass fused=None"
                )
            if (
                group.get("capturable")
                and not group.get("fused")
                and param.device.type not in capturable_devices
            ):
                # torch's type: its implementation raises AssertionError at step for these.
                raise AssertionError(
                    f"If capturable=True, params and state_steps must be on supported devices: "
                    f"{capturable_devices}. This {param.dtype} param of shape "
                    f"{tuple(param.shape)} on {param.device} takes torch.optim's implementation "
                    "(complex, sparse grad, strided view or differentiable=True), which has no "
                    "capturable form there; pass capturable=False"
                )
        update.check_torch_optim(group, params)
        return TorchOptimUpdate(update, group, lists, grad_enabled)


class TorchOptimUpdate(TorchUpdate):
    """One group's torch.optim implementation (the form of its route, Note [route table]):
    skipped after a host read of ``found_inf`` unless the group is ``fused`` (then torch's
    kernels skip on device), under autograd when the optimizer is ``differentiable``."""

    torch_optim = True

    def __init__(
        self, update: Update, group: Group, lists: TensorLists, grad_enabled: bool
    ) -> None:
        super().__init__(update, group, lists)
        self.grad_enabled = grad_enabled

    def __call__(
        self, found_inf: Tensor | None, inv_scale: Tensor | None, grads: list[Tensor]
    ) -> None:
        if found_inf is not None and not self.group.get("fused"):
            # See Note [torch.optim route]: the host read GradScaler makes for these
            # implementations.
            if found_inf.item() != 0.0:
                return
            found_inf = None
        with torch.set_grad_enabled(self.grad_enabled):
            super().__call__(found_inf, inv_scale, grads)

    def takes_grad_scale(self) -> bool:
        return False  # torch.optim's implementations read unscaled grads


TORCH_OPTIM = TorchOptimBackend()
