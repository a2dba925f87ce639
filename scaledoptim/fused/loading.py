"""The values a fused optimizer's ``load_state_dict`` installs, validated before any is
(Note [loads are plans] in protocol/loads.py): each param group's options as its step will read
them, and each param's state as :func:`~scaledoptim.fused.state.stage_state` will stage it.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
from torch import Tensor

from .rounding import MASTER_KEY, SEED_KEY, check_rounding_options, check_rounding_params
from .state import cast_loaded_state

__all__ = ["check_torch_flags", "plan_loaded_groups", "plan_loaded_state"]

#: Options torch.optim's ``__setstate__`` fills in for checkpoints of releases that lacked them,
#: and scaledoptim's own (a torch.optim checkpoint has none): a loaded group may lack them.
_FILLED_OPTIONS = frozenset(
    {"foreach", "fused", "maximize", "capturable", "differentiable", "master_weights",
     "stochastic_rounding"}
)
#: torch's names of state that sums squares: negative, its square root in the update is NaN.
_NONNEGATIVE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum"})
_FIX = "load a state_dict this optimizer class saved for this model"


def plan_loaded_groups(
    optimizer: Any, saved_groups: list[Mapping[str, Any]], legacy: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """Each saved group as the loaded optimizer will hold it (the optimizer's params, missing
    ``legacy`` options filled in), validated as its step validates it.

    Raises:
        ValueError, TypeError, RuntimeError: an option missing, of the wrong type, or out of
            range, naming the group and the option.
    """
    rounds = optimizer.rounds
    defaults = optimizer.defaults
    planned = []
    for index, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        where = f"param_groups[{index}]"
        missing = sorted(defaults.keys() - saved.keys() - legacy.keys() - _FILLED_OPTIONS)
        if missing:
            raise ValueError(
                f"Corrupt optimizer state_dict: {where} has no {missing}, which every "
                f"{type(optimizer).__name__} group holds; {_FIX}"
            )
        loaded = {**defaults, **legacy, **saved, "params": group["params"]}
        optional = _optional_flags(type(optimizer))
        for name, default in defaults.items():
            flag = isinstance(default, bool) or name in optional
            if flag and not (isinstance(loaded[name], bool) or _takes_none(name, optional, loaded)):
                allowed = "True, False or None" if name in optional else "True or False"
                raise TypeError(
                    f"Corrupt optimizer state_dict: {where}[{name!r}] must be a bool "
                    f"({allowed}), got {loaded[name]!r}; {_FIX}"
                )
            if _is_number(default) and not _is_finite_number(loaded[name]):
                raise ValueError(
                    f"Corrupt optimizer state_dict: {where}[{name!r}] must be a finite number "
                    f"(or a one-element tensor holding one), got {loaded[name]!r}; {_FIX}"
                )
        betas = loaded.get("betas")
        if "betas" in defaults and not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise TypeError(
                f"Corrupt optimizer state_dict: {where}['betas'] must be a pair of numbers, got "
                f"{betas!r}; {_FIX}"
            )
        _named(where, optimizer.check_options, loaded)
        _named(where, check_torch_flags, loaded)
        _named(where, lambda g: check_rounding_options(g, rounds), loaded)
        _named(where, check_rounding_params, loaded)
        planned.append(loaded)
    return planned


def check_torch_flags(options: dict[str, Any], constructing: bool = False) -> None:
    """torch.optim's refusals of ``fused`` with ``differentiable`` (its constructor's message;
    its step raises too) and, ``constructing``, with ``foreach``: its constructor refuses that
    pair, but a group edited or loaded with both steps fused in torch.optim, and so here."""
    if options.get("fused"):
        if options.get("differentiable"):
            raise RuntimeError(
                "`fused` does not support `differentiable`; set one of them to False"
            )
        if constructing and options.get("foreach"):
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


def plan_loaded_state(
    optimizer: Any,
    groups: list[dict[str, Any]],
    state: Mapping[Hashable, Mapping[str, Any]],
    by_id: Mapping[Hashable, Tensor],
) -> dict[Tensor, dict[str, Any]]:
    """Each param's loaded state as copies on the param's device (floating state in
    :func:`~scaledoptim.fused.state.state_dtype`), with every entry the step reads validated:
    the moments of its group's options (all, or an empty state: the param starts afresh), ``step``,
    the fp32 master and the rounding seed. One host read per device checks that every loaded
    tensor is finite, and sums of squares are not negative.

    Raises:
        TypeError, ValueError: a missing moment, a value of the wrong type, dtype, shape, or a
            non-finite or negative one, naming ``state[id][key]``.
    """
    group_of = {id(p): g for g in groups for p in g["params"]}
    checks: list[tuple[str, Tensor, bool]] = []
    planned = {}
    for key, saved in state.items():
        param = by_id[key]
        group = group_of[id(param)]
        layouts = optimizer.state_layouts(group)
        # Afresh: an empty state (torch.optim initialises it at the step), or only a step
        # where torch.optim makes missing moments itself (FusedOptimizer._state_may_lack_step).
        lone_step = optimizer._state_may_lack_step and set(saved) == {"step"}
        fresh = not saved or lone_step
        loaded: dict[str, Any] = {}
        for name, value in saved.items():
            where = f"state[{key!r}][{name!r}]"
            if name == "step":
                _check_step(where, value)
            cast = functools.partial(cast_loaded_state, param, name, layout=layouts.get(name))
            loaded[name] = _named(where, cast, value)
        for name in optimizer.state_keys(group):
            if name is None or (fresh and name not in saved):
                continue
            where = f"state[{key!r}][{name!r}]"
            if name not in saved:
                raise ValueError(
                    f"Corrupt optimizer state_dict: state[{key!r}] (a param of shape "
                    f"{tuple(param.shape)}) holds {sorted(saved)} but no {name!r}, which "
                    f"{type(optimizer).__name__} reads with these options; {_FIX}, or drop "
                    f"state[{key!r}] to start that param afresh"
                )
            layout = layouts.get(name)
            if layout is None:
                _check_tensor(where, param, loaded[name], param.is_complex())
            # (a low-bit state's codes were checked when cast; its scales must not be negative)
            nonnegative = name in _NONNEGATIVE or (layout is not None and layout.block_size)
            checks.append((where, loaded[name], bool(nonnegative)))
        if not (fresh or "step" in saved or optimizer._state_may_lack_step):
            raise ValueError(
                f"Corrupt optimizer state_dict: state[{key!r}] holds {sorted(saved)} but no "
                f"'step', the count of steps its moments were averaged over; {_FIX}, or drop "
                f"state[{key!r}] to start that param afresh"
            )
        if isinstance(loaded.get("step"), Tensor):
            checks.append((f"state[{key!r}]['step']", loaded["step"], True))
        if loaded.get(MASTER_KEY) is not None:
            where = f"state[{key!r}][{MASTER_KEY!r}]"
            _check_tensor(where, param, loaded[MASTER_KEY], complex_ok=False)
            checks.append((where, loaded[MASTER_KEY], False))
        if loaded.get(SEED_KEY) is not None:
            _check_seed(f"state[{key!r}][{SEED_KEY!r}]", loaded[SEED_KEY])
        planned[param] = loaded
    _check_values(checks)
    return planned


def _optional_flags(cls: type[Any]) -> frozenset[str]:
    """The options ``cls``'s constructor takes as ``None`` (torch's ``foreach`` and ``fused``:
    "let the implementation choose"). A group holds ``None`` for them when it was built without
    them, or loaded from a checkpoint of a release that lacked them (torch's ``__setstate__``
    fills in ``None``), whatever the loading optimizer was built with."""
    # The constructor's, not the class's: a class with a low-bit variant has its own __new__.
    parameters = inspect.signature(cls.__init__).parameters.values()
    return frozenset(p.name for p in parameters if p.default is None)


def _takes_none(name: str, optional: frozenset[str], loaded: Mapping[str, Any]) -> bool:
    return name in optional and loaded[name] is None


def _named(where: str, check: Callable[[Any], Any], value: Any) -> Any:
    """``check(value)``, its error prefixed with where the value is in the state_dict."""
    try:
        return check(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise type(error)(f"Invalid optimizer state_dict: {where}: {error}") from error


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    """A finite number, or a one-element real tensor holding one (read on the host: a load)."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_meta or value.is_complex() or value.dtype == torch.bool:
            return False
        value = value.item()
    return _is_number(value) and math.isfinite(value)


def _check_step(where: str, step: Any) -> None:
    number = isinstance(step, (int, float)) and not isinstance(step, bool)
    tensor = (
        isinstance(step, Tensor)
        and step.numel() == 1
        and not (step.is_complex() or step.dtype == torch.bool or step.is_meta)
    )
    if not (number or tensor):
        raise TypeError(
            f"Corrupt optimizer state_dict: {where} must be a number or a one-element real "
            f"tensor counting the steps taken, got {step!r}; {_FIX}"
        )
    if number and not (step >= 0 and step != float("inf")):
        raise ValueError(
            f"Corrupt optimizer state_dict: {where} = {step!r} is not a finite count of steps "
            f"(>= 0); {_FIX}"
        )


def _check_tensor(where: str, param: Tensor, value: Any, complex_ok: bool) -> None:
    if not isinstance(value, Tensor):
        raise TypeError(
            f"Corrupt optimizer state_dict: {where} must be a tensor shaped like its param "
            f"{tuple(param.shape)}, got {value!r}; {_FIX}"
        )
    kind_ok = value.is_floating_point() or (complex_ok and value.is_complex())
    if not kind_ok or value.shape != param.shape:
        raise ValueError(
            f"Corrupt optimizer state_dict: {where} is a {value.dtype} tensor of shape "
            f"{tuple(value.shape)}, but its param is a {param.dtype} tensor of shape "
            f"{tuple(param.shape)}; {_FIX}"
        )


def _check_seed(where: str, seed: Any) -> None:
    if not (
        isinstance(seed, Tensor)
        and seed.numel() == 1
        and not (seed.is_floating_point() or seed.is_complex() or seed.dtype == torch.bool)
    ):
        raise TypeError(
            f"Corrupt optimizer state_dict: {where} must be a one-element integer tensor, got "
            f"{seed!r}; {_FIX}, or delete it to re-derive the seed"
        )


def _check_values(checks: list[tuple[str, Tensor, bool]]) -> None:
    """Refuses the first non-finite tensor, or negative one where flagged; one host read per
    device (a load, not a step)."""
    by_device: dict[torch.device, list[tuple[str, Tensor, bool]]] = {}
    for check in checks:
        if not check[1].is_meta:
            by_device.setdefault(check[1].device, []).append(check)
    for device_checks in by_device.values():
        bad = torch.stack([_is_bad(value, nonnegative) for _, value, nonnegative in device_checks])
        for (where, _, nonnegative), refused in zip(device_checks, bad.tolist()):
            if refused:
                sign = " or negative" if nonnegative else ""
                raise ValueError(
                    f"Corrupt optimizer state_dict: {where} holds non-finite{sign} values, which "
                    f"the next step would turn into NaN params; {_FIX}, or drop the param's "
                    "state to start it afresh"
                )


def _is_bad(value: Tensor, nonnegative: bool) -> Tensor:
    real = torch.view_as_real(value) if value.is_complex() else value
    bad = ~torch.isfinite(real).all()
    if nonnegative:
        bad = bad | (real < 0).any()
    # A DTensor's (FSDP2's state) is over the whole sharded tensor: the same on every rank, so
    # every rank refuses or installs alike (a load is collective there).
    return bad.full_tensor() if hasattr(bad, "full_tensor") else bad
