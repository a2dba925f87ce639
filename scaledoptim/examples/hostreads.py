"""Counts how often the host reads a tensor's value during the optimizer phase of a step.

On a GPU every such read (``.item()``, ``bool(t)``, ``.cpu()``, ...) waits for all queued work
to finish, so a training loop that reads once per step can never run ahead of the GPU. torch.amp's
``GradScaler`` reads ``found_inf`` once per step unless the optimizer is fused; scaledoptim's fused
optimizers skip an overflowed step on the device and read nothing. Counting the reads by wrapping
the ``torch.Tensor`` methods shows that difference on any machine, a CPU included. Each read is
also attributed to the module that made it (``torch.optim.lbfgs``, ``scaledoptim.protocol.replay``,
...), so a table can say whose reads they are.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Iterator

import torch

# Every way Python code reads a tensor's value into a host number or host memory.
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")

#: The modules whose host reads are made only on a CPU, where they wait for nothing: the host
#: skip and the unscale's scale read, both gated by ``scaledoptim.torch_ops.HOST_READS``.
CPU_ONLY_READERS = frozenset({"scaledoptim.torch_ops.skip"})


class HostReads:
    """Counts host reads of tensor values made inside :meth:`counting`.

    ``by_module`` counts them by the module whose code made the read (its ``__name__``).
    Reads of the tensors whose ids are in ``ignore`` are not counted: torch keeps non-fused
    optimizers' ``step`` counters on the host even when training on a GPU, so reading them never
    waits for the device (on a CPU-only machine they would otherwise look like any other read).
    Nor are the reads of CPU tensors made by the modules in :data:`CPU_ONLY_READERS`: scaledoptim
    reads a value there only where its ``HOST_READS`` says a read is free, on a CPU, and never
    on a GPU (Note [host skip] in scaledoptim/torch_ops/skip.py); ``cpu_only`` counts them.
    """

    def __init__(self) -> None:
        self.count = 0
        self.cpu_only = 0
        self.by_module: collections.Counter[str] = collections.Counter()
        self._depth = 0  # a read made by another read (tolist -> item) counts once

    @contextlib.contextmanager
    def counting(self, ignore: frozenset[int] = frozenset()) -> Iterator[None]:
        own = {name: torch.Tensor.__dict__.get(name) for name in READS}
        for name in READS:
            setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name), ignore))
        try:
            yield
        finally:
            for name, original in own.items():
                if original is None:
                    delattr(torch.Tensor, name)  # back to the inherited C implementation
                else:
                    setattr(torch.Tensor, name, original)

    def _counted(self, read, ignore: frozenset[int]):
        def counted(tensor: torch.Tensor, *args, **kwargs):
            if self._depth == 0 and id(tensor) not in ignore:
                module = sys._getframe(1).f_globals.get("__name__", "?")
                if module in CPU_ONLY_READERS and tensor.device.type == "cpu":
                    self.cpu_only += 1
                else:
                    self.count += 1
                    self.by_module[module] += 1
            self._depth += 1
            try:
                return read(tensor, *args, **kwargs)
            finally:
                self._depth -= 1

        return counted


def host_side_counters(opt: torch.optim.Optimizer) -> frozenset[int]:
    """The ids of ``opt``'s ``step`` counters that torch keeps on the host (see
    :class:`HostReads`)."""
    return frozenset(
        id(state["step"])
        for state in opt.state.values()
        if isinstance(state.get("step"), torch.Tensor) and state["step"].device.type == "cpu"
    )
