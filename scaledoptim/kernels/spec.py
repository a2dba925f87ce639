"""Description of a multi-tensor kernel: which source, which template, which tensor lists."""

from __future__ import annotations

import ctypes
import functools
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CUDA_TYPE_NAMES", "PER_TENSOR_NAMES", "MultiTensorKernel", "registered_kernels"]

#: The names of the lists that hold one element per tensor of list 0 (the stochastic-rounding
#: seeds, the step counters), unless a kernel gives its ``per_tensor_lists``.
PER_TENSOR_NAMES = ("sr_seeds", "steps")

# The C++ type each torch dtype is instantiated with (cuda/dtypes.cuh).
CUDA_TYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float",
    torch.float16: "so_half",
    torch.bfloat16: "so_bfloat16",
}


@dataclass(frozen=True)
class MultiTensorKernel:
    r"""A ``__global__`` multi-tensor kernel in a ``.cu`` file, as the launcher sees it.

    The kernel's signature must be ``kernel(TensorTable<len(lists)>, Args)`` (see
    ``cuda/multi_tensor_apply.cuh``), templated on the element type of each list in
    ``dtype_lists``, in that order.

    Args:
        source: the ``.cu`` file. It may include the headers of ``cuda/`` and of its own folder.
        name: the kernel (template) name, e.g. ``"adam_kernel"``.
        lists: a name per tensor list, in table order: distinct C identifiers, the one
            declaration of the kernel's layout. Error messages name them, and every compile
            of ``source`` is given the C++ enum they make (:attr:`list_enum`).
        args_type: the ``ctypes.Structure`` mirroring the kernel's ``Args`` struct.
        dtype_lists: indices of lists whose dtype (float32, float16 or bfloat16, may differ
            per tensor) is a template parameter; every other list must be float32.
        per_tensor_lists: indices of lists holding one element per tensor (e.g. step counters)
            rather than one per element of the tensors of list 0; by default, from the names:
            every list but the first named in :data:`PER_TENSOR_NAMES`.
        per_chunk_lists: indices of lists holding one element per chunk of the tensors of list
            0 (``ceil(numel / launch_config.chunk_size)``; e.g. a reduction's per-block
            partial sums, which block ``b`` stores at the chunk number of its chunk); by
            default, from the names: every list but the first whose name ends in ``_partials``.

    Low-bit states (Note [block-wise codes] in fused/lowbit/codes.py) are declared by their
    names too: a list whose name ends in ``_codes`` holds ``uint8`` tensors laid out like those
    of list 0 (:attr:`code_lists`), one ending in ``_scales`` one float32 per block of
    ``block_size`` elements of them (:attr:`block_lists`); such a kernel is launched with a
    ``block_size`` (``prepare_launch``), which its args struct carries in a field of that name,
    and its chunks are whole blocks.

    Raises:
        ValueError: the kernel's name or a list name is not a C identifier, or two names make
            the same enum member (``exp_avg`` and ``expAvg``).

    Example::

        >>> class ScaleArgs(ctypes.Structure):
        ...     _fields_ = [("factor", ctypes.c_float)]
        >>> SCALE = MultiTensorKernel(Path("my_kernels/scale.cu"), "scale_kernel", ("x",),
        ...                           ScaleArgs, dtype_lists=(0,))
    """

    source: Path
    name: str
    lists: tuple[str, ...]
    args_type: type[ctypes.Structure]
    dtype_lists: tuple[int, ...] = ()
    per_tensor_lists: tuple[int, ...] = ()
    per_chunk_lists: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # The layout is declared once, by the names: the indices follow from them, and the enum
        # the source is compiled with (See Note [list enums] in kernels/sources.py).
        names, members = (self.name.rsplit("::", 1)[-1], *self.lists), self._enum_members()
        if not all(_IDENTIFIER.fullmatch(n) for n in names) or len(set(members)) < len(members):
            raise ValueError(
                f"{self.name}: the kernel's name and its list names {self.lists} must be C "
                f"identifiers that make distinct enum members (here {members}); name the lists "
                "in snake_case, each once"
            )
        if not self.per_tensor_lists:
            derived = tuple(i for i, n in enumerate(self.lists) if i and n in PER_TENSOR_NAMES)
            object.__setattr__(self, "per_tensor_lists", derived)
        if not self.per_chunk_lists:
            derived = tuple(i for i, n in enumerate(self.lists) if i and n.endswith("_partials"))
            object.__setattr__(self, "per_chunk_lists", derived)
        # Kernels register themselves: the NVRTC checks, the doctor and the launch op find
        # every kernel that was defined, with no hand-kept list.
        _registry.setdefault(self)

    @functools.cached_property
    def code_lists(self) -> tuple[int, ...]:
        """Indices of the lists of low-bit codes (``uint8``, one per element)."""
        return tuple(i for i, n in enumerate(self.lists) if i and n.endswith("_codes"))

    @functools.cached_property  # read at every launch: computed once
    def block_lists(self) -> tuple[int, ...]:
        """Indices of the lists of low-bit scales (float32, one per block of elements)."""
        return tuple(i for i, n in enumerate(self.lists) if i and n.endswith("_scales"))

    @property
    def n_lists(self) -> int:
        return len(self.lists)

    @property
    def list_enum_name(self) -> str:
        """The name of :attr:`list_enum`: the kernel's name less ``_kernel``, in CamelCase, and
        ``List`` (``AdamList`` for ``adam_kernel``)."""
        return f"{self._enum_prefix()}List"

    @property
    def list_enum(self) -> str:
        """The C++ enum of the lists, made from their names and given to every compile of the
        source: one member per list in table order, then the count that sizes the kernel's
        table. For ``adam_kernel``, ``enum AdamList { kAdamParams, kAdamGrads, ...,
        kAdamSteps, kAdamLists };``."""
        return f"enum {self.list_enum_name} {{ {', '.join(self._enum_members())} }};"

    def _enum_prefix(self) -> str:
        return _camel(self.name.rsplit("::", 1)[-1].removesuffix("_kernel"))

    def _enum_members(self) -> list[str]:
        prefix = self._enum_prefix()
        return [f"k{prefix}{_camel(name)}" for name in (*self.lists, "lists")]

    def instantiation(self, dtypes: tuple[torch.dtype, ...]) -> str:
        """The C++ name expression of the kernel for the template ``dtypes``."""
        if not self.dtype_lists:
            return self.name
        return f"{self.name}<{', '.join(CUDA_TYPE_NAMES[d] for d in dtypes)}>"

    def instantiations(self) -> list[str]:
        """Every instantiation the backends compile: all dtype combinations."""
        combos = itertools.product(CUDA_TYPE_NAMES, repeat=len(self.dtype_lists))
        return [self.instantiation(c) for c in combos]


_registry: dict[MultiTensorKernel, None] = {}  # insertion-ordered set
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _camel(snake: str) -> str:
    """``exp_avg_sqs`` -> ``ExpAvgSqs``."""
    return "".join(part[:1].upper() + part[1:] for part in snake.split("_"))


def registered_kernels() -> tuple[MultiTensorKernel, ...]:
    """Every :class:`MultiTensorKernel` defined in this process so far, in order (scaledoptim's
    own once ``scaledoptim`` is imported)."""
    return tuple(_registry)


def c_symbol(instantiation: str) -> str:
    """The emulator's extern "C" entry of an instantiation, e.g.
    ``so_emulate_adam_kernel_float_so_half``."""
    return "so_emulate_" + re.sub(r"\W+", "_", instantiation).strip("_")
