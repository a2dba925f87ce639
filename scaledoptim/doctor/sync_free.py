"""The no-closure ``unscale_and_step`` of every fused optimizer never syncs with the host.

On a GPU, torch's sync debug mode raises on any synchronizing op; on every device, the methods
that read a tensor on the host are patched to raise while the step runs. Each optimizer takes
clean steps and a step with an inf grad, on the device's default backend and, on a CPU, on our
kernels through the emulator too.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from ..fused.backends.torch_native import decide_skips_on_device
from .optimizers import OPTIMIZERS, ours
from .outcome import Outcome, backend_label, kernels_env

__all__ = ["HOST_READS", "no_host_reads", "run"]

#: The Tensor methods that copy values to the host.
HOST_READS = (
    "item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy", "nonzero",
)


class HostRead(RuntimeError):
    """A tensor was read on the host where no read may happen."""


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Inside the block, every method of :data:`HOST_READS` raises :class:`HostRead`, and the
    torch forms skip on device on a CPU too: there a host read is free, and they read found_inf
    (Note [host skip] in torch_ops/skip.py); this checks the form every other device runs.
    ``torch.Tensor`` is left exactly as it was: a method it inherits from ``TensorBase`` is
    deleted again, not pinned on it."""

    def refuse(name: str):
        def method(*args, **kwargs):
            raise HostRead(f"host read: Tensor.{name}() called")

        return method

    own = {name: vars(torch.Tensor)[name] for name in HOST_READS if name in vars(torch.Tensor)}
    with decide_skips_on_device():
        try:
            for name in HOST_READS:
                setattr(torch.Tensor, name, refuse(name))
            yield
        finally:
            for name in HOST_READS:
                if name in own:
                    setattr(torch.Tensor, name, own[name])
                else:
                    delattr(torch.Tensor, name)


@contextlib.contextmanager
def _sync_debug_error(device: torch.device) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def run(device: torch.device) -> Outcome:
    """Fails naming the optimizer, the backend and the read when a step reads the host."""
    modes = (None,) if device.type == "cuda" else (None, "emulate")
    checked = []
    for mode in modes:
        with kernels_env(mode):
            backend = backend_label(device)
            for row in OPTIMIZERS:
                problem = _steps_without_sync(functools.partial(ours, row), device)
                if problem is not None:
                    return Outcome(False, f"{row.name} on the {backend}: {problem}")
            checked.append(backend)
    what = "torch.cuda sync debug mode 'error' and " if device.type == "cuda" else ""
    return Outcome(
        True,
        f"{len(OPTIMIZERS)} optimizers x {' + '.join(checked)}, clean and inf steps; "
        f"{what}host reads patched to raise",
    )


def _steps_without_sync(make, device: torch.device) -> str | None:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=generator).to(device)) for n in (3, 40)]
    opt = make(params)
    scale = opt.scale
    for step in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(device) * 1024
        if step == 2:
            params[0].grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]  # set above
        if step == 0:  # the first step creates state and compiles kernels: outside the watch
            opt.unscale_and_step(grads_scaled_by=scale)
            continue
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        try:
            with _sync_debug_error(device), no_host_reads():
                _, found_inf, scale = opt.unscale_and_step(grads_scaled_by=scale)
        except RuntimeError as error:  # HostRead, or torch refusing a sync
            return f"step {step + 1}: {type(error).__name__}: {error}"
        if found_inf.item() != float(step == 2):
            return f"step {step + 1}: found_inf is {found_inf.item()}, expected {float(step == 2)}"
    return None
