"""``autocast``: the scaledoptim autocast region, as a context manager and a decorator."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from . import policies
from .regions import enter_region, exit_region, install
from .tensor_tree import cast_floating

if TYPE_CHECKING:
    from typing_extensions import Self

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def _region(
    device_type: str,
    dtype: torch.dtype | None,
    enabled: bool,
    cache_enabled: bool,
    snapshot_version: int | None = None,
) -> Iterator[None]:
    # torch.autocast sets the thread-local state that turns the Autocast key on; the
    # region record tells our kernels this region is ours (Note [telling regions apart]).
    install()
    with torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled):
        enter_region(device_type, snapshot_version)
        try:
            yield
        finally:
            exit_region(device_type)


class autocast:
    """Run a region with autocast, applying scaledoptim's (editable) cast policies.

    Behaves like :class:`torch.autocast` (same thread-local state, nesting, and the same
    results for every op whose policy was not edited, which keep torch's C++ kernels) and
    additionally applies the policies set with :func:`scaledoptim.amp.set_policy`.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        dtype: the lower precision dtype (``torch.float16`` or ``torch.bfloat16``); the
            device's default (``torch.get_autocast_dtype``) when ``None``.
        enabled: ``False`` runs the region without autocast, also inside an enabled one.
        cache_enabled: reuse casts of parameters within the outermost region
            (see :func:`scaledoptim.amp.cache_stats`).
        cast_outputs: decorator only: cast the function's floating outputs to this dtype
            (usually ``torch.float32``) on exit, so low precision tensors do not leak out
            of the region (the "self-cleaning" region).

    Example::

        >>> import torch, scaledoptim.amp as amp
        >>> layer = torch.nn.Linear(4, 4)
        >>> with amp.autocast("cpu", dtype=torch.bfloat16):
        ...     layer(torch.randn(2, 4)).dtype
        torch.bfloat16
        >>> @amp.autocast("cpu", dtype=torch.bfloat16, cast_outputs=torch.float32)
        ... def forward(x):
        ...     return layer(x)
        >>> forward(torch.randn(2, 4)).dtype
        torch.float32
    """

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool = True,
        *,
        cast_outputs: torch.dtype | None = None,
    ) -> None:
        if device_type not in policies.AUTOCAST_DISPATCH_KEYS:
            raise ValueError(
                f"Unsupported device_type {device_type!r}: scaledoptim.amp.autocast supports "
                f"{sorted(policies.AUTOCAST_DISPATCH_KEYS)}"
            )
        self.device_type = device_type
        self.dtype = dtype
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self.cast_outputs = cast_outputs
        self._entered: list[contextlib.AbstractContextManager[None]] = []

    def _new_region(self) -> contextlib.AbstractContextManager[None]:
        return _region(self.device_type, self.dtype, self.enabled, self.cache_enabled)

    def __enter__(self) -> Self:
        if self.cast_outputs is not None:
            raise RuntimeError(
                "autocast(cast_outputs=...) casts a decorated function's outputs; a with "
                "block has no outputs. Decorate a function, or drop cast_outputs and cast "
                "the results after the block"
            )
        region = self._new_region()
        region.__enter__()
        self._entered.append(region)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._entered.pop().__exit__(*exc_info)

    def __call__(self, func: F) -> F:
        if not callable(func):
            raise TypeError(
                f"autocast(...)(func) needs a callable, got {type(func).__name__}; to run a "
                "block with autocast use 'with scaledoptim.amp.autocast(...):'"
            )

        @functools.wraps(func)
        def autocast_wrapper(*args: Any, **kwargs: Any) -> Any:
            # A fresh region per call: a decorated function may run on several threads.
            with self._new_region():
                outputs = func(*args, **kwargs)
            if self.cast_outputs is not None:
                outputs = cast_floating(outputs, self.cast_outputs)
            return outputs

        return autocast_wrapper  # type: ignore[return-value]
