"""The seam between a fused optimizer and what runs its update: the :class:`Update` protocol.

A backend sees an optimizer only through this protocol: the state it declares, what its kernel
needs, and its torch form. :class:`~scaledoptim.FusedOptimizer` subclasses implement it (one
file each in ``scaledoptim/optim/``); nothing here knows an optimizer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from ..kernels import MultiTensorKernel
from .state import StateLayout

__all__ = [
    "GradReduction",
    "Group",
    "ScaledTorchUpdate",
    "TensorLists",
    "Update",
    "lists_key",
    "route_key",
]

#: A param group: ``"params"`` and the optimizer's options.
Group = dict[str, Any]
#: An update's tensor lists in its kernel's order: ``[params, grads, *state lists, *scratch
#: lists, (master_params, sr_seeds,) steps]``; a list an option turns off is empty.
TensorLists = list[list[Tensor]]


class GradReduction(Protocol):
    """A reduction over every grad of a step into ``out``, run once before any group's update
    (LAMB's global grad norm). ``out`` is zeroed first."""

    kernel: MultiTensorKernel  # over tensor_lists(grads) (scaled: it applies inv_scale)
    out: Tensor  # 0-dim float32 on the grads' device

    def tensor_lists(self, grads: list[Tensor]) -> TensorLists:
        """The kernel's lists over ``grads``: ``[grads, *scratch lists]`` (LAMB's per-chunk
        partial sums)."""
        ...

    def kernel_args(self, found_inf: int | None, inv_scale: int | None) -> ctypes.Structure:
        """The kernel's argument struct, with device pointers (``None``: null)."""
        ...

    def torch_form(self, grads: list[Tensor]) -> None:
        """The same with torch ops, on unscaled grads."""
        ...


class Update(Protocol):
    """One fused optimizer's update, as the engine and its backends see it.

    The update reads ``found_inf`` on device and changes nothing when it is non-zero (the
    ``found_inf`` contract of the kernel-author guide); step counters are advanced by the step's
    epilogue on our kernels, on torch's ops by :meth:`torch_update` or by the torch-native
    backend around :meth:`torch_form_`.

    Its torch form is one of two: :meth:`torch_update`, over torch's fused ops that take
    ``found_inf`` themselves (Adam(W), SGD, Adagrad), or, with :attr:`torch_form_in_place`,
    :meth:`torch_form_`, the math written once in place, which the backend either runs on the
    lists after reading the skip on the host (a CPU) or runs on working copies and copies back
    unless skipped (any device): both the same function, so the same bits.
    """

    #: The update kernel; its lists are ``TensorLists``.
    kernel: ClassVar[MultiTensorKernel]
    #: Whether the kernel's lists end with ``(..., master_params, sr_seeds, steps)``.
    rounds: ClassVar[bool]
    #: Kernels launched before :attr:`kernel`, over the same lists with the same arguments
    #: (LAMB's moments and norms); usually none.
    kernels_before: ClassVar[tuple[MultiTensorKernel, ...]]
    #: The torch.optim class of the same update, whose own implementation steps the params the
    #: fused update cannot serve (the migration guide,
    #: "What takes torch.optim's own implementation");
    #: ``None``: such params are refused.
    torch_optim: ClassVar[type[torch.optim.Optimizer] | None]
    #: Whether each element's update reads only that element of the param, grad and state
    #: (and scalars), so that a DTensor param's update may run on its local shard (otherwise
    #: the torch form gets the DTensors and sums over whole tensors itself, as
    #: ``scaledoptim.torch_ops.MeshSums`` does).
    elementwise: ClassVar[bool]
    #: Whether :meth:`torch_update` takes ``grad_scale=`` (a 0-dim float32 tensor the grads it
    #: gets are scaled by, as torch's fused Adam(W)/SGD/Adagrad take it): then, on a CPU, the
    #: torch-native backend leaves the grads scaled for it to unscale in its own read of them.
    torch_update_takes_grad_scale: ClassVar[bool]
    #: Whether the torch form is :meth:`torch_form_` (in place, run by the backend's drivers)
    #: rather than :meth:`torch_update`.
    torch_form_in_place: ClassVar[bool]
    #: The optimizer's defaults: ``differentiable`` there turns autograd on around torch.optim's
    #: implementation, as torch.optim's ``step`` does.
    defaults: dict[str, Any]

    def state_keys(self, group: Group) -> tuple[str | None, ...]:
        """The per-param state names, in the order of the kernel's state lists (``None`` for a
        list the group's options turn off). They are created as float32 zeros shaped like the
        param, or as :meth:`initial_state_fill` says (``state["step"]``, a float32 counter,
        exists for every optimizer)."""
        ...

    def initial_state_fill(self) -> dict[str, float]:
        """The value each state key created filled rather than with zeros starts at (Adagrad's
        ``sum``: the constructor's ``initial_accumulator_value``); usually none."""
        ...

    def state_layouts(self, group: Group) -> Mapping[str, StateLayout]:
        """The state names of :meth:`state_keys` whose tensors are not float32 ones shaped
        like the param, and their layouts (a low-bit state's codes and per-block scales); our
        kernels then take their lists in the layouts their names declare (``MultiTensorKernel``:
        ``*_codes``, ``*_scales``), the scales' block size from here. Usually none."""
        ...

    def scratch_lists(self, group: Group, params: list[Tensor]) -> TensorLists:
        """Per-param float32 scratch lists between the state and the rounding lists, zeroed
        before each update on our kernels (LAMB's per-chunk partial norms); usually none."""
        ...

    def grad_reduction(self, grads: list[Tensor]) -> GradReduction | None:
        """A reduction over all of the step's ``grads`` before the updates, or ``None``."""
        ...

    def kernel_args(
        self, group: Group, found_inf: int | None, inv_scale: int | None
    ) -> ctypes.Structure:
        """The kernel's argument struct for ``group`` (read at every step: a scheduler may have
        moved ``lr``), with the device pointers of ``found_inf`` and ``inv_scale`` (``None``:
        null: always step / grads not scaled)."""
        ...

    def torch_update(self, group: Group, lists: TensorLists, found_inf: Tensor | None) -> None:
        """The same update with torch ops, for an update whose torch ops take ``found_inf``
        themselves (torch's fused Adam(W), SGD, Adagrad; otherwise see :meth:`torch_form_`):
        16-bit params arrive as fp32 working copies, grads unscaled; it must skip on
        ``found_inf`` and advance ``steps`` itself, on device. With
        :attr:`torch_update_takes_grad_scale`, it is also called as ``torch_update(group,
        lists, found_inf, grad_scale=S)`` with grads still scaled by ``S`` (see
        ``ScaledTorchUpdate`` in this module)."""
        ...

    def torch_form_(self, group: Group, lists: TensorLists) -> None:
        """The update with torch ops, in place over ``lists`` (``[params, grads, *state lists,
        steps]``, without the rounding lists), taken unconditionally: it reads no ``found_inf``.

        It writes the params and the state lists, nothing else (not the grads, which are the
        user's), and reads ``steps`` as already counting this step (it may get them empty if
        :attr:`elementwise`, when the backend calls it batch by batch). 16-bit params arrive as
        fp32 working copies, grads unscaled. Hyper-parameters are Python numbers or 0-dim
        tensors on the params' device, never read on the host: the backend calls it either on
        the lists themselves after a host read of the skip (a CPU), or on working copies of the
        params and state it writes, then copied back unless ``found_inf`` is set, on device
        (``scaledoptim.fused.backends.torch_native``)."""
        ...

    def torch_optim_update(
        self, group: Group, lists: TensorLists, found_inf: Tensor | None
    ) -> None:
        """torch.optim's own implementation of the update (its functional API with the group's
        ``foreach``, ``fused``, ``capturable``, ``differentiable``) over ``lists``: grads as they
        are (sparse, complex), 16-bit params as fp32 working copies, step counters where the
        torch.optim class keeps them. ``found_inf`` is given only to a ``fused`` group, whose
        implementation skips on it on device; otherwise the step is known to be taken."""
        ...

    def check_torch_optim(self, group: Group, params: list[Tensor]) -> None:
        """Raises, before anything changes, what torch.optim's step would raise at run time for
        ``params`` (with their grads) on its own implementation; e.g. sparse grads."""
        ...


class ScaledTorchUpdate(Protocol):
    """An :class:`Update` whose :attr:`~Update.torch_update_takes_grad_scale` is true: its torch
    form also takes grads scaled by ``grad_scale`` and divides them by it where it reads them
    (torch's fused ops take the same argument), leaving them unscaled as torch's do."""

    def torch_update(
        self,
        group: Group,
        lists: TensorLists,
        found_inf: Tensor | None,
        grad_scale: Tensor | None = None,
    ) -> None: ...


def route_key(update: Update, group: Group) -> tuple[bool, bool]:
    """What of ``group``, besides its params, sends all of them to torch.optim's implementation
    (Note [torch.optim route] in backends/torch_optim.py): ``differentiable``, and a tensor
    hyper-parameter on an accelerator."""
    if update.torch_optim is None:
        return False, False
    return bool(group.get("differentiable")), _holds_accelerator_tensor(group)


def _holds_accelerator_tensor(group: Group) -> bool:
    for key, value in group.items():
        if key == "params":
            continue
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, Tensor) and item.device.type != "cpu":
                return True
    return False


def lists_key(optimizer: Update, group: Group) -> tuple[Any, ...]:
    """What, besides the params and their state, decides a group's tensor lists (the value's type
    too: ``1`` is no valid ``master_weights`` though it equals ``True``) and its backends."""
    master, stochastic = group.get("master_weights", False), group.get("stochastic_rounding", False)
    return (
        optimizer.state_keys(group), type(master), master, type(stochastic), stochastic,
        route_key(optimizer, group),
    )
