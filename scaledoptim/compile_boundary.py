"""The compile boundary without importing dynamo (Note [lazy compile boundary]).

Note [lazy compile boundary]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.compiler.disable`` and ``torch.compiler.assume_constant_result`` import ``torch._dynamo``
(and with it sympy, the fx symbolic shapes and inductor's config) when they decorate, which doubled
the time of ``import scaledoptim``. Nothing can trace a function before dynamo is imported
(``torch.compile`` imports it), so the decorators here only set the attributes dynamo reads when it
meets the function while tracing, and defer the rest:

- :func:`disable` marks its wrapper as disabled (dynamo reads ``_torchdynamo_disable`` with
  ``inspect.getattr_static`` and graph-breaks around the call, as for ``torch.compiler.disable``)
  and, once ``torch._dynamo`` is in ``sys.modules``, calls through the real
  ``torch._dynamo.disable`` wrapper, which turns dynamo's frame callback off for the call and
  everything it calls. Before that the wrapper calls the function directly: no frame callback
  can be set while dynamo is not loaded. The wrappers share one code object, which is marked
  skipped (``skip_code``) when the first of them resolves, so dynamo never traces the wrapper
  itself.
- :func:`assume_constant_result` sets ``_dynamo_marked_constant``, which is all that
  ``torch._dynamo.assume_constant_result`` does.

``tests/test_import_time.py`` checks that ``import scaledoptim`` leaves ``torch._dynamo`` out;
the compile tests check that the boundary still holds under ``torch.compile``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["assume_constant_result", "disable", "dynamo_loaded"]

F = TypeVar("F", bound=Callable[..., Any])
_DYNAMO = "torch._dynamo"
_skipped: list[bool] = []


def dynamo_loaded() -> bool:
    """Whether ``torch._dynamo`` was imported (by ``torch.compile`` or anyone)."""
    return _DYNAMO in sys.modules


def _resolve(fn: Callable[..., Any], code: Any) -> Callable[..., Any]:
    import torch._dynamo
    from torch._dynamo.eval_frame import skip_code

    if not _skipped:
        skip_code(code)
        _skipped.append(True)
    return torch._dynamo.disable(fn)


def disable(fn: F) -> F:
    """``torch.compiler.disable(fn)`` (recursive), without importing dynamo until it is loaded."""
    resolved: Callable[..., Any] | None = None

    def boundary(*args: Any, **kwargs: Any) -> Any:
        nonlocal resolved
        if resolved is None:
            if _DYNAMO not in sys.modules:
                return fn(*args, **kwargs)
            resolved = _resolve(fn, boundary.__code__)
        return resolved(*args, **kwargs)

    # The attributes torch._dynamo.disable sets on its wrapper (eval_frame.DisableContext).
    wrapper: Any = functools.update_wrapper(boundary, fn)
    wrapper._torchdynamo_disable = True
    wrapper._torchdynamo_disable_msg = None
    wrapper._torchdynamo_disable_recursive = True
    wrapper._torchdynamo_orig_callable = fn
    wrapper._torchdynamo_wrapper_id = id(boundary)
    return boundary  # type: ignore[return-value]


def assume_constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)`` without importing dynamo: the marker it
    sets."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn
