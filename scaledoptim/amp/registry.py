"""Edit the autocast policy of an op: kernels registered once, policies swapped in a table.

Note [policy slots]
~~~~~~~~~~~~~~~~~~~
The first edit of an op on a device type registers scaledoptim's
Python kernel for it with ``torch.library``; that kernel stays registered for the life of
the process and reads the op's ``PolicySlot`` on every call. ``set_policy`` and
``reset_policy`` only replace the slot's edit, so they are safe while other threads are
running the op. Removing a kernel (``Library._destroy``) is not: torch's dispatcher frees
a deregistered Python kernel while other threads may still be executing it, and the
process crashes. An op reset to torch's default keeps the kernel, which then calls torch's
own Autocast kernel (or falls through) at the cost of one Python call; an op never edited
keeps torch's C++ kernel untouched. The registration itself (first edit only) is torch's:
the dispatcher replaces the table entry and keeps the previous kernel alive, so a call
already in flight finishes on torch's kernel.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch
from torch._ops import OpOverload

from . import edits, policies
from .cast_kernels import make_autocast_kernel, make_preparer
from .edits import PolicySlot
from .op_names import OpLike, dispatcher_name, resolve_overloads

_lock = threading.Lock()
# (dispatcher name, device type) -> the slot its installed kernel reads. Never shrinks.
_slots: dict[tuple[str, str], PolicySlot] = {}
# The libraries holding installed kernels: a Library that is garbage collected or
# destroyed unregisters its kernel, which must never happen (Note [policy slots]).
_libraries: list[torch.library.Library] = []


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


def _check_not_mutating(op: OpOverload) -> None:
    written = [
        argument.name
        for argument in op._schema.arguments
        if argument.alias_info is not None and argument.alias_info.is_write
    ]
    if not written:
        return
    name = dispatcher_name(op)
    functional = _functional_sibling(op)
    instead = f"set the policy of {functional!r} instead" if functional else (
        "set the policy of its functional overload instead"
    )
    raise ValueError(
        f"{name} writes into its argument(s) {written}: a policy would cast them into "
        f"temporary copies and the write would be lost; {instead}, and call that op"
    )


def _functional_sibling(op: OpOverload) -> str | None:
    # add_.Tensor -> add.Tensor; mm.out -> mm: same arguments less the written kwarg-only ones.
    wanted = [
        argument.name
        for argument in op._schema.arguments
        if not (
            argument.kwarg_only and argument.alias_info is not None and argument.alias_info.is_write
        )
    ]
    namespace, _, base = op._schema.name.partition("::")
    packet = getattr(getattr(torch.ops, namespace), base.rstrip("_"), None)
    for overload_name in packet.overloads() if packet is not None else ():
        sibling = getattr(packet, overload_name)
        names = [argument.name for argument in sibling._schema.arguments]
        if not sibling._schema.is_mutable and names == wanted:
            return dispatcher_name(sibling)
    return None


def _install(op: OpOverload, device_type: str) -> PolicySlot:
    """Return the slot of ``op``'s kernel, registering the kernel on first use (under _lock)."""
    key = (dispatcher_name(op), device_type)
    slot = _slots.get(key)
    if slot is not None:
        return slot
    slot = PolicySlot()
    kernel = make_autocast_kernel(op, device_type, slot)  # captures torch's kernel first
    namespace, _, name = key[0].partition("::")
    library = torch.library.Library(namespace, "IMPL")
    with warnings.catch_warnings():
        # Replacing torch's C++ Autocast kernel is the point; torch warns about it.
        warnings.filterwarnings("ignore", message="(?s).*previously registered kernel")
        library.impl(name, kernel, policies.AUTOCAST_DISPATCH_KEYS[device_type], with_keyset=True)
    _libraries.append(library)
    _slots[key] = slot
    return slot


def _forget_compiled_code() -> None:
    # Code compiled before an op had a kernel of ours was traced through torch's kernel (or
    # none), and carries no guard on scaledoptim's state (Note [regions under
    # torch.compile]): drop it, so it is traced again, like code traced under other
    # torch.autocast state. It happens once per op and device type. Not under _lock: it
    # waits for compilations in progress, which may take _lock (keep_snapshot).
    from torch._dynamo import convert_frame, reset_code_caches

    if convert_frame.input_codes.seen or convert_frame.output_codes.seen:
        reset_code_caches()


def _set_edit(slot: PolicySlot, edit: tuple[str | None, Any] | None) -> None:
    # Under _lock. Compiled code is guarded on the version (Note [policy version]), which
    # moves only when the policy does: setting the same policy again recompiles nothing.
    before, slot.edit = slot.edit, edit
    if before is None or edit is None:
        if before is not edit:  # set or reset, not None both times
            edits.bump()
    elif before[0] != edit[0]:
        edits.bump()


def keep_snapshot() -> int:
    """Freeze the edits in force now and return their version (``edits.kept_snapshot`` returns
    them)."""
    with _lock:
        return edits.keep_snapshot(lambda: {slot: slot.edit for slot in _slots.values()})


def set_policy(op: OpLike, policy: str | None, device_type: str) -> None:
    """Set the autocast policy of ``op`` inside ``scaledoptim.amp.autocast`` regions.

    Plain ``torch.autocast`` regions keep torch's behaviour for the op. It is safe to call
    while other threads run ops, in or out of autocast regions: the first edit of an op
    registers scaledoptim's kernel for it once for the life of the process, and later
    edits only swap the policy that kernel reads. Setting an op back to torch's default
    policy makes the kernel call torch's own kernel (about 4-9 us more per call on CPU
    than an op never edited, in plain ``torch.autocast`` regions too; the kernel stays for
    the life of the process; see ``docs/autocast.md``). Code compiled with
    ``torch.compile`` follows edits: it is traced again at its next call.

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
        ValueError: unknown op, policy or device type; an in-place or ``out=`` overload
            (``aten::add_.Tensor``, ``aten::mm.out``: a cast would copy the argument it
            writes, losing the write; give the functional overload the policy); or a policy
            the op's schema cannot take (``fp32_set_opt_dtype`` without a ``dtype``
            argument, ``fp32_append_dtype`` without a ``dtype`` overload). Nothing changes.

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
    for overload in overloads:
        _check_not_mutating(overload)
    # Build every preparer before touching any slot, so a schema error changes nothing.
    changes = [
        (overload, None)
        if policy == policies.default_policy(dispatcher_name(overload), device_type)
        else (overload, (policy, make_preparer(overload, device_type, policy)))
        for overload in overloads
    ]
    installed = False
    with _lock:
        for overload, edit in changes:
            slot = _slots.get((dispatcher_name(overload), device_type))
            if edit is None:
                if slot is not None:  # an op never edited keeps torch's kernel untouched
                    _set_edit(slot, None)
            else:
                installed |= slot is None
                _set_edit(_install(overload, device_type), edit)
    if installed:
        _forget_compiled_code()


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
        slot = _slots.get((name, device_type))
        edit = slot.edit if slot is not None else None
        found[name] = edit[0] if edit is not None else policies.default_policy(name, device_type)
    if len(set(found.values())) > 1:
        raise ValueError(
            f"The overloads of {op} have different policies on {device_type}: {found}; "
            "pass one overload, e.g. torch.ops.aten.softmax.int"
        )
    return next(iter(found.values()))


def reset_policy(op: OpLike | None = None, device_type: str | None = None) -> None:
    """Restore torch's default policy for edited ops.

    Safe while other threads run ops (see :func:`set_policy`). The op's kernel stays
    registered and calls torch's own kernel from then on.

    Args:
        op: the op to reset, as for :func:`set_policy`; ``None`` resets every op.
        device_type: the device type to reset; ``None`` resets every device type.
    """
    if device_type is not None:
        _check_device_type(device_type)
    names = None if op is None else {dispatcher_name(o) for o in resolve_overloads(op)}
    with _lock:
        for key, slot in _slots.items():
            if (names is None or key[0] in names) and device_type in (None, key[1]):
                _set_edit(slot, None)


def edited_policies() -> dict[tuple[str, str], str | None]:
    """Return ``{(dispatcher name, device type): policy}`` for every edited op."""
    with _lock:
        current = [(key, slot.edit) for key, slot in _slots.items()]
    return {key: edit[0] for key, edit in current if edit is not None}
