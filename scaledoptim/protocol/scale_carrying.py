"""The loss scale state carried in every param group of a state_dict, so that it survives
torch.distributed.checkpoint; the checks a load makes of those copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["GROUP_SCALE_KEY"]

# Note [the scale through DCP]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.distributed.checkpoint's get_optimizer_state_dict rebuilds an optimizer's state_dict from
# its "state" and "param_groups" alone (a top-level "loss_scale" is dropped), renames param ids
# to FQNs and merges several optimizers' groups into one list; set_optimizer_state_dict splits
# them back per optimizer by FQN. A key of a param group survives that, sharded or full, and
# stays with its own optimizer, so state_dict() writes the scale state (scale, growth and
# hysteresis trackers as replicated 0-dim tensors, and the config) into every group, besides
# the top-level "loss_scale" torch.save users read. A load takes the top-level one when there
# is one (the old recipe loads the scale saved beside that way), else the groups' copies, which
# must agree; the key never reaches opt.param_groups. Every group holds a copy so that a group
# a split leaves on its own still carries it. Not carried: StateDictOptions(
# flatten_optimizer_state_dict=True), whose loader rebuilds each group from the keys the live
# opt.param_groups hold (a key there would reach schedulers and add_param_group; not worth it).

#: The param-group key that carries the loss scale state (Note [the scale through DCP]).
GROUP_SCALE_KEY = "loss_scale"


def _pop_group_scale_state(state_dict: dict[str, Any]) -> Mapping[str, Any] | None:
    """Removes the scale state every group of ``state_dict`` carries (Note [the scale through
    DCP]), copying the groups instead of changing the caller's; returns the first group's, or
    ``None`` when no group carries one.

    Raises:
        ValueError: some groups carry one and others do not, or their copies differ.
    """
    groups = state_dict.get("param_groups")
    if not isinstance(groups, (list, tuple)):
        return None  # check_layout has refused it already
    carried = [isinstance(g, Mapping) and GROUP_SCALE_KEY in g for g in groups]
    if not any(carried):
        return None
    fix = "load what opt.state_dict() or get_optimizer_state_dict() returned, unedited"
    if not all(carried):
        raise ValueError(
            f"Corrupt optimizer state_dict: param_groups {[i for i, c in enumerate(carried) if c]} "
            f"carry the loss scale state ('{GROUP_SCALE_KEY}') and the others do not: {fix}"
        )
    copies = [g[GROUP_SCALE_KEY] for g in groups]
    for index, copy in enumerate(copies[1:], start=1):
        if not _same_scale_state(copies[0], copy):
            raise ValueError(
                f"Corrupt optimizer state_dict: param_groups[{index}]['{GROUP_SCALE_KEY}'] "
                f"differs from param_groups[0]'s (one optimizer has one loss scale): {fix}"
            )
    state_dict["param_groups"] = [
        {k: v for k, v in g.items() if k != GROUP_SCALE_KEY} for g in groups
    ]
    return copies[0]


def _carries_scale(state_dict: Mapping[str, Any]) -> bool:
    """Whether the groups of a (layout-checked) state_dict carry the scale state."""
    return any(GROUP_SCALE_KEY in group for group in state_dict["param_groups"])


def _same_scale_state(first: Any, other: Any) -> bool:
    """Whether two carried scale states hold the same values (a host read: this is a load)."""
    if not (isinstance(first, Mapping) and isinstance(other, Mapping)):
        return first is other
    if first.keys() != other.keys():
        return False
    for key, value in first.items():
        twin = other[key]
        if isinstance(value, torch.Tensor) or isinstance(twin, torch.Tensor):
            if not (
                isinstance(value, torch.Tensor)
                and isinstance(twin, torch.Tensor)
                and value.shape == twin.shape
                and _same_values(value, twin)
            ):
                return False
        elif value != twin:
            return False
    return True


def _same_values(value: torch.Tensor, twin: torch.Tensor) -> bool:
    # Meta tensors hold no values to read: alike when both are meta (the load refuses them).
    if value.is_meta or twin.is_meta:
        return value.is_meta and twin.is_meta and value.dtype == twin.dtype
    return torch.equal(value.detach().cpu(), twin.detach().cpu())
