"""Edit the autocast policy of an op: registration of kernels with ``torch.library``.

Note [fast path]: an op whose policy equals torch's keeps torch's C++ Autocast kernel (or
falls through, at no cost, when torch has none). Only an edited op gets a Python kernel,
held by its own ``torch.library.Library`` so that destroying that library restores torch's
kernel for exactly that op and device.
"""

from __future__ import annotations

import threading
import warnings

import torch
from torch._ops import OpOverload

from . import policies
from .kernels import make_autocast_kernel
from .op_names import OpLike, dispatcher_name, resolve_overloads

_lock = threading.Lock()
# (dispatcher name, device type) -> the library holding our kernel and the edited policy.
_edits: dict[tuple[str, str], tuple[torch.library.Library, str | None]] = {}


def _check_device_type(device_type: str) -> None:
    if device_type not in policies.AUTOCAST_DISPATCH_KEYS:
        raise ValueError(
            f"Unsupported device_type {device_type!r}: scaledoptim.amp supports "
            f"{sorted(policies.AUTOCAST_DISPATCH_KEYS)}"
        )


def _check_policy(policy: str | None) -> None:
    if policy is not None and policy not in policies.POLICY_NAMES:
        raise ValueError(
            f"Unknown policy {policy!r}: expected one of {list(policies.POLICY_NAMES)}, or None "
            "to let the op fall through autocast"
        )


def _unregister(key: tuple[str, str]) -> None:
    edit = _edits.pop(key, None)
    if edit is not None:
        edit[0]._destroy()


def _register(op: OpOverload, device_type: str, kernel) -> torch.library.Library:
    namespace, _, name = dispatcher_name(op).partition("::")
    library = torch.library.Library(namespace, "IMPL")
    with warnings.catch_warnings():
        # Replacing torch's C++ Autocast kernel is the point; torch warns about it.
        warnings.filterwarnings("ignore", message="(?s).*previously registered kernel")
        library.impl(name, kernel, policies.AUTOCAST_DISPATCH_KEYS[device_type])
    return library


def set_policy(op: OpLike, policy: str | None, device_type: str) -> None:
    """Set the autocast policy of ``op`` inside ``scaledoptim.amp.autocast`` regions.

    Plain ``torch.autocast`` regions keep torch's behaviour for the op. Setting an op back
    to torch's default policy removes scaledoptim's kernel, so torch's C++ kernel runs again.

    Args:
        op: an op overload (``torch.ops.aten.softmax.int``), a packet
            (``torch.ops.aten.softmax``: its default overload, or all its functional
            overloads when it has no default one) or the same as a qualified name
            (``"aten::softmax"``, ``"aten::softmax.int"``). Custom ops defined with
            ``torch.library`` are accepted like aten ops.
        policy: one of ``"lower_precision_fp"``, ``"fp32"``, ``"promote"``,
            ``"fp32_set_opt_dtype"``, ``"fp32_append_dtype"``, or ``None`` for no casting.
        device_type: ``"cpu"`` or ``"cuda"``.

    Raises:
        ValueError: unknown op, policy or device type, or a policy the op's schema cannot
            take (``fp32_set_opt_dtype`` without a ``dtype`` argument, ``fp32_append_dtype``
            without a ``dtype`` overload).

    Example::

        >>> import torch, scaledoptim.amp as amp
        >>> amp.set_policy(torch.ops.aten.softmax, "lower_precision_fp", "cpu")
        >>> with amp.autocast("cpu", dtype=torch.bfloat16):
        ...     torch.softmax(torch.randn(2, 3), dim=-1).dtype
        torch.bfloat16
        >>> amp.reset_policy()
    """
    _check_device_type(device_type)
    _check_policy(policy)
    overloads = resolve_overloads(op)
    # Build every kernel before registering any, so a schema error changes nothing.
    kernels = [
        (overload, make_autocast_kernel(overload, device_type, policy))
        for overload in overloads
        if policy != policies.default_policy(dispatcher_name(overload), device_type)
    ]
    with _lock:
        for overload in overloads:
            _unregister((dispatcher_name(overload), device_type))
        for overload, kernel in kernels:
            library = _register(overload, device_type, kernel)
            _edits[(dispatcher_name(overload), device_type)] = (library, policy)


def get_policy(op: OpLike, device_type: str) -> str | None:
    """Return the policy ``op`` gets inside ``scaledoptim.amp.autocast`` regions.

    Args:
        op: as for :func:`set_policy`.
        device_type: ``"cpu"`` or ``"cuda"``.

    Returns:
        The policy name, or ``None`` when the op falls through autocast.

    Raises:
        ValueError: ``op`` names several overloads whose policies differ (name one).
    """
    _check_device_type(device_type)
    found = {}
    for overload in resolve_overloads(op):
        name = dispatcher_name(overload)
        edit = _edits.get((name, device_type))
        found[name] = edit[1] if edit is not None else policies.default_policy(name, device_type)
    if len(set(found.values())) > 1:
        raise ValueError(
            f"The overloads of {op} have different policies on {device_type}: {found}; "
            "pass one overload, e.g. torch.ops.aten.softmax.int"
        )
    return next(iter(found.values()))


def reset_policy(op: OpLike | None = None, device_type: str | None = None) -> None:
    """Restore torch's default policy (and torch's kernels) for edited ops.

    Args:
        op: the op to reset, as for :func:`set_policy`; ``None`` resets every op.
        device_type: the device type to reset; ``None`` resets every device type.
    """
    if device_type is not None:
        _check_device_type(device_type)
    names = None if op is None else {dispatcher_name(o) for o in resolve_overloads(op)}
    with _lock:
        for key in list(_edits):
            if (names is None or key[0] in names) and device_type in (None, key[1]):
                _unregister(key)


def edited_policies() -> dict[tuple[str, str], str | None]:
    """Return ``{(dispatcher name, device type): policy}`` for every edited op."""
    return {key: edit[1] for key, edit in _edits.items()}
