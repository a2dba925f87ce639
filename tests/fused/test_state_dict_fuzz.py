"""The state-dict fuzz: ``load_state_dict`` is a plan (Note [loads are plans]), for every optimizer
class. A saved state_dict with one thing changed anywhere in it (its top level, a param group, a
param's state, the loss scale and its config, the scale's copy in each group): a key dropped or
added, a value retyped, changed or nested one level deeper, is either

* refused with a TypeError, ValueError or RuntimeError naming where (a key on the path to the
  change) and the fix, with params, state, options and loss scale bit-identical; or
* loaded as torch.optim loads it: torch.optim's class of the same math, given the same
  state_dict, loads it too, and the next step gives the same params and state (a step torch
  raises on is refused by ours, at the load or at the step, changing nothing). A class without
  a torch.optim twin (Lion, LAMB) resumes from its own ``state_dict()`` of what it loaded. The
  loss scale loaded is the one written, or the configured one when none is.

Both update paths (torch's fused ops, our kernels under the emulator).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scaledoptim
from tests.support.training import assert_bit_identical, snapshot

pytestmark = pytest.mark.usefixtures("kernel_backend")

Factory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
#: Every class: ours, and torch.optim's of the same math (None: none), with the same options.
CLASSES: dict[str, tuple[Factory, Factory | None]] = {
    "Adam": (
        lambda g: scaledoptim.Adam(g, lr=1e-2, amsgrad=True, weight_decay=0.1),
        lambda g: torch.optim.Adam(g, lr=1e-2, amsgrad=True, weight_decay=0.1),
    ),
    "AdamW": (
        lambda g: scaledoptim.AdamW(g, lr=1e-2, fused=True),
        lambda g: torch.optim.AdamW(g, lr=1e-2, fused=True),
    ),
    "SGD": (
        lambda g: scaledoptim.SGD(g, lr=0.05, momentum=0.9, nesterov=True),
        lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True),
    ),
    "Adagrad": (
        lambda g: scaledoptim.Adagrad(g, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
        lambda g: torch.optim.Adagrad(g, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    ),
    "RMSprop": (
        lambda g: scaledoptim.RMSprop(g, lr=1e-2, momentum=0.5, centered=True),
        lambda g: torch.optim.RMSprop(g, lr=1e-2, momentum=0.5, centered=True),
    ),
    "Lion": (lambda g: scaledoptim.Lion(g, lr=1e-3, weight_decay=0.1), None),
    "LAMB": (lambda g: scaledoptim.LAMB(g, lr=1e-2), None),
    "LBFGS": (
        lambda g: scaledoptim.LBFGS(g, lr=0.5, max_iter=3, history_size=2),
        lambda g: torch.optim.LBFGS(g, lr=0.5, max_iter=3, history_size=2),
    ),
    "with_scaling(Adamax)": (
        lambda g: scaledoptim.with_scaling(torch.optim.Adamax)(g, lr=1e-2),
        lambda g: torch.optim.Adamax(g, lr=1e-2),
    ),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _groups(name: str, model: torch.nn.Module) -> list[dict[str, Any]]:
    """Weights and biases in two groups, the biases with an lr of their own (one group for
    LBFGS, which takes no more)."""
    if name == "LBFGS":
        return [{"params": list(model.parameters())}]
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "lr": 2e-2}]


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(5, 3, generator=gen), torch.randn(5, 2, generator=gen)
    return torch.nn.functional.mse_loss(model(x), y)


def _closure(opt: torch.optim.Optimizer, model: torch.nn.Module, step: int):
    def closure(*scale: Any) -> torch.Tensor:
        opt.zero_grad()
        loss = _loss(model, step)
        scaledoptim.scale_outputs(loss, scale[0] if scale else None).backward()
        return loss

    return closure


def _step(opt: torch.optim.Optimizer, model: torch.nn.Module, step: int) -> None:
    """One unscaled step (the loss scale is compared as loaded, not stepped with)."""
    if isinstance(opt, torch.optim.LBFGS):
        opt.step(_closure(opt, model, step))
        return
    _closure(opt, model, step)()
    opt.step()


@functools.cache
def _trained(name: str, backend: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizer's state_dicts after two scaled steps (the scale grew once)."""
    model = _model()
    opt = CLASSES[name][0](_groups(name, model))
    opt.configure_scaling(init_scale=2.0**8, growth_interval=2)
    for step in range(2):
        closure = _closure(opt, model, step)
        if isinstance(opt, torch.optim.LBFGS):
            opt.unscale_and_step(closure, grads_scaled_by=opt.scale)
        else:
            closure(opt.scale)
            opt.unscale_and_step(grads_scaled_by=opt.scale)
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


# ----------------------------------------------------------------------------- the mutations
Path = tuple[Hashable, ...]
Edit = Callable[[dict[str, Any]], None]


def _nodes(value: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every container and value of a state_dict with its path (tensors are values)."""
    yield path, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _nodes(item, (*path, key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _nodes(item, (*path, index))


def _replacements(value: Any) -> list[Any]:
    """Values to put where ``value`` was: other types, other values, one level deeper."""
    found: list[Any] = [None, "x", [], {}, 0, 3, -1, 0.5, math.nan, math.inf, True, [value]]
    found.append(torch.tensor(0.5))
    if isinstance(value, torch.Tensor):
        floating = value.detach().float()
        found += [
            value.double(), value.half(), value.to(torch.int64), value.bool(),
            value.to(torch.complex64), floating.clone().fill_(math.nan), -(floating.abs() + 1),
            floating * 2, floating.reshape(-1)[:1].clone() if value.numel() > 1 else torch.ones(2),
            value.to("meta"), floating.tolist(),
        ]
    elif isinstance(value, bool):
        found += [not value]
    elif isinstance(value, (int, float)):
        found += [value * 2, -value, float(value), int(value) if math.isfinite(value) else 1,
                  torch.tensor(value)]
    elif isinstance(value, (list, tuple)):
        found += [list(value), tuple(value), list(value)[:-1], [*value, *value[-1:]]]
    return found


def _at(path: Path) -> Callable[[dict[str, Any]], Any]:
    def container(state_dict: dict[str, Any]) -> Any:
        node: Any = state_dict
        for key in path:
            node = node[key]
        return node

    return container


def _set(path: Path, value: Any) -> Edit:
    def edit(state_dict: dict[str, Any]) -> None:
        parent = _at(path[:-1])(state_dict)
        if isinstance(parent, tuple):  # betas: rebuilt with the element replaced
            grand = _at(path[:-2])(state_dict)
            grand[path[-2]] = (*parent[: path[-1]], copy.deepcopy(value), *parent[path[-1] + 1 :])
        else:
            parent[path[-1]] = copy.deepcopy(value)

    return edit


def _drop(path: Path) -> Edit:
    def edit(state_dict: dict[str, Any]) -> None:
        parent = _at(path[:-1])(state_dict)
        if isinstance(parent, tuple):
            _set(path[:-1], parent[: path[-1]] + parent[path[-1] + 1 :])(state_dict)
        else:
            del parent[path[-1]]

    return edit


def _add(path: Path, value: Any) -> Edit:
    def edit(state_dict: dict[str, Any]) -> None:
        node = _at(path)(state_dict)
        if isinstance(node, dict):
            node["bogus"] = copy.deepcopy(value)
        elif isinstance(node, list):
            node.append(copy.deepcopy(value))
        else:
            _set(path, (*node, copy.deepcopy(value)))(state_dict)

    return edit


PARTS = ("top level", "param_groups", "state", "loss_scale")


def _part(path: Path) -> str:
    if len(path) <= 1:
        return "top level"
    if path[0] == "loss_scale" or "loss_scale" in path:
        return "loss_scale"
    return str(path[0])


def _mutations(state_dict: dict[str, Any]) -> dict[str, list[tuple[Path, str, Edit]]]:
    """Every mutation by part: (the path of what changes, what is done, the edit)."""
    found: dict[str, list[tuple[Path, str, Edit]]] = {part: [] for part in PARTS}
    for path, value in _nodes(state_dict):
        part = found[_part(path)]
        if isinstance(value, (dict, list, tuple)):
            part.append((path, "add", _add(path, 1)))
            part.append((path, "add a tensor", _add(path, torch.ones(1))))
        if not path:
            continue
        part.append((path, "drop", _drop(path)))
        for index, replacement in enumerate(_replacements(value)):
            part.append((path, f"replace #{index}", _set(path, replacement)))
    return found


# ----------------------------------------------------------------------------- the property
def _options(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _state_keys(opt: torch.optim.Optimizer) -> list[list[str]]:
    return [sorted(map(str, s)) for s in opt.state.values()]


def _scale_config(opt: scaledoptim.Optimizer) -> dict[str, Any]:
    return dataclasses.asdict(opt.scaling_state.loss_scale.config)


def _fresh(name: str, model_state: dict[str, Any], which: int) -> tuple[Any, Any]:
    model = _model()
    model.load_state_dict(model_state)
    factory = CLASSES[name][which]
    assert factory is not None
    opt = factory(_groups(name, model))
    if which == 0:
        opt.configure_scaling(init_scale=2.0**8, growth_interval=2)
    return model, opt


def _names_where_and_fix(error: BaseException, path: Path) -> bool:
    message = str(error)
    where = {str(key) for key in path if isinstance(key, str)} | {"bogus", "state_dict"}
    fixes = ("state_dict", "load", "pass", "drop", "delete", "remove", "use ")
    return any(w in message for w in where) and any(f in message for f in fixes)


@pytest.mark.parametrize("name", list(CLASSES))
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_a_mutated_state_dict_is_refused_unchanged_or_loads_as_torch(name, data) -> None:
    model_state, valid = _trained(name, os.environ.get("SCALEDOPTIM_KERNELS"))
    part = data.draw(st.sampled_from([p for p, m in _mutations(valid).items() if m]), label="part")
    path, what, edit = data.draw(st.sampled_from(_mutations(valid)[part]), label="mutation")
    mutated = copy.deepcopy(valid)
    edit(mutated)

    model, opt = _fresh(name, model_state, 0)
    opt.load_state_dict(copy.deepcopy(valid))
    before, options, keys = snapshot(opt), _options(opt), _state_keys(opt)
    config = _scale_config(opt)
    try:
        opt.load_state_dict(copy.deepcopy(mutated))
    except (TypeError, ValueError, RuntimeError) as error:
        assert _names_where_and_fix(error, path), (path, what, error)
        assert_bit_identical(before, snapshot(opt))
        assert _options(opt) == options and _state_keys(opt) == keys
        assert _scale_config(opt) == config
        return
    _assert_scale_loaded(opt, mutated)
    if CLASSES[name][1] is None:
        _assert_resumes_from_its_own_state_dict(name, model_state, model, opt)
    else:
        _assert_steps_as_torch(name, model_state, model, opt, mutated, (path, what))


def _assert_scale_loaded(opt: scaledoptim.Optimizer, mutated: dict[str, Any]) -> None:
    written = mutated.get("loss_scale")
    if written is None:
        groups = mutated["param_groups"]
        written = groups[0].get("loss_scale") if groups else None
    loaded = opt.scaling_state.loss_scale.state_dict()
    if written is None:  # none written: the configured scale, afresh
        assert loaded["scale"].item() == 2.0**8 and loaded["growth_tracker"].item() == 0
        return
    for key in ("scale", "growth_tracker", "hysteresis_tracker"):
        assert loaded[key].item() == written[key].item(), key
    assert loaded["config"] == dict(written["config"])


def _assert_steps_as_torch(name, model_state, model, opt, mutated, mutation) -> None:
    reference_model, reference = _fresh(name, model_state, 1)
    try:
        reference.load_state_dict(copy.deepcopy(mutated))
    except Exception as error:
        # torch.optim.Adagrad's loader reads the first state's "step" even when that state is
        # empty (KeyError); an empty state means "start afresh", which torch's step does with
        # the entry left out.
        afresh = {k: v for k, v in mutated["state"].items() if v != {}}
        if len(afresh) == len(mutated["state"]):
            pytest.fail(f"{mutation}: torch.optim refuses it ({error!r}), scaledoptim loaded it")
        reference.load_state_dict(copy.deepcopy({**mutated, "state": afresh}))
    try:
        _step(reference, reference_model, 2)
    except Exception as torch_error:
        if "capturable=True" in str(torch_error) and isinstance(opt, scaledoptim.FusedOptimizer):
            return  # torch takes capturable=True on CUDA only; the fused drop-ins anywhere
        # Refused at the step: a fused class changes nothing; one whose own step() runs (LBFGS,
        # with_scaling) fails as torch's does, where torch's does.
        before = snapshot(opt)
        with pytest.raises(Exception) as raised:  # torch's own error, whatever it is
            _step(opt, model, 2)
        if isinstance(opt, scaledoptim.FusedOptimizer):
            assert_bit_identical(before, snapshot(opt))
        else:
            assert type(raised.value) is type(torch_error), (mutation, raised.value, torch_error)
        return
    _step(opt, model, 2)
    for ours, theirs in zip(model.parameters(), reference_model.parameters(), strict=True):
        # NaN only where torch's step makes NaN of the same state (a centered RMSprop whose
        # grad_avg**2 exceeds square_avg, say: torch takes that state).
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, equal_nan=True)
    for param, ref_param in zip(model.parameters(), reference_model.parameters(), strict=True):
        for key, expected in reference.state[ref_param].items():
            if key not in _torch_keys(name):  # kept as loaded, not torch's (SGD's step)
                continue
            actual = opt.state[param][key]
            if isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor):
                torch.testing.assert_close(
                    actual.to(expected.dtype), expected, rtol=1e-5, atol=1e-6, equal_nan=True
                )


@functools.cache
def _torch_keys(name: str) -> frozenset[str]:
    """The state entries torch.optim's class writes itself."""
    model = _model()
    factory = CLASSES[name][1]
    assert factory is not None
    reference = factory(_groups(name, model))
    _step(reference, model, 0)
    return frozenset(k for state in reference.state.values() for k in state)


def _assert_resumes_from_its_own_state_dict(name, model_state, model, opt) -> None:
    """A class without a torch twin: its state_dict of what it loaded loads into a fresh one,
    which then steps bit for bit as it does."""
    resumed_model, resumed = _fresh(name, model_state, 0)
    resumed_model.load_state_dict(model.state_dict())
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    for m, o in ((model, opt), (resumed_model, resumed)):
        _step(o, m, 2)
    assert_bit_identical(snapshot(opt), snapshot(resumed))
