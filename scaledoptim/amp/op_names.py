"""Turn what users pass as an op (packet, overload, qualified name) into op overloads."""

from __future__ import annotations

import torch
from torch._ops import OpOverload, OpOverloadPacket

#: What the policy functions accept as an op.
OpLike = OpOverload | OpOverloadPacket | str


def dispatcher_name(overload: OpOverload) -> str:
    """Return the dispatcher name of ``overload``: ``"aten::mm"``, ``"aten::softmax.int"``."""
    schema = overload._schema
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name


def _packet(qualified_name: str) -> OpOverloadPacket:
    namespace, sep, name = qualified_name.partition("::")
    if not sep or not namespace or not name:
        raise ValueError(
            f"Invalid op name {qualified_name!r}: expected 'namespace::name' or "
            "'namespace::name.overload', e.g. 'aten::softmax' or 'aten::softmax.int'"
        )
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError) as error:
        raise ValueError(
            f"Unknown op {qualified_name!r}: no such operator is registered; define it with "
            "torch.library before giving it a policy"
        ) from error


def _functional_overloads(packet: OpOverloadPacket) -> list[OpOverload]:
    # A packet without a default overload (aten::softmax) stands for its functional
    # overloads; out= and in-place overloads never have autocast kernels in ATen. A packet
    # of in-place ops only (aten::add_) stands for all of them, which set_policy refuses.
    overloads = [getattr(packet, name) for name in packet.overloads()]
    return [op for op in overloads if not op._schema.is_mutable] or overloads


def resolve_overloads(op: OpLike) -> list[OpOverload]:
    """Return the op overloads that ``op`` names.

    ``torch.ops.aten.mm`` and ``"aten::mm"`` name the default overload (that is the
    dispatcher's own name for it); a packet without a default overload such as
    ``torch.ops.aten.softmax`` / ``"aten::softmax"`` names all its functional overloads;
    ``"aten::softmax.int"`` or ``torch.ops.aten.softmax.int`` names one overload.

    Raises:
        ValueError: the name is malformed or no such op or overload exists.
        TypeError: ``op`` is neither an op nor a string.
    """
    if isinstance(op, OpOverload):
        return [op]
    if isinstance(op, str):
        base, _, overload_name = op.partition(".")
        packet = _packet(base)
        if overload_name:
            if overload_name not in packet.overloads():
                raise ValueError(
                    f"Unknown overload {op!r}: {base} has overloads {packet.overloads()}"
                )
            return [getattr(packet, overload_name)]
    elif isinstance(op, OpOverloadPacket):
        packet = op
    else:
        raise TypeError(
            f"Expected an OpOverloadPacket, OpOverload or qualified name string, got "
            f"{type(op).__name__}"
        )
    if "default" in packet.overloads():
        return [packet.default]
    return _functional_overloads(packet)
