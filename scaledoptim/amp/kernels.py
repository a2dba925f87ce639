"""The Python autocast kernel registered for an op whose policy was edited.

Each policy is a *preparer*: ``prepare(args, kwargs, cache) -> (op, args, kwargs)`` returns
what to redispatch below autocast (``op`` is ``OpOverload._op``, the C++ entry point, which
saves the Python frame of ``OpOverload.__call__`` on every call), mirroring
``at::autocast::WrapFunction_`` in ATen's
``autocast_mode.h`` (eligibility, ``prioritize`` for promote, ``set_opt_dtype``,
``type_from_firstarg``). ``cache`` is the thread's cast cache inside a scaledoptim region
and ``None`` inside a plain ``torch.autocast`` region (see Note [telling regions apart]).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._ops import OpOverload

from . import policies
from .cache import CastCache, thread_cache
from .op_names import dispatcher_name
from .regions import in_scaledoptim_region

Args = tuple[Any, ...]
Kwargs = dict[str, Any]
Preparer = Callable[[Args, Kwargs, "CastCache | None"], tuple[Callable[..., Any], Args, Kwargs]]

_ON_DEVICE: dict[str, Callable[[torch.Tensor], bool]] = {
    "cpu": lambda tensor: tensor.is_cpu or tensor.is_mkldnn,
    "cuda": lambda tensor: tensor.is_cuda,
}


def _is_eligible(tensor: torch.Tensor, on_device: Callable[[torch.Tensor], bool]) -> bool:
    # ATen's is_eligible: a floating tensor on the region's device that is not float64.
    return tensor.is_floating_point() and tensor.dtype is not torch.float64 and on_device(tensor)


class _Caster:
    """Casts eligible tensors of one call to one dtype, using the cache where ATen would."""

    __slots__ = ("dtype", "on_device", "cache")

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


def _tensors(args: Args, kwargs: Kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (item for item in value if isinstance(item, torch.Tensor))


def _cast_all_to(target: Callable[[str], torch.dtype]) -> Callable[[OpOverload, str], Preparer]:
    def make(op: OpOverload, device_type: str) -> Preparer:
        def prepare(args: Args, kwargs: Kwargs, cache: CastCache | None):
            caster = _Caster(target(device_type), device_type, cache)
            return (op._op, *caster.call_args(args, kwargs))

        return prepare

    return make


def _promote(op: OpOverload, device_type: str) -> Preparer:
    on_device = _ON_DEVICE[device_type]

    def prepare(args: Args, kwargs: Kwargs, cache: CastCache | None):
        lower = torch.get_autocast_dtype(device_type)
        widest = lower
        for tensor in _tensors(args, kwargs):
            if not _is_eligible(tensor, on_device) or tensor.dtype is lower:
                continue
            if tensor.dtype is not torch.float32:
                raise RuntimeError(
                    f"Unexpected floating ScalarType {tensor.dtype} in autocast promote for "
                    f"{op}: inputs must be float32 or the region's dtype {lower}"
                )
            widest = torch.float32
        return (op._op, *_Caster(widest, device_type, cache).call_args(args, kwargs))

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


def _unsafe_to_autocast(op: OpOverload, device_type: str) -> Preparer:
    def prepare(args: Args, kwargs: Kwargs, cache: CastCache | None):
        raise RuntimeError(
            f"{op} is unsafe to autocast on {device_type}; use its *_with_logits variant or "
            "run it with autocast disabled on float32 inputs"
        )

    return prepare


_PREPARERS: dict[str | None, Callable[[OpOverload, str], Preparer]] = {
    policies.LOWER_PRECISION_FP: _cast_all_to(torch.get_autocast_dtype),
    policies.FP32: _cast_all_to(lambda device_type: torch.float32),
    policies.PROMOTE: _promote,
    policies.FP32_SET_OPT_DTYPE: _fp32_set_opt_dtype,
    policies.FP32_APPEND_DTYPE: _fp32_append_dtype,
    None: _fall_through,
}


def make_autocast_kernel(
    op: OpOverload, device_type: str, policy: str | None
) -> Callable[..., Any]:
    """Build the Autocast kernel of ``op`` on ``device_type`` for ``policy``.

    Inside a scaledoptim region the kernel applies ``policy``; inside a plain
    ``torch.autocast`` region it applies torch's default policy for ``op``. Either way it
    casts the inputs and redispatches below the device's Autocast key, so autograd records
    (and saves for backward) the cast inputs.

    Raises:
        ValueError: ``policy`` cannot apply to ``op``'s schema.
    """
    name = dispatcher_name(op)
    ours = _PREPARERS[policy](op, device_type)
    if name in policies.UNSAFE_TO_AUTOCAST[device_type]:
        torchs = _unsafe_to_autocast(op, device_type)
    else:
        torchs = _PREPARERS[policies.default_policy(name, device_type)](op, device_type)
    below_autocast = torch._C.DispatchKeySet(
        getattr(torch._C.DispatchKey, policies.AUTOCAST_DISPATCH_KEYS[device_type])
    )
    exclude_autocast = torch._C._ExcludeDispatchKeyGuard

    def autocast_kernel(*args: Any, **kwargs: Any) -> Any:
        with exclude_autocast(below_autocast):
            if in_scaledoptim_region(device_type):
                target, args, kwargs = ours(args, kwargs, thread_cache())
            else:
                target, args, kwargs = torchs(args, kwargs, None)
            return target(*args, **kwargs)

    autocast_kernel.__name__ = f"scaledoptim_autocast_{name.replace('::', '_').replace('.', '_')}"
    return autocast_kernel
