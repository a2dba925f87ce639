"""The multi-tensor launcher: tensor lists in, one or more prepared kernel launches out (the
public entry, :func:`~scaledoptim.kernels.launch`, is in ``dispatch.py``).

A launch is prepared (validated, its argument tables built and cached) before anything runs, so
an optimizer can validate every launch of a step before the first one changes a tensor.
"""

from __future__ import annotations

import ctypes
import dataclasses
import operator
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import cuda_backend, emulator
from .config import launch_config
from .spec import CUDA_TYPE_NAMES, MultiTensorKernel
from .table import PlannedLaunch, plan_launches

__all__ = [
    "PLAIN_TENSOR_TYPES", "PreparedLaunch", "check_launchable", "chunk_count", "prepare_launch",
    "scalar_pointer",
]

# Tables are rebuilt only when a tensor set's data pointers (or sizes, dtypes, chunk size)
# change; an optimizer reuses the same few sets every step.
_PLAN_CACHE_SIZE = 64
_plans: OrderedDict[tuple, list[tuple[str, PlannedLaunch]]] = OrderedDict()


@dataclass(frozen=True)
class PreparedLaunch:
    """A validated launch of ``kernel`` over fixed tensor lists; :meth:`run` enqueues it."""

    kernel: MultiTensorKernel
    device: torch.device
    plans: tuple[tuple[str, PlannedLaunch], ...]
    #: Whether the tables are this launch's own (see :meth:`detached`), not shared through the
    #: cache of :func:`prepare_launch`, so that :meth:`repoint` may rewrite them.
    owns_tables: bool = False
    #: The block size its lists of low-bit scales were validated for (``kernel.block_lists``).
    block_size: int | None = None
    #: Per list :meth:`repoint` rewrote: each table's slots of that list, and what picks their
    #: tensors' pointers from the list's.
    _rows: dict[int, list[tuple[ctypes.Array, Callable[[Sequence[int]], Any]]]] = (
        dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    )

    def detached(self) -> PreparedLaunch:
        """The same launch with tables of its own, for :meth:`repoint`."""
        plans = tuple(
            (
                instantiation,
                dataclasses.replace(
                    planned, table=type(planned.table).from_buffer_copy(planned.table)
                ),
            )
            for instantiation, planned in self.plans
        )
        return PreparedLaunch(
            self.kernel, self.device, plans, owns_tables=True, block_size=self.block_size
        )

    def repoint(self, list_index: int, pointers: Sequence[int]) -> None:
        """Moves list ``list_index`` to new storage: ``pointers[i]`` becomes the data pointer of
        its tensor ``i``, in place, without revalidating.

        The caller guarantees that the new tensors have the sizes, dtypes, strides and device
        that were validated (only where their data lives changed): an optimizer repoints its
        grads when ``zero_grad(set_to_none=True)`` reallocated them. Only on a
        :meth:`detached` launch.
        """
        if not self.owns_tables:
            raise RuntimeError("repoint() rewrites tables: call it on launch.detached()")
        rows = self._rows.get(list_index)
        if rows is None:  # once per list: a repoint runs at every step of a kept plan
            rows = self._rows[list_index] = [
                (planned.table.ptrs[list_index], _picker(planned.slot_tensors))
                for _, planned in self.plans
            ]
        picks = [pick(pointers) for _, pick in rows]
        # See Note [launchable tensors]: an empty tensor, the one kind with a null pointer, gets no
        # slot. All checked before any table changes.
        if 0 in pointers and any(0 in picked for picked in picks):
            raise ValueError(
                f"{self.kernel.name}: repoint() got a null data pointer for a tensor with "
                "elements (a tensor subclass, or one without storage); nothing was changed"
            )
        for (slots, _), picked in zip(rows, picks):
            slots[: len(picked)] = picked

    def run(self, args: ctypes.Structure, later_args: ctypes.Structure | None = None) -> None:
        """Launches with scalar arguments ``args`` (an instance of ``kernel.args_type``), or
        ``later_args`` for every launch but the first when the tensors need several tables
        (for work that must happen once, e.g. moving the loss scale).

        CUDA launches are asynchronous on torch's current stream; emulated ones return when done.
        """
        for given in (args, later_args):
            if given is not None:
                check_args(self.kernel, given)
                block_size = getattr(given, "block_size", None)
                if self.kernel.block_lists and block_size != self.block_size:
                    raise ValueError(
                        f"{self.kernel.name}: args.block_size is {block_size} but the launch "
                        f"was prepared for blocks of {self.block_size}; nothing was launched"
                    )
        for index, (instantiation, planned) in enumerate(self.plans):
            this = args if index == 0 or later_args is None else later_args
            params = (ctypes.c_void_p * 2)(ctypes.addressof(planned.table), ctypes.addressof(this))
            if self.device.type == "cuda":
                cuda_backend.launch(
                    self.kernel, instantiation, params, planned.n_chunks,
                    launch_config.threads_per_block, self.device,
                )
            else:
                emulator.launch(
                    self.kernel, instantiation, params, planned.n_chunks,
                    launch_config.emulator_threads_per_block,
                )


def _picker(slots: tuple[int, ...]) -> Callable[[Sequence[int]], Any]:
    """What picks the pointers of a table's tensors (indices ``slots``) from a list's: a slice
    where they are consecutive (one dtype: every table but those a tensor spans)."""
    if slots == tuple(range(slots[0], slots[-1] + 1)):
        return operator.itemgetter(slice(slots[0], slots[-1] + 1))
    return operator.itemgetter(*slots)


def prepare_launch(
    kernel: MultiTensorKernel,
    tensor_lists: Sequence[Sequence[Tensor]],
    *,
    block_size: int | None = None,
) -> PreparedLaunch:
    r"""Validates ``tensor_lists`` for ``kernel`` and builds (or reuses) its argument tables.

    Args:
        kernel: the kernel to run.
        tensor_lists: ``kernel.n_lists`` lists, each empty (the kernel gets null pointers and
            must not read that list) or as long as the first. All tensors are dense, on one
            device, and tensor ``i`` of every list has the strides of ``tensor_lists[0][i]``
            and its element count, except in ``kernel.per_tensor_lists`` (one element each),
            ``kernel.per_chunk_lists`` (one element per chunk of ``tensor_lists[0][i]``) and
            ``kernel.block_lists`` (one per block of ``block_size`` of its elements).
        block_size: the block size of a kernel with ``block_lists`` (low-bit scales): its
            chunks are then the largest multiple of it not above ``launch_config.chunk_size``
            (or one block), so that no block spans two chunks.

    Raises:
        ValueError, TypeError: naming the offending list and tensor; nothing is launched.
    """
    if len(tensor_lists) != kernel.n_lists:
        raise ValueError(
            f"{kernel.name} takes {kernel.n_lists} tensor lists {kernel.lists}, "
            f"got {len(tensor_lists)}"
        )
    if bool(kernel.block_lists) != (block_size is not None):
        raise ValueError(
            f"{kernel.name} takes a block_size if and only if it has lists of block scales "
            f"(names ending in _scales): got block_size={block_size!r}"
        )
    if block_size is not None and not (
        isinstance(block_size, int) and not isinstance(block_size, bool) and block_size > 0
    ):
        raise ValueError(f"{kernel.name}: block_size must be a positive int, got {block_size!r}")
    first = tensor_lists[0]
    device = first[0].device if first else torch.device("cpu")
    plans = _planned_launches(kernel, tensor_lists, block_size) if first else []
    return PreparedLaunch(kernel, device, tuple(plans), block_size=block_size)


def check_args(kernel: MultiTensorKernel, args: object) -> None:
    """Raises ``TypeError`` unless ``args`` is an instance of ``kernel.args_type``."""
    if not isinstance(args, kernel.args_type):
        raise TypeError(
            f"{kernel.name} takes args of type {kernel.args_type.__name__}, "
            f"got {type(args).__name__}"
        )


def scalar_pointer(t: Tensor | None, name: str, device: torch.device) -> int | None:
    """The data pointer of a one-element float32 scalar on ``device`` (``None`` stays null)."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a 0-dim float32 tensor, got {type(t).__name__}")
    if t.dtype != torch.float32 or t.numel() != 1 or t.device != device:
        raise ValueError(
            f"{name} must be a one-element float32 tensor on {device}, got {t.dtype} of "
            f"shape {tuple(t.shape)} on {t.device}"
        )
    return t.data_ptr()


# Note [launchable tensors]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A kernel gets raw data pointers, so it may only see tensors whose data pointer is the address
# of their elements: plain strided tensors (or Parameters of them) with real storage on the CPU
# or a CUDA device. A tensor subclass does not qualify whatever its data_ptr() says: a DTensor
# reports 0 (its elements live in its local tensor), a FakeTensor or a functional tensor has no
# storage of its own, a __torch_dispatch__ wrapper's pointer is not its elements'. The fused
# optimizers route such params to torch's ops (fused/plan.py), or hand our kernels a DTensor's
# local tensor, a plain one (Note [DTensor steps on our kernels] in fused/sharded.py); whatever
# still reaches a launch is refused here, before a pointer is read. `check_launchable` is the
# one gate: every table is built by `_planned_launches`, which calls it first, and
# `PreparedLaunch.repoint`, the only other writer of pointers, refuses a null one.
#: The tensor types whose data pointer is their elements' address (Note [launchable tensors]).
PLAIN_TENSOR_TYPES = frozenset((Tensor, torch.nn.Parameter))


def check_launchable(kernel: MultiTensorKernel, tensor_lists: Sequence[Sequence[Tensor]]) -> None:
    """Raises unless every tensor of ``tensor_lists`` may be handed to ``kernel`` as a data
    pointer (Note [launchable tensors]): a plain tensor, not a subclass, on the CPU or a CUDA
    device, with storage of its own (a non-null data pointer unless it is empty).

    Raises:
        TypeError: naming the list, the index and the tensor's type; nothing is launched.
    """
    for list_name, tensors in zip(kernel.lists, tensor_lists):
        for i, t in enumerate(tensors):
            where = f"{kernel.name}: {list_name}[{i}]"
            if type(t) not in PLAIN_TENSOR_TYPES:
                raise TypeError(
                    f"{where} is a {type(t).__module__}.{type(t).__qualname__}, not a plain "
                    "torch.Tensor; kernels read raw data pointers, so pass plain tensors (for a "
                    "DTensor, its .to_local()), or use torch's ops (SCALEDOPTIM_KERNELS=torch)"
                )
            if t.device.type not in ("cpu", "cuda") or torch._is_functional_tensor(t):
                raise TypeError(
                    f"{where} has no storage a kernel can read (a {t.device.type} "
                    f"{'functional ' if t.device.type in ('cpu', 'cuda') else ''}tensor); "
                    "kernels run on CUDA tensors, and on CPU tensors through the emulator"
                )
            if t.numel() and not t.data_ptr():
                raise TypeError(
                    f"{where} has a null data pointer with {t.numel()} elements; kernels need "
                    "tensors with storage of their own"
                )


def _launch_chunk_size(block_size: int | None) -> int:
    """The chunk size of a launch: ``launch_config.chunk_size``, or whole blocks."""
    chunk_size = launch_config.chunk_size
    if block_size is None:
        return chunk_size
    return max(1, chunk_size // block_size) * block_size


def _planned_launches(
    kernel: MultiTensorKernel, tensor_lists: Sequence[Sequence[Tensor]], block_size: int | None
) -> list[tuple[str, PlannedLaunch]]:
    check_launchable(kernel, tensor_lists)
    first = tensor_lists[0]
    chunk_size = _launch_chunk_size(block_size)
    key = (
        kernel,
        chunk_size,
        block_size,
        # Per list: flattened, the same tensors with another list left empty would share a key
        # (the caching allocator hands the next optimizer's state the addresses just freed).
        tuple(tuple(t.data_ptr() for t in tensors) for tensors in tensor_lists),
        tuple(t.numel() for t in first),
        tuple(t.stride() for t in first),
        tuple(
            tensor_lists[i][j].dtype
            for i in kernel.dtype_lists
            if tensor_lists[i]
            for j in range(len(first))
        ),
    )
    plans = _plans.get(key)
    if plans is None:
        launch_config.validate()
        _validate(kernel, tensor_lists, block_size)
        plans = _build_plans(kernel, tensor_lists, chunk_size)
        _plans[key] = plans
        if len(_plans) > _PLAN_CACHE_SIZE:
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    return plans


def _build_plans(
    kernel: MultiTensorKernel, tensor_lists: Sequence[Sequence[Tensor]], chunk_size: int
) -> list[tuple[str, PlannedLaunch]]:
    groups: dict[tuple[torch.dtype, ...], list[int]] = {}
    for i in range(len(tensor_lists[0])):
        dtypes = tuple(tensor_lists[j][i].dtype for j in kernel.dtype_lists)
        groups.setdefault(dtypes, []).append(i)
    plans = []
    for dtypes, indices in groups.items():
        pointers = [
            [tensors[i].data_ptr() if tensors else 0 for tensors in tensor_lists] for i in indices
        ]
        sizes = [tensor_lists[0][i].numel() for i in indices]
        for planned in plan_launches(pointers, sizes, kernel.n_lists, chunk_size):
            in_lists = tuple(indices[slot] for slot in planned.slot_tensors)
            plans.append(
                (kernel.instantiation(dtypes), dataclasses.replace(planned, slot_tensors=in_lists))
            )
    return plans


def _validate(
    kernel: MultiTensorKernel, tensor_lists: Sequence[Sequence[Tensor]], block_size: int | None
) -> None:
    first = tensor_lists[0]
    device = first[0].device
    if device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"{kernel.name} runs on CUDA tensors (CPU tensors through the emulator), got {device}"
        )
    for list_index, (list_name, tensors) in enumerate(zip(kernel.lists, tensor_lists)):
        if tensors and len(tensors) != len(first):
            raise ValueError(
                f"{kernel.name}: {list_name} has {len(tensors)} tensors but {kernel.lists[0]} has "
                f"{len(first)}; pass one tensor per tensor of {kernel.lists[0]}, or an empty list"
            )
        allowed: Collection[torch.dtype] = (
            CUDA_TYPE_NAMES if list_index in kernel.dtype_lists
            else (torch.uint8,) if list_index in kernel.code_lists
            else (torch.float32,)
        )
        per_tensor = list_index in kernel.per_tensor_lists
        per_chunk = list_index in kernel.per_chunk_lists
        per_block = list_index in kernel.block_lists
        for i, t in enumerate(tensors):
            where = f"{kernel.name}: {list_name}[{i}]"
            if t.device != device:
                raise ValueError(
                    f"{where} is on {t.device} but {kernel.lists[0]}[0] is on {device}"
                )
            if t.dtype not in allowed:
                raise TypeError(f"{where} has dtype {t.dtype}; expected one of {list(allowed)}")
            if not is_dense(t) or (
                not (per_tensor or per_chunk or per_block) and t.stride() != first[i].stride()
            ):
                raise ValueError(
                    f"{where} is not dense with the layout of {kernel.lists[0]}[{i}]; kernels "
                    "walk storage flat, so pass tensors that cover their storage with the "
                    "same strides (e.g. all .contiguous(), or all channels_last)"
                )
            expected = first[i].numel()
            if per_tensor:
                expected = 1
            elif per_chunk:
                expected = chunk_count(expected)
            elif per_block:
                assert block_size is not None  # prepare_launch checked it
                expected = -(-expected // block_size)
            if t.numel() != expected:
                raise ValueError(f"{where} has {t.numel()} elements, expected {expected}")


def chunk_count(numel: int) -> int:
    """The chunks a tensor of ``numel`` elements is split into (``launch_config.chunk_size``
    each): the length of its tensors in a kernel's ``per_chunk_lists``."""
    return -(-numel // launch_config.chunk_size)


def is_dense(t: Tensor) -> bool:
    """Whether ``t`` covers its storage span exactly, with no gaps or overlaps (any dimension
    order: contiguous, channels_last, transposed), so that an elementwise kernel may walk it as a
    flat array from ``data_ptr`` -- provided every tensor it is paired with has its strides."""
    if t.layout != torch.strided:
        return False
    if t.is_contiguous() or t.numel() == 0:  # the common case, without the Python below
        return True
    expected = 1
    for size, stride in sorted(
        ((size, stride) for size, stride in zip(t.shape, t.stride()) if size != 1),
        key=lambda dim: dim[1],
    ):
        if stride != expected:
            return False
        expected *= size
    return True
