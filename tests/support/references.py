"""A row's reference, and the tolerances results are held to.

The reference of a row is ``torch.optim``'s class of the same math, or, where torch has none
(Lion, LAMB), the optimizer's own torch form run in float64 (``OptimInfo.reference_for``): the
math is written once, in the optimizer's file. Either runs on CPU copies of the params, upcast
from their storage, so a 16-bit param is held to the reference's result rounded once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from scaledoptim.testing.optim_db import Config, OptimInfo

__all__ = [
    "InFloat64",
    "assert_param_close",
    "assert_state_close",
    "assert_within_one_ulp",
    "reference_optimizer",
    "reference_step",
    "torch_ops",
    "ulp_distance",
]


@contextlib.contextmanager
def kernels_mode(mode: str) -> Iterator[None]:
    """``SCALEDOPTIM_KERNELS=mode`` inside, as it was after (a spawned process has no
    monkeypatch)."""
    saved = os.environ.get("SCALEDOPTIM_KERNELS")
    os.environ["SCALEDOPTIM_KERNELS"] = mode
    try:
        yield
    finally:
        if saved is None:
            del os.environ["SCALEDOPTIM_KERNELS"]
        else:
            os.environ["SCALEDOPTIM_KERNELS"] = saved


def torch_ops() -> contextlib.AbstractContextManager[None]:
    """``SCALEDOPTIM_KERNELS=torch`` inside: an optimizer's torch form runs on torch's ops (our
    kernels take no float64 params, and an update that reduces over every grad, LAMB's, runs on
    one backend)."""
    return kernels_mode("torch")


def reference_step(
    info: OptimInfo,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    states: Sequence[dict[str, Any]],
    config: Config | None = None,
    *,
    dtype: torch.dtype | None = None,
    **changes: Any,
) -> tuple[list[Tensor], list[dict[str, Any]]]:
    """One step of the row's reference from ``states`` (per param, as our optimizer holds them:
    state names and a ``step`` counter; a param whose counter is 0 starts without state, as torch
    creates it at its first step), on CPU copies of ``params`` in float32 (a torch.optim class)
    or float64 (the row's own torch form), or in ``dtype`` when given, with the unscaled
    ``grads``.

    Returns the new params and each param's new state, in the reference's dtype.
    """
    dtype = dtype or info.reference_dtype or torch.float32
    copies = [torch.nn.Parameter(p.detach().to("cpu", dtype, copy=True)) for p in params]
    with torch_ops():
        reference = info.reference_for(copies, config, **changes)
        for copy, state in zip(copies, states):
            if state and float(state["step"]) != 0:
                reference.state[copy] = {
                    key: _as_reference_state(key, value, dtype) for key, value in state.items()
                }
        for copy, grad in zip(copies, grads):
            copy.grad = grad.detach().to("cpu", dtype, copy=True)
        reference.step()
    return [c.detach() for c in copies], [reference.state[c] for c in copies]


def _as_reference_state(key: str, value: Any, dtype: torch.dtype) -> Any:
    if not isinstance(value, Tensor):
        return value
    if key == "step" or not value.is_floating_point():
        return value.detach().to("cpu", copy=True)
    return value.detach().to("cpu", dtype, copy=True)


class InFloat64(torch.optim.Optimizer):
    """The row's own torch form (``reference_for``) stepping float64 copies of ``params``: each
    step starts from the params as they are, and writes them back rounded; the state stays
    float64. The reference of a row without a torch.optim class, for tests that step models (it
    is a torch.optim.Optimizer, so GradScaler drives it as it drives torch's own)."""

    def __init__(
        self,
        info: OptimInfo,
        params: Iterable[Tensor],
        config: Config | None = None,
        **changes: Any,
    ) -> None:
        super().__init__(list(params), {})
        self.copies = [
            torch.nn.Parameter(p.detach().to(torch.float64, copy=True)) for p in self._params()
        ]
        self.inner = info.reference_for(self.copies, config, **changes)

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        for param, copy in zip(params, self.copies):
            copy.copy_(param)
            copy.grad = None if param.grad is None else param.grad.to(torch.float64)
        with torch_ops():
            self.inner.step()
        for param, copy in zip(params, self.copies):
            if param.grad is not None:
                param.copy_(copy)
        return loss


def reference_optimizer(
    info: OptimInfo, params: Iterable[Tensor], config: Config | None = None, **changes: Any
) -> torch.optim.Optimizer:
    """The row's reference stepping ``params`` themselves: the torch.optim class, or
    :class:`InFloat64`."""
    if info.reference is not None:
        return info.reference(params, **{**(config or info.default).kwargs, **changes})
    return InFloat64(info, params, config, **changes)


def ulp_distance(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise distance in units in the last place between two 16-bit float tensors."""

    def ordered(t: Tensor) -> Tensor:
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -32768 - bits, bits)  # sign-magnitude -> monotonic integers

    return (ordered(a) - ordered(b)).abs()


def assert_param_close(
    actual: Tensor,
    expected: Tensor,
    rtol: float = 1e-6,
    atol: float = 1e-6,
    also: Tensor | None = None,
) -> None:
    """fp32: ``rtol``/``atol``; 16-bit: within one ulp of the reference's result (in fp32)
    rounded once. With ``also`` (another result of the same math), each element may match
    either (see Note [fp32 and fp64 references] in tests/support/launches.py)."""
    candidates = [c.float() for c in (expected, also) if c is not None]
    if actual.dtype == torch.float32:
        close = torch.stack([torch.isclose(actual, c, rtol, atol) for c in candidates]).any(0)
        if not close.all():
            worst = int((actual - candidates[0]).abs().masked_fill(close, 0).argmax())
            raise AssertionError(
                f"fp32 param element {worst}: {actual.view(-1)[worst].item()!r} vs "
                f"{[c.view(-1)[worst].item() for c in candidates]} (rtol {rtol}, atol {atol})"
            )
    else:
        distances = [ulp_distance(actual, c.to(actual.dtype)) for c in candidates]
        distance = torch.stack(distances).amin(0) if actual.numel() else actual
        assert distance.numel() == 0 or distance.max().item() <= 1, (
            f"{actual.dtype} param element {int(distance.argmax())} off by "
            f"{distance.max().item()} ulp: {actual} vs {candidates[0].to(actual.dtype)}"
        )


def assert_state_close(
    actual: Tensor, expected: Tensor, rtol: float = 1e-6, atol: float = 1e-7
) -> None:
    """fp32 state: 1e-6 relative, plus 1e-7 absolute for values that cancel to near zero
    (torch's vectorised CPU lerp uses FMA, the emulator does not; gradients are O(1))."""
    torch.testing.assert_close(actual, expected.float(), rtol=rtol, atol=atol)


def assert_within_one_ulp(actual: Tensor, expected: Tensor) -> None:
    """16-bit: one ulp of the dtype. fp32: 1e-6 relative, where an element that cancels down to
    a small value is held to 1e-6 of the tensor's largest magnitude (kernels may fuse the
    multiply-adds that torch rounds separately)."""
    info = torch.finfo(actual.dtype)
    if actual.dtype == torch.float32:
        rtol, atol = 1e-6, 1e-6 * expected.abs().max().item()
    else:
        rtol, atol = info.eps, info.tiny
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)
