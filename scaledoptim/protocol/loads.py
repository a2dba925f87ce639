"""What every optimizer's ``load_state_dict`` checks before it changes anything: the layout of
the state_dict (its keys, its groups, which param each state belongs to).

Note [loads are plans]
~~~~~~~~~~~~~~~~~~~~~~
``load_state_dict`` plans, then commits, as a step does: every value it will install is
validated first, and a refusal names the key and the fix and leaves params, state and scale
bit-identical. What torch.optim's loader accepts is accepted with torch's meaning (tensors cast
to the param's device, missing options of older releases filled in, extra keys of a param group
kept); what it would keep but never use (a state keyed by something that is no param id, an
unknown top-level key) or what the next step would reject or turn into NaN is refused. This
module checks the layout, for any optimizer; ``fused/loading.py`` checks the values a fused
optimizer reads; ``scale/loss_scale.py`` the scale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["check_layout", "nothing_loaded_on_failure"]

#: The top-level keys of a scaledoptim optimizer's state_dict.
_KEYS = frozenset({"state", "param_groups", "loss_scale"})


def check_layout(
    optimizer: torch.optim.Optimizer, state_dict: Any
) -> dict[Hashable, torch.Tensor]:
    """Checks the layout of ``state_dict`` for ``optimizer`` and returns the param each saved
    param id stands for; changes nothing.

    Raises:
        TypeError: ``state_dict``, its ``"state"``, a group or a param's state is not a dict, or
            a group's ``"params"`` is not a list.
        ValueError: a missing or unknown top-level key, a group count or size that differs from
            the optimizer's (torch's messages), a param id listed twice, a state keyed by
            something that is no param id of ``param_groups``, or a meta tensor in the state of
            a param that is not (it holds no values).
    """
    fix = "pass what opt.state_dict() returned (torch.load it from the checkpoint file)"
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"An optimizer state_dict is a dict with 'state' and 'param_groups', got a "
            f"{type(state_dict).__name__}: {fix}"
        )
    missing = sorted({"state", "param_groups"} - set(state_dict))
    unknown = sorted(map(str, set(state_dict) - _KEYS))
    if missing or unknown:
        raise ValueError(
            f"Corrupt optimizer state_dict: missing keys {missing}, unknown keys {unknown} "
            f"(it holds 'state', 'param_groups' and, from scaledoptim, 'loss_scale'): {fix}"
        )
    state, saved_groups = state_dict["state"], state_dict["param_groups"]
    if not isinstance(state, Mapping):
        raise TypeError(
            f"Corrupt optimizer state_dict: 'state' must be a dict of each param id's state, "
            f"got a {type(state).__name__}: {fix}"
        )
    if not isinstance(saved_groups, (list, tuple)):
        raise TypeError(
            f"Corrupt optimizer state_dict: 'param_groups' must be a list of dicts, got a "
            f"{type(saved_groups).__name__}: {fix}"
        )
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            "loaded state dict has a different number of parameter groups: "
            f"{len(saved_groups)} in its 'param_groups', {len(optimizer.param_groups)} in the "
            f"optimizer; {fix}"
        )
    by_id: dict[Hashable, torch.Tensor] = {}
    for index, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        ids = saved.get("params") if isinstance(saved, Mapping) else None
        if not isinstance(ids, (list, tuple)):
            raise TypeError(
                f"Corrupt optimizer state_dict: param_groups[{index}] must be a dict whose "
                f"'params' is a list of param ids, got {_describe(saved)}: {fix}"
            )
        if len(ids) != len(group["params"]):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of "
                f"optimizer's group: param_groups[{index}] lists {len(ids)} params, the "
                f"optimizer's group {len(group['params'])}; {fix}"
            )
        for param_id, param in zip(ids, group["params"]):
            if not isinstance(param_id, Hashable) or param_id in by_id:
                raise ValueError(
                    f"Corrupt optimizer state_dict: param id {param_id!r} of "
                    f"param_groups[{index}] is listed twice or is not an id: {fix}"
                )
            by_id[param_id] = param
    for key, param_state in state.items():
        if key not in by_id:
            raise ValueError(
                f"Corrupt optimizer state_dict: state[{key!r}] belongs to no param: the keys of "
                f"'state' are the param ids of param_groups ({_ids(by_id)}), and "
                f"{key!r} ({type(key).__name__}) is none of them; {fix}"
            )
        if not isinstance(param_state, Mapping):
            raise TypeError(
                f"Corrupt optimizer state_dict: state[{key!r}] must be a dict of the param's "
                f"state, got {_describe(param_state)}: {fix}"
            )
        if not by_id[key].is_meta:
            _check_no_meta(f"state[{key!r}]", param_state)
    return by_id


def _check_no_meta(where: str, value: Any) -> None:
    """Refuses a meta tensor anywhere in a param's state (LBFGS keeps lists of tensors): it
    holds no values, and torch's loader fails on it with "Cannot copy out of meta tensor"."""
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise ValueError(
                f"Corrupt optimizer state_dict: {where} is a meta tensor, which holds no values; "
                "pass what opt.state_dict() returned (torch.load it with map_location='cpu')"
            )
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_no_meta(f"{where}[{key!r}]", item)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_no_meta(f"{where}[{index}]", item)


@contextlib.contextmanager
def nothing_loaded_on_failure(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Runs torch.optim's loader, putting the optimizer's state and groups back if it fails.

    torch's loader builds new state and groups and installs them before its class's
    ``__setstate__`` reads them, which may fail (``torch.optim.Adamax`` on a param state without
    ``'step'``: ``KeyError``): the old ones are put back, and the failure becomes a
    ``ValueError`` saying so.
    """
    state, groups = optimizer.state, optimizer.param_groups
    try:
        yield
    except Exception as error:
        optimizer.state, optimizer.param_groups = state, groups
        raise ValueError(
            f"Corrupt optimizer state_dict: {type(optimizer).__name__}'s loader (torch.optim's) "
            f"failed on it ({type(error).__name__}: {error}), and nothing was loaded; pass "
            "what opt.state_dict() returned (torch.load it from the checkpoint file)"
        ) from error


def _describe(value: Any) -> str:
    return f"a {type(value).__name__}" if not isinstance(value, Mapping) else "a dict without it"


def _ids(by_id: Mapping[Hashable, Any]) -> str:
    ids = list(by_id)
    shown = ", ".join(map(repr, ids[:8]))
    return f"{shown}, ..." if len(ids) > 8 else shown
