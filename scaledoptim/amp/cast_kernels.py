"""The Python autocast kernel registered for an op whose policy was edited, and its policies.

Each policy is a *preparer*: ``prepare(args, kwargs, cache) -> (op, args, kwargs)`` returns
what to redispatch below autocast (``op`` is ``OpOverload._op``, the C++ entry point, which
saves the Python frame of ``OpOverload.__call__`` on every call), mirroring
``at::autocast::WrapFunction_`` in ATen's
``autocast_mode.h`` (eligibility, ``prioritize`` for promote, ``set_opt_dtype``,
``type_from_firstarg``). ``cache`` is the thread's cast cache inside a scaledoptim region
and ``None`` inside a plain ``torch.autocast`` region (see Note [telling regions apart]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload

from . import edits, policies
from .cache import CastCache, thread_cache
from .edits import Args, Kwargs, PolicySlot, Preparer
from .op_names import dispatcher_name
from .regions import governing
from .running_stats import RunningStats
from .torch_checkpoint import refuse_torch_checkpoint

_ON_DEVICE: dict[str, Callable[[torch.Tensor], bool]] = {
    "cpu": lambda tensor: tensor.is_cpu or tensor.is_mkldnn,
    "cuda": lambda tensor: tensor.is_cuda,
}


def _is_eligible(tensor: torch.Tensor, on_device: Callable[[torch.Tensor], bool]) -> bool:
    # ATen's is_eligible: a floating tensor on the region's device that is not float64.
    return tensor.is_floating_point() and tensor.dtype is not torch.float64 and on_device(tensor)


class _Caster:
    """Casts eligible tensors of one call to one dtype, using the cache where ATen would."""

    __slots__ = ("cache", "dtype", "on_device")

    def __init__(self, dtype: torch.dtype, device_type: str, cache: CastCache | None) -> None:
        self.dtype = dtype
        self.on_device = _ON_DEVICE[device_type]
        lower = torch.get_autocast_dtype(device_type)
        # Only casts to the region's lower precision dtype are cached (ATen's can_try_cache).
        # Casts made under no_grad carry no autograd history and must not be reused later.
        cache_usable = (
            dtype is lower and torch.is_autocast_cache_enabled() and torch.is_grad_enabled()
        )
        self.cache = cache if cache_usable else None

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype is self.dtype or not _is_eligible(tensor, self.on_device):
            return tensor
        if (
            self.cache is not None
            and tensor.dtype is torch.float32
            and tensor.requires_grad
            and tensor.is_leaf
            and not tensor._is_view()
        ):
            return self.cache.cast(tensor, self.dtype)
        return tensor.to(self.dtype)

    def value(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in value):
            # TensorList and Tensor?[] arguments (cat, index_put).
            return [self.tensor(x) if isinstance(x, torch.Tensor) else x for x in value]
        return value

    def call_args(self, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
        return (
            tuple([self.value(arg) for arg in args]),
            {name: self.value(arg) for name, arg in kwargs.items()},
        )


def _tensors(values: Any):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (item for item in value if isinstance(item, torch.Tensor))


def _cast_call(
    caster: _Caster, stats: RunningStats | None, args: Args, kwargs: Kwargs
) -> tuple[Args, Kwargs]:
    # See Note [running statistics]: never cast what the op writes without saying so.
    if stats is None:
        return caster.call_args(args, kwargs)
    return stats.cast(args, kwargs, caster.value)


def _cast_all_to(target: Callable[[str], torch.dtype]) -> Callable[[OpOverload, str], Preparer]:
    def make(op: OpOverload, device_type: str) -> Preparer:
        stats = RunningStats.of(op)

        def prepare(args: Args, kwargs: Kwargs, cache: CastCache | None):
            caster = _Caster(target(device_type), device_type, cache)
            return (op._op, *_cast_call(caster, stats, args, kwargs))

        return prepare

    return make


def _promote(op: OpOverload, device_type: str) -> Preparer:
    on_device = _ON_DEVICE[device_type]
    stats = RunningStats.of(op)

    def prepare(args: Args, kwargs: Kwargs, cache: CastCache | None):
        lower = torch.get_autocast_dtype(device_type)
        widest = lower
        inputs = (*args, *kwargs.values()) if stats is None else stats.without_stats(args, kwargs)
        for tensor in _tensors(inputs):
            if not _is_eligible(tensor, on_device) or tensor.dtype is lower:
                continue
            if tensor.dtype is not torch.float32:
                raise RuntimeError(
                    f"Unexpected floating ScalarType {tensor.dtype} in autocast promote for "
                    f"{op}: inputs must be float32 or the region's dtype {lower}"
                )
            widest = torch.float32
        return (op._op, *_cast_call(_Caster(widest, device_type, cache), stats, args, kwargs))

    return prepare


def _optional_dtype_argument(op: OpOverload) -> tuple[int, str]:
    for index, argument in enumerate(op._schema.arguments):
        # The JIT type of a dtype is int; real_type keeps the schema's ScalarType.
        if str(argument.real_type) == "Optional[ScalarType]":
            return (index if not argument.kwarg_only else -1), argument.name
    raise ValueError(
        f"Policy 'fp32_set_opt_dtype' needs an optional dtype argument ('ScalarType? dtype'), "
        f"but {op._schema} has none; use 'fp32' or 'fp32_append_dtype' instead"
    )


def _first_arg_is_eligible(args: Args, on_device: Callable[[torch.Tensor], bool]) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor) and _is_eligible(args[0], on_device)


def _fp32_set_opt_dtype(op: OpOverload, device_type: str) -> Preparer:
    index, name = _optional_dtype_argument(op)
    on_device = _ON_DEVICE[device_type]

    def prepare(args: Args, kwargs: Kwargs, cache: CastCache | None):
        # Inputs are not cast: the op computes in fp32 through its own dtype argument.
        if not _first_arg_is_eligible(args, on_device):
            return op._op, args, kwargs
        if 0 <= index < len(args):
            if args[index] is None:
                args = (*args[:index], torch.float32, *args[index + 1 :])
        elif kwargs.get(name) is None:
            kwargs = {**kwargs, name: torch.float32}
        return op._op, args, kwargs

    return prepare


def _dtype_sibling(op: OpOverload) -> OpOverload:
    names = [argument.name for argument in op._schema.arguments]
    packet = op.overloadpacket
    for overload_name in packet.overloads():
        sibling = getattr(packet, overload_name)
        arguments = sibling._schema.arguments
        if (
            not sibling._schema.is_mutable
            and [argument.name for argument in arguments] == [*names, "dtype"]
            and str(arguments[-1].real_type) == "ScalarType"
        ):
            return sibling
    raise ValueError(
        f"Policy 'fp32_append_dtype' needs an overload of {packet} that takes the same "
        f"arguments as {op._schema.name}.{op._schema.overload_name} plus a trailing "
        "'ScalarType dtype'; none exists, use 'fp32' instead"
    )


def _fp32_append_dtype(op: OpOverload, device_type: str) -> Preparer:
    sibling = _dtype_sibling(op)
    on_device = _ON_DEVICE[device_type]
    # Callers may omit trailing defaulted arguments, which the sibling may not default
    # (norm.Scalar's p=2 versus norm.ScalarOpt_dtype's required p).
    defaults = tuple(
        argument.default_value for argument in op._schema.arguments if not argument.kwarg_only
    )

    def prepare(args: Args, kwargs: Kwargs, cache: CastCache | None):
        out_dtype = torch.float32 if _first_arg_is_eligible(args, on_device) else args[0].dtype
        args = (*args, *defaults[len(args) :])
        return sibling._op, args, {**kwargs, "dtype": out_dtype}

    return prepare


def _fall_through(op: OpOverload, device_type: str) -> Preparer:
    def prepare(args: Args, kwargs: Kwargs, cache: CastCache | None):
        return op._op, args, kwargs

    return prepare


_PREPARERS: dict[str | None, Callable[[OpOverload, str], Preparer]] = {
    policies.LOWER_PRECISION_FP: _cast_all_to(torch.get_autocast_dtype),
    policies.FP32: _cast_all_to(lambda device_type: torch.float32),
    policies.PROMOTE: _promote,
    policies.FP32_SET_OPT_DTYPE: _fp32_set_opt_dtype,
    policies.FP32_APPEND_DTYPE: _fp32_append_dtype,
    None: _fall_through,
}



def make_preparer(op: OpOverload, device_type: str, policy: str | None) -> Preparer:
    """Return the preparer that applies ``policy`` to ``op`` on ``device_type``.

    Raises:
        ValueError: ``policy`` cannot apply to ``op``'s schema.
    """
    return _PREPARERS[policy](op, device_type)


def _torchs_kernel(op: OpOverload, device_type: str) -> Callable[..., Any]:
    """Return a call of the op as torch's own Autocast kernel would run it (keyset first)."""
    key = policies.AUTOCAST_DISPATCH_KEYS[device_type]
    name = dispatcher_name(op)
    below_autocast = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    exclude_autocast = torch._C._ExcludeDispatchKeyGuard
    if torch._C._dispatch_has_kernel_for_dispatch_key(name, key):
        # torch's C++ kernel (or another library's), kept alive by the returned handle:
        # calling it keeps torch's exact behaviour, torch's cast cache included.
        return torch.library.get_kernel(op, key).call_boxed

    def fall_through(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        with exclude_autocast(below_autocast):
            return op._op(*args, **kwargs)

    return fall_through


def make_autocast_kernel(op: OpOverload, device_type: str, slot: PolicySlot) -> Callable[..., Any]:
    """Build the Autocast kernel of ``op`` on ``device_type``, reading ``slot`` per call.

    Inside a scaledoptim region with an edit in ``slot`` the kernel applies the edited
    policy: it casts the inputs and redispatches below the device's Autocast key, so
    autograd records (and saves for backward) the cast inputs. Otherwise (a plain
    ``torch.autocast`` region, or no edit) it runs the kernel torch had for the op before
    this one was registered, or falls through when torch had none. Build it before
    registering it. The kernel takes the dispatch keyset first (``with_keyset=True``).
    """
    torchs = _torchs_kernel(op, device_type)
    name = dispatcher_name(op)
    below_autocast = torch._C.DispatchKeySet(
        getattr(torch._C.DispatchKey, policies.AUTOCAST_DISPATCH_KEYS[device_type])
    )
    exclude_autocast = torch._C._ExcludeDispatchKeyGuard

    def autocast_kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        entry, regions = governing(device_type)
        if entry is None:
            return torchs(keyset, *args, **kwargs)
        edit = slot.edit  # one read: set_policy on another thread swaps it whole
        snapshot = entry.snapshot
        if snapshot is not None and snapshot.version != edits.version:
            edit = snapshot.edits.get(slot)  # a checkpoint's recomputation: the forward's edits
        if edit is None:
            return torchs(keyset, *args, **kwargs)
        if regions.traced:
            cache = None  # casts of fake tensors must not reach the thread's cache
        else:
            if entry.frame is not None:
                refuse_torch_checkpoint(entry, name)
            cache = thread_cache()
        with exclude_autocast(below_autocast):
            target, args, kwargs = edit[1](args, kwargs, cache)
            return target(*args, **kwargs)

    autocast_kernel.__name__ = f"scaledoptim_autocast_{name.replace('::', '_').replace('.', '_')}"
    return autocast_kernel
