"""``checkpoint``: torch.utils.checkpoint that recomputes in the forward's scaledoptim region."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from .. import compile_boundary
from . import regions, registry
from .context import _region


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Checkpoint ``function`` like :func:`torch.utils.checkpoint.checkpoint`, recomputing it
    in backward under the scaledoptim regions and edited policies its forward ran with.

    torch's checkpoint restores torch's autocast state for the recomputation, not
    scaledoptim's regions, and refuses to run edited ops inside a scaledoptim region entered
    outside the checkpointed function. This function takes the same arguments
    (``use_reentrant``, ``context_fn``, ``determinism_check``, ...), records the scaledoptim
    regions open when it is called and the edits in force, and re-enters them around
    ``function`` both in the forward and in the recomputation. The recomputation therefore
    gets the forward's policies even if they were edited before backward. Both
    ``use_reentrant=True`` and ``use_reentrant=False`` are supported. Outside any
    scaledoptim region it is torch's checkpoint unchanged.

    It works under ``torch.compile`` too (every backend): the regions are entered inside
    the checkpointed graph.

    Args:
        function: what to run in the forward pass and recompute in backward.
        *args: the arguments of ``function``.
        **kwargs: torch.utils.checkpoint.checkpoint's keyword arguments, and
            ``function``'s keyword arguments.

    Returns:
        What ``function(*args)`` returns.

    Example::

        >>> import torch, scaledoptim.amp as amp
        >>> amp.set_policy("aten::softmax.int", "lower_precision_fp", "cpu")
        >>> layer = torch.nn.Linear(4, 4)
        >>> block = lambda x: torch.softmax(layer(x).float(), -1)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> with amp.autocast("cpu", dtype=torch.bfloat16):
        ...     y = amp.checkpoint(block, x, use_reentrant=False)
        >>> y.dtype
        torch.bfloat16
        >>> y.float().sum().backward()
        >>> amp.reset_policy()
    """
    plan = _replay_plan()
    if not plan:
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)

    def in_forward_regions(*inner_args: Any, **inner_kwargs: Any) -> Any:
        return _in_regions(plan, function, inner_args, inner_kwargs)

    return torch.utils.checkpoint.checkpoint(in_forward_regions, *args, **kwargs)


Plan = tuple[tuple[str, torch.dtype, bool, bool, int], ...]


@compile_boundary.assume_constant_result
def _replay_plan() -> Plan:
    # Under torch.compile this runs while dynamo traces, and its result is a constant of the
    # graph; the compiled code is guarded on the regions it saw (governed_devices).
    devices = regions.governed_devices()
    if not devices:
        return ()
    # torch.autocast's settings too: torch's checkpoint restores them only for the device
    # type of the inputs and the CPU.
    return tuple(
        (
            device_type,
            torch.get_autocast_dtype(device_type),
            torch.is_autocast_enabled(device_type),
            torch.is_autocast_cache_enabled(),
            _edits_version(device_type),
        )
        for device_type in devices
    )


def _edits_version(device_type: str) -> int:
    """The version of the edits the region governing ``device_type`` applies: a checkpoint's
    region (its forward, or its recomputation in backward) applies its snapshot, so a
    checkpoint nested in it records that one, not the edits in force now (which backward may
    have changed since the forward it recomputes); any other region applies the edits in
    force, frozen now."""
    entry = regions.current().governing(device_type)
    if entry is not None and entry.snapshot is not None:
        return entry.snapshot.version
    return registry.keep_snapshot()


def _in_regions(plan: Plan, function: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    if not plan:
        return function(*args, **kwargs)
    device_type, dtype, enabled, cache_enabled, version = plan[0]
    with _region(device_type, dtype, enabled, cache_enabled, version):
        return _in_regions(plan[1:], function, args, kwargs)
