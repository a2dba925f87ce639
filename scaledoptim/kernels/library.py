"""A multi-tensor launch as a ``torch.library`` custom op, so that ``torch.compile`` graphs can
hold it (Note [launch op]).

Note [launch op]
~~~~~~~~~~~~~~~~
``scaledoptim::multi_tensor_launch`` takes everything a launch depends on as op inputs, so the
graph sees every dependency and nothing is baked in at trace time that changes at run time:

- the tensors of every list, flattened, and the list lengths (``list[int]``);
- the kernel by its registry key (:func:`kernel_key`), a string: an op cannot take a Python
  object, so the key is filled into a registry when a launch is traced;
- the scalar fields of the args struct as two value lists, integers (and pointers given as
  ints) and floats, in field order. Not the struct's bytes: ``bytes(struct)`` cannot be traced
  by dynamo (a graph break), and a function hiding it from dynamo
  (``assume_constant_result``) installs no guard, so a changed ``lr`` would silently keep its
  old value. Reading the fields is traced and guarded (a changed value recompiles), and float32
  and float64 values round-trip through a Python float exactly;
- the scalar tensors whose device pointers go into pointer fields (``found_inf``,
  ``inv_scale``, ...), with their field names: real graph inputs, their pointers taken when the
  op runs, so a ``found_inf`` computed inside the compiled function is the one the kernel reads
  (the fields by their index in ``_fields_``: an op cannot take a ``list[str]``).

``mutates_args`` is ``tensors`` and ``pointer_tensors``: a ``MultiTensorKernel`` does not declare
which lists it writes (the check kernel writes ``found_inf``, updates write params and state, the
epilogue writes the loss scale through pointers), so both tensor inputs are declared mutated;
the kernel key, lengths and scalars are not. Declaring a read-only tensor mutated costs at most
a copy in functionalized graphs, never a wrong result; ``"unknown"`` would say less than this.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from .. import compile_boundary
from . import launcher
from .spec import MultiTensorKernel, registered_kernels

__all__ = ["kernel_key", "launch_op", "op_inputs", "registered_kernel"]

_FLOAT_TYPES = (ctypes.c_float, ctypes.c_double)
_INT_TYPES = (
    ctypes.c_void_p, ctypes.c_bool, ctypes.c_int8, ctypes.c_uint8, ctypes.c_int16,
    ctypes.c_uint16, ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64,
)
_kernels: dict[str, MultiTensorKernel] = {}


def kernel_key(kernel: MultiTensorKernel) -> str:
    """The name under which ``kernel`` is registered for the op: its template name and a hash
    of its whole description (source, lists, args type), stable across processes."""
    digest = hashlib.sha1(repr(kernel).encode()).hexdigest()[:12]
    return f"{kernel.name}@{digest}"


@compile_boundary.assume_constant_result
def _register(kernel: MultiTensorKernel) -> str:
    # Runs while tracing, outside the graph: the registry is filled before the graph first runs.
    key = kernel_key(kernel)
    known = _kernels.setdefault(key, kernel)
    if known != kernel:
        raise ValueError(
            f"two different kernels share the launch-op key {key!r}: {known} and {kernel}; "
            "give one of them another name or source"
        )
    return key


def registered_kernel(key: str) -> MultiTensorKernel:
    """The kernel registered under ``key`` (:func:`kernel_key`); every kernel defined in this
    process is (:func:`~scaledoptim.kernels.registered_kernels`).

    Raises:
        KeyError: no kernel with that key was defined in this process.
    """
    if key not in _kernels:
        for kernel in registered_kernels():
            _kernels.setdefault(kernel_key(kernel), kernel)
    if key not in _kernels:
        raise KeyError(
            f"no kernel is registered as {key!r}; define its MultiTensorKernel (import the module "
            "that defines it) in this process first"
        )
    return _kernels[key]


def _field_kinds(args_type: type[ctypes.Structure]) -> tuple[list[str], list[str]]:
    """The integer (pointer included) and the float field names of ``args_type``, in order."""
    ints, floats = [], []
    for name, field_type, *_ in args_type._fields_:
        if issubclass(field_type, _FLOAT_TYPES):
            floats.append(name)
        elif issubclass(field_type, _INT_TYPES):
            ints.append(name)
        else:
            raise TypeError(
                f"{args_type.__name__}.{name} is a {field_type.__name__}; the launch op takes "
                "args structs of integer, pointer, float and double fields only"
            )
    return ints, floats


_kinds_cache: dict[type[ctypes.Structure], tuple[list[str], list[str]]] = {}


@torch.library.custom_op(
    "scaledoptim::multi_tensor_launch", mutates_args=("tensors", "pointer_tensors")
)
def multi_tensor_launch(
    kernel: str,
    tensors: list[Tensor],
    list_lengths: list[int],
    int_args: list[int],
    float_args: list[float],
    pointer_tensors: list[Tensor],
    pointer_fields: list[int],
) -> None:
    """Launches the kernel registered as ``kernel`` (Note [launch op] for the inputs)."""
    spec = registered_kernel(kernel)
    kinds = _kinds_cache.get(spec.args_type)
    if kinds is None:
        kinds = _kinds_cache[spec.args_type] = _field_kinds(spec.args_type)
    args = spec.args_type(**dict(zip(kinds[0], int_args)), **dict(zip(kinds[1], float_args)))
    lists, start = [], 0
    for length in list_lengths:
        lists.append(tensors[start : start + length])
        start += length
    device = tensors[0].device if tensors else torch.device("cpu")
    prepared = launcher.prepare_launch(spec, lists)  # validates before anything runs
    for index, t in zip(pointer_fields, pointer_tensors):
        name = spec.args_type._fields_[index][0]
        setattr(args, name, launcher.scalar_pointer(t, name, device))
    prepared.run(args)


@multi_tensor_launch.register_fake
def _(kernel, tensors, list_lengths, int_args, float_args, pointer_tensors, pointer_fields):
    return None  # the op only writes into its inputs


def launch_op(
    kernel: MultiTensorKernel,
    tensor_lists: Sequence[Sequence[Tensor]],
    args: ctypes.Structure,
    pointers: Mapping[str, Tensor | None] | None = None,
) -> None:
    r"""Runs ``kernel`` over ``tensor_lists`` as the op ``scaledoptim::multi_tensor_launch``,
    which ``torch.compile`` keeps in its graph (``fullgraph=True`` works).

    :func:`~scaledoptim.kernels.launch` calls this while compiling; call it yourself to pass
    device scalars created inside the compiled function. Outside ``torch.compile`` it does what
    ``launch`` does, through the dispatcher (slower: prefer ``launch`` in eager code).

    Args:
        kernel: the kernel to run.
        tensor_lists: as for :func:`~scaledoptim.kernels.launch`.
        args: an instance of ``kernel.args_type``. Build it outside the compiled function
            (ctypes objects cannot be created in a graph); its values are read while tracing and
            become constants of the graph, which recompiles when one changes.
        pointers: pointer fields of ``args`` filled, when the op runs, with the data pointer of
            a one-element float32 tensor on the tensors' device (``None``: null), replacing
            whatever ``args`` holds there.

    Raises:
        TypeError: ``args`` is not a ``kernel.args_type``.
        ValueError: a name in ``pointers`` is not a pointer field of ``args``; when the op runs,
            everything :func:`~scaledoptim.kernels.prepare_launch` and the scalar checks raise,
            before anything is launched.

    Example::

        >>> found = torch.zeros(())
        >>> launch_op(NON_FINITE_CHECK, [grads], NonFiniteCheckArgs(), {"found_inf": found})
    """
    torch.ops.scaledoptim.multi_tensor_launch(*op_inputs(kernel, tensor_lists, args, pointers))


def op_inputs(
    kernel: MultiTensorKernel,
    tensor_lists: Sequence[Sequence[Tensor]],
    args: ctypes.Structure,
    pointers: Mapping[str, Tensor | None] | None = None,
) -> tuple:
    """The inputs of ``scaledoptim::multi_tensor_launch`` for :func:`launch_op`'s arguments
    (Note [launch op]), in order; registers ``kernel``.

    Raises:
        TypeError, ValueError: as :func:`launch_op`.
    """
    launcher.check_args(kernel, args)
    int_names, float_names = _field_kinds(kernel.args_type)
    pointers = pointers or {}
    field_names = [name for name, *_ in args._fields_]
    pointer_names = [n for n, field_type, *_ in args._fields_ if field_type is ctypes.c_void_p]
    pointer_fields, pointer_tensors = [], []
    for name, t in pointers.items():
        if name not in pointer_names:
            raise ValueError(
                f"{name!r} is not a pointer field of {kernel.args_type.__name__}; "
                f"pass one of {pointer_names}"
            )
        if t is not None:
            pointer_fields.append(field_names.index(name))
            pointer_tensors.append(t)
    int_args = []
    for name in int_names:
        # A null c_void_p reads as None; a field filled from `pointers` must not make the graph
        # depend on (and guard) the raw value it replaces.
        value = 0 if name in pointers else int(getattr(args, name) or 0)  # c_bool: bool
        # The op's ints are int64: unsigned 64-bit values travel as their two's complement,
        # which ctypes wraps back when the struct is rebuilt.
        int_args.append(value - (1 << 64) if value >= 1 << 63 else value)
    return (
        _register(kernel),
        [t for tensors in tensor_lists for t in tensors],
        [len(tensors) for tensors in tensor_lists],
        int_args,
        [getattr(args, name) for name in float_names],
        pointer_tensors,
        pointer_fields,
    )
