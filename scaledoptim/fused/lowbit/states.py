"""``state_bits=8``: a fused optimizer whose declared states are kept as 8-bit block-wise codes
(Note [low-bit variants])."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from ...kernels import PLAIN_TENSOR_TYPES, MultiTensorKernel
from ..state import StateLayout
from ..update import Group, TensorLists
from .blockwise import quantize_blockwise
from .codes import Code
from .form import LowBitLists, lowbit_form_

__all__ = [
    "MAX_BLOCK_SIZE",
    "STATE_BITS",
    "LowBitStates",
    "check_state_bits",
    "lowbit_fields",
    "lowbit_kernel",
    "lowbit_new",
    "lowbit_options",
]

# Note [low-bit variants]
# ~~~~~~~~~~~~~~~~~~~~~~~
# An optimizer declares which of its states may be kept in 8 bits, and in which code
# (``lowbit_codes``: state name -> Code, e.g. Adam's {"exp_avg": SIGNED, "exp_avg_sq":
# UNSIGNED, ...}), and the kernel that updates them (``lowbit_kernel``: its float32 kernel's
# lists with each state list X replaced by X_codes and X_scales, :func:`lowbit_kernel`). Its
# constructor takes ``state_bits`` (32, the default, or 8) and ``block_size``; with 8, the
# instance is made of the optimizer's *low-bit variant* (``__new__``: :func:`lowbit_new`), a
# subclass made once per class, ``LowBitStates`` first in its bases, of the same name. The
# variant is that optimizer in every respect but its state: each declared state X is
# ``X_codes`` (uint8, shaped like the param) and ``X_scales`` (float32, one per block of
# ``block_size`` elements in storage order: Note [block-wise codes]); our kernels update them in
# registers (cuda/blockwise_quant.cuh), and its torch form runs the optimizer's own float32
# torch form over a batch of decoded blocks at a time (Note [low-bit batches]). Nothing of the
# engine changes: the variant is a FusedOptimizer with another kernel, other state layouts
# (``Update.state_layouts``) and an in-place torch form. Both options are per optimizer (every
# param group holds the constructor's, checked at every step), so the kernel and the layouts of
# a state never change under it.

#: The state precisions an optimizer takes: float32 states, or 8-bit codes.
STATE_BITS = (32, 8)
#: The largest ``block_size``: the torch form's buffers and the kernels' chunks hold a block.
MAX_BLOCK_SIZE = 1 << 20


def check_state_bits(state_bits: Any, block_size: Any) -> None:
    """Raises ``TypeError``/``ValueError`` naming the option unless ``state_bits`` is 32 or 8
    and ``block_size`` a positive int (at most :data:`MAX_BLOCK_SIZE`)."""
    if isinstance(state_bits, bool) or not isinstance(state_bits, int):
        raise TypeError(
            f"state_bits must be an int, 32 (float32 states) or 8 (8-bit block-wise states), "
            f"got {state_bits!r} of type {type(state_bits).__name__}"
        )
    if state_bits not in STATE_BITS:
        raise ValueError(
            f"Invalid state_bits: {state_bits}; use 32 (float32 states, the default) or 8 "
            "(8-bit block-wise states)"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, (int, float)):
        raise TypeError(
            f"block_size must be a positive int (elements per block of 8-bit states), got "
            f"{block_size!r} of type {type(block_size).__name__}"
        )
    if not isinstance(block_size, int) or not 0 < block_size <= MAX_BLOCK_SIZE:
        raise ValueError(
            f"Invalid block_size: {block_size!r}; use a positive int up to {MAX_BLOCK_SIZE} "
            "(elements per block of 8-bit states; 256 by default)"
        )


def lowbit_options(state_bits: int, block_size: int) -> dict[str, int]:
    """The options a low-bit optimizer's groups hold (none for float32 states: their
    ``defaults`` are those of the float32 optimizer)."""
    return {} if state_bits == 32 else {"state_bits": state_bits, "block_size": block_size}


def lowbit_new(cls: type, kwargs: Mapping[str, Any]) -> Any:
    """A new, uninitialized instance of ``cls``, or of its low-bit variant for
    ``state_bits=8``, after checking ``state_bits`` and ``block_size`` (before anything else
    is made)."""
    state_bits, block_size = kwargs.get("state_bits", 32), kwargs.get("block_size", 256)
    check_state_bits(state_bits, block_size)
    if state_bits == 8 and not issubclass(cls, LowBitStates):
        cls = lowbit_variant(cls)
    return object.__new__(cls)


def lowbit_variant(base: type) -> type:
    """``base``'s low-bit variant (Note [low-bit variants]), made once."""
    variant = _variants.get(base)
    if variant is not None:
        return variant
    kernel = getattr(base, "lowbit_kernel", None)
    if kernel is None:
        raise ValueError(f"{base.__name__} declares no 8-bit states: use state_bits=32")
    namespace = {
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
        "kernel": kernel,
        "_lowbit_base": base,
    }
    variant = _variants[base] = type(base.__name__, (LowBitStates, base), namespace)
    return variant


_variants: dict[type, type] = {}


def _new_lowbit(base: type) -> Any:
    """Unpickling: an uninitialized instance of ``base``'s low-bit variant."""
    return object.__new__(lowbit_variant(base))


def lowbit_fields(args_type: type[ctypes.Structure]) -> list[tuple[str, Any]]:
    """The ``_fields_`` of a low-bit kernel's args struct, ``LowBitArgs<Args>`` in
    cuda/blockwise_quant.cuh: the float32 kernel's args, and the block size. Its module defines
    it by name, ``LowBit<Args>``, as its source does (a kernel and its args pickle)."""
    return [("update", args_type), ("block_size", ctypes.c_longlong)]


def lowbit_kernel(
    base: MultiTensorKernel,
    state_lists: tuple[str, ...],
    args_type: type[ctypes.Structure],
) -> MultiTensorKernel:
    """The low-bit kernel of ``base`` (on its source, named ``<name>_lowbit_kernel``): its lists
    with each of ``state_lists`` replaced by ``<list>_codes`` and ``<list>_scales``, its args
    ``args_type`` (of :func:`lowbit_fields`)."""
    lists: list[str] = []
    for name in base.lists:
        lists += [f"{name}_codes", f"{name}_scales"] if name in state_lists else [name]
    return MultiTensorKernel(
        base.source,
        base.name.removesuffix("_kernel") + "_lowbit_kernel",
        tuple(lists),
        args_type,
        dtype_lists=base.dtype_lists,
    )


class LowBitStates:
    """The low-bit variant's part of an optimizer (Note [low-bit variants]): first in the
    variant's bases, before the optimizer's class, whose hooks it wraps."""

    #: The optimizer's declaration: its states kept in 8 bits, and their codes.
    lowbit_codes: ClassVar[Mapping[str, Code]]
    #: The optimizer's class, whose variant this is.
    _lowbit_base: ClassVar[type]
    #: Its low-bit kernel (the optimizer's ``lowbit_kernel``).
    kernel: ClassVar[MultiTensorKernel]
    torch_form_in_place: ClassVar[bool] = True
    # A state's blocks span elements: not elementwise (a DTensor is refused, _check_params).
    elementwise: ClassVar[bool] = False
    # torch.optim's implementations keep float32 states: what they would take is refused.
    torch_optim: ClassVar[type[torch.optim.Optimizer] | None] = None
    torch_update_takes_grad_scale: ClassVar[bool] = False

    def state_keys(self, group: Group) -> tuple[str | None, ...]:
        keys: list[str | None] = []
        for key in super().state_keys(group):  # type: ignore[misc]
            keys += [None, None] if key is None else [f"{key}_codes", f"{key}_scales"]
        return tuple(keys)

    def state_layouts(self, group: Group) -> dict[str, StateLayout]:
        codes, scales = StateLayout(torch.uint8), StateLayout(torch.float32, group["block_size"])
        layouts = {}
        for key in super().state_keys(group):  # type: ignore[misc]
            if key is not None:
                layouts[f"{key}_codes"], layouts[f"{key}_scales"] = codes, scales
        return layouts

    def check_options(self, options: dict[str, Any]) -> None:
        super().check_options(options)  # type: ignore[misc]
        state_bits, block_size = options.get("state_bits"), options.get("block_size")
        check_state_bits(state_bits, block_size)
        defaults = getattr(self, "defaults", options)
        if state_bits != 8 or block_size != defaults["block_size"]:
            raise ValueError(
                f"Invalid param group: state_bits={state_bits!r}, block_size={block_size!r}, but "
                f"this {type(self).__name__} keeps 8-bit states in blocks of "
                f"{defaults['block_size']}: state_bits and block_size are per optimizer (make "
                "another optimizer for params that need others)"
            )
        if options.get("differentiable"):
            raise ValueError(
                "differentiable=True takes torch.optim's implementation, which keeps float32 "
                "states: use state_bits=32 for a differentiable step"
            )

    def kernel_args(self, group: Group, found_inf: int | None, inv_scale: int | None) -> Any:
        args = super().kernel_args(group, found_inf, inv_scale)  # type: ignore[misc]
        return self.kernel.args_type(update=args, block_size=group["block_size"])

    def torch_form_(self, group: Group, lists: TensorLists) -> None:
        params, grads, *state_lists, steps = lists
        states: list[LowBitLists | None] = []
        for i, key in enumerate(super().state_keys(group)):  # type: ignore[misc]
            codes, scales = state_lists[2 * i], state_lists[2 * i + 1]
            code = None if key is None else self.lowbit_codes[key]
            states.append(None if code is None else LowBitLists(codes, scales, code))
        form = functools.partial(super().torch_form_, group)  # type: ignore[misc]
        lowbit_form_(form, [params, grads, steps], states, group["block_size"])

    def _plan_load_state(self, state_dict: dict[str, Any], by_id: Any) -> Any:
        # A state_dict of float32 states (this optimizer's class with state_bits=32, or
        # torch.optim's) loads encoded: its moments rounded to the nearest codes.
        state_dict = quantize_state_dict(state_dict, self.lowbit_codes, self.defaults)  # type: ignore[attr-defined]
        return super()._plan_load_state(state_dict, by_id)  # type: ignore[misc]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # type: ignore[misc]
        added = self.param_groups[-1]  # type: ignore[attr-defined]
        try:  # what a step would refuse, refused now (and the group not added)
            self.check_options(added)
            _check_params(self, [added], first=len(self.param_groups) - 1)  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            self.param_groups.pop()  # type: ignore[attr-defined]
            raise

    def _plan_step(self, run: Callable[[], Any] | None = None) -> Any:
        _check_params(self, self.param_groups)  # type: ignore[attr-defined]
        return super()._plan_step(run)  # type: ignore[misc]

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The variant is no module attribute: pickle rebuilds it from its optimizer's class.
        state = self.__getstate__()  # type: ignore[attr-defined]
        return _new_lowbit, (type(self)._lowbit_base,), state


def _check_params(optimizer: Any, groups: list[Group], first: int = 0) -> None:
    """Refuses params 8-bit states cannot serve, naming why (``first``: the index of the first
    of ``groups``); nothing was changed."""
    for index, group in enumerate(groups, first):
        for param in group["params"]:
            if type(param) not in PLAIN_TENSOR_TYPES:
                raise ValueError(
                    f"{type(optimizer).__name__}(state_bits=8): param group {index} holds a "
                    f"{type(param).__name__} param; 8-bit states are blocks of consecutive "
                    "elements with one scale each, which a sharded tensor's shards (FSDP2, "
                    "DTensor) would cut and resharding (DCP) move: use state_bits=32 for "
                    "sharded params; nothing was changed"
                )
            if param.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(
                    f"{type(optimizer).__name__}(state_bits=8): param group {index} holds a "
                    f"{param.dtype} param; 8-bit states serve float32, float16 and bfloat16 "
                    "params: use state_bits=32 for others; nothing was changed"
                )


def check_float32_states(optimizer: object, options: Mapping[str, Any]) -> None:
    """Refuses a param group of an optimizer with float32 states that asks for other
    ``state_bits`` (a state_dict of a low-bit optimizer, a group edited)."""
    if isinstance(optimizer, LowBitStates):
        return
    state_bits = options.get("state_bits", 32)
    if state_bits != 32:
        raise ValueError(
            f"Invalid param group: state_bits={state_bits!r}, but this "
            f"{type(optimizer).__name__} keeps float32 states (state_bits is per optimizer: a "
            "state_dict of 8-bit states loads into an optimizer made with state_bits=8)"
        )


def quantize_state_dict(
    state_dict: dict[str, Any], codes: Mapping[str, Code], defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """``state_dict`` with its float32 states encoded (nearest codes, blocks of
    ``defaults["block_size"]``) and its groups given ``defaults``' ``state_bits`` and
    ``block_size``, if its groups hold no ``state_bits`` or 32 (a state_dict of float32
    states); else as it is. Non-tensor or non-float values are left for the load to refuse."""
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or any(
        not isinstance(g, Mapping) or g.get("state_bits", 32) != 32 for g in groups
    ):
        return state_dict
    block_size = defaults["block_size"]
    options = {"state_bits": defaults["state_bits"], "block_size": block_size}
    state = {}
    for key, saved in state_dict.get("state", {}).items():
        converted = dict(saved) if isinstance(saved, Mapping) else saved
        for name, code in codes.items():
            value = converted.get(name) if isinstance(converted, dict) else None
            if isinstance(value, Tensor) and value.is_floating_point() and not value.is_meta:
                del converted[name]
                codes_, scales = quantize_blockwise(value.detach().float(), code, block_size)
                converted[f"{name}_codes"], converted[f"{name}_scales"] = codes_, scales
        state[key] = converted
    return {
        **state_dict,
        "state": state,
        "param_groups": [{**group, **options} for group in groups],
    }
