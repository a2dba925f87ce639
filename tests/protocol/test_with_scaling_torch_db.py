"""Every optimizer of torch's own table through the loss-scaling protocol.

For every row of ``torch.testing._internal.common_optimizers.optim_db`` (all of torch.optim:
Adadelta, Adafactor, Adagrad, Adam, Adamax, AdamW, ASGD, LBFGS, Muon, NAdam, RAdam, RMSprop,
Rprop, SGD, SparseAdam) and every config of it: ``scaledoptim.with_scaling(X)`` and
``scaledoptim.patch_optimizer(X(...))`` step as ``X`` does, bit for bit, and raise what it raises
for its error inputs; and the protocol holds for each, from the same table: scaled grads are
unscaled (the trajectory is torch's on the unscaled grads, bit for bit, as the scales are powers of
two), an overflow skips the step and backs the scale off, clean steps grow it, closures are
replayed until finite, and a checkpoint resumes bit for bit.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import scaledoptim
from scaledoptim.testing import torch_optim_db
from scaledoptim.testing.torch_optim_db import TorchConfig
from tests.support.torch_errors import assert_raises_as_torch_optim

ROWS = torch_optim_db.rows()
CONFIGS = torch_optim_db.configs(ROWS)
#: Each of torch's configs with its flagged variants (``foreach``, ``fused``, ...): one test each.
FAMILIES: dict[str, list[TorchConfig]] = {}
for _config in CONFIGS:
    FAMILIES.setdefault(str(_config).split(" & ")[0], []).append(_config)
BASES = [family[0] for family in FAMILIES.values()]
FORMS = ("unscale_and_step", "unscale + step_after_unscale", "closure")
INIT_SCALE = 2.0**10


def test_the_table_holds_every_torch_optimizer() -> None:
    assert {info.name for info in ROWS} >= {
        "Adadelta", "Adafactor", "Adagrad", "Adam", "Adamax", "AdamW", "ASGD", "LBFGS", "Muon",
        "NAdam", "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam",
    }


# ------------------------------------------------------------------------------ a small problem
def _params() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((6, 3), (4, 5))
    ]


def _loss(config: TorchConfig, params: list[torch.Tensor], step: int) -> torch.Tensor:
    """Rows of each (2-D, for Muon) param picked as an embedding does, so that SparseAdam gets the
    sparse grads it needs."""
    generator = torch.Generator().manual_seed(100 + step)
    total = torch.zeros(())
    for param in params:
        index = torch.randint(0, param.shape[0], (5,), generator=generator)
        target = torch.randn(5, param.shape[1], generator=generator)
        rows = F.embedding(index, param, sparse=config.info.only_supports_sparse_grads)
        total = total + ((rows - target) ** 2).sum()
    return total


def _backward(config: TorchConfig, opt, params, step: int, scale=None, overflow: bool = False):
    opt.zero_grad()
    loss = _loss(config, params, step)
    scaledoptim.scale_outputs(loss, scale).backward()
    if overflow:
        grad = params[0].grad
        (grad._values() if grad.is_sparse else grad).view(-1)[0] = float("inf")
    return loss


def _torch_closure(config: TorchConfig, opt, params, step: int) -> Callable[[], torch.Tensor]:
    def closure() -> torch.Tensor:
        with torch.enable_grad():
            return _backward(config, opt, params, step)

    return closure


def _step_torch(config: TorchConfig, opt, params, step: int) -> None:
    if config.info.step_requires_closure:
        opt.step(_torch_closure(config, opt, params, step))
    else:
        _backward(config, opt, params, step)
        opt.step()


def _everything(opt: torch.optim.Optimizer) -> list[Any]:
    """Params and state, in order, tensors cloned (sparse ones dense)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    values: list[Any] = list(params)
    for param in params:
        for key, value in sorted(opt.state.get(param, {}).items()):
            values += [key, *(value if isinstance(value, list) else [value])]
    return [
        (v.to_dense() if v.is_sparse else v).detach().clone() if isinstance(v, torch.Tensor) else v
        for v in values
    ]


def _assert_bit_identical(actual: list[Any], expected: list[Any]) -> None:
    assert len(actual) == len(expected)
    for a, b in zip(actual, expected):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        else:
            assert a == b or (a != a and b != b)  # nan counts as equal to itself


def _outcome(run: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own notes (Muon's lr adjustment, ...)
        try:
            return run()
        except Exception as error:
            return type(error)


# ---------------------------------------------------------------------- plain step(): torch's own
def _plain_run(config: TorchConfig, make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
    def run() -> list[Any]:
        params = _params()
        opt = make(params)
        for step in range(3):
            _step_torch(config, opt, params, step)
        return _everything(opt)

    return _outcome(run)


@pytest.mark.parametrize("base", BASES, ids=str)
def test_plain_step_is_torchs_own_bit_for_bit(base: TorchConfig) -> None:
    """Every flag of the config, through ``with_scaling(X)`` and ``patch_optimizer(X(...))``."""
    for config in FAMILIES[str(base)]:
        _plain_step_is_torchs_own(config)


def _plain_step_is_torchs_own(config: TorchConfig) -> None:
    cls = config.torch_class
    expected = _plain_run(config, lambda params: cls(params, **copy.deepcopy(config.kwargs)))
    scaled = scaledoptim.with_scaling(cls)
    for how, make in (
        ("with_scaling", lambda params: scaled(params, **copy.deepcopy(config.kwargs))),
        ("patch_optimizer",
         lambda params: scaledoptim.patch_optimizer(cls(params, **copy.deepcopy(config.kwargs)))),
    ):
        actual = _plain_run(config, make)
        if isinstance(expected, type):
            assert actual == expected, f"{config} through {how}"
            continue
        _assert_bit_identical(actual, expected)


@pytest.mark.parametrize(
    "info, error_input",
    torch_optim_db.error_inputs(ROWS),
    ids=lambda x: x.name if hasattr(x, "optim_cls") else x.optimizer_error_input.desc,
)
def test_every_error_input_raises_as_torch_optim(info, error_input) -> None:
    assert_raises_as_torch_optim(scaledoptim.with_scaling(info.optim_cls), error_input)


# ------------------------------------------------------------------------------------ the protocol
#: (overflow, clean) per step: an overflow on the second step and on the fifth.
SCHEDULE = (False, True, False, False, True, False)


def _form(config: TorchConfig) -> str:
    """Each config of an optimizer through the next form (its fused variant through the one
    after): the forms are the protocol's, the same for every torch optimizer, and each
    optimizer with three configs or more meets all of them."""
    if config.info.step_requires_closure:
        return "closure"
    bases = [base for base in BASES if base.info is config.info]
    index = bases.index(FAMILIES[str(config).split(" & ")[0]][0]) + config.flagged
    return FORMS[index % len(FORMS)]


def _scaled_step(
    config: TorchConfig, opt, params, step: int, form: str, overflow: bool
) -> tuple[torch.Tensor, list[bool]]:
    """One step of ``form``: the ``found_inf`` it reported, and whether each unscale in it
    overflowed (a closure is evaluated once per unscale; LBFGS evaluates it many times)."""
    scale = opt.scale
    if form == "closure":
        unscales: list[bool] = []

        def closure(S):
            # Overflows on the step's first evaluation only: the replay is finite.
            unscales.append(overflow and not unscales)
            return _backward(config, opt, params, step, S, overflow=unscales[-1])

        _, found_inf, _ = opt.unscale_and_step(closure, grads_scaled_by=scale)
        return found_inf, unscales
    _backward(config, opt, params, step, scale, overflow=overflow)
    if form == "unscale_and_step":
        _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=scale)
        return found_inf, [overflow]
    found_inf, _ = opt.unscale(grads_scaled_by=scale)
    opt.step_after_unscale()
    return found_inf, [overflow]


def test_every_torch_optimizer_meets_every_form_of_the_protocol() -> None:
    forms: dict[str, set[str]] = {}
    for config in CONFIGS:
        if not config.flagged or config.desc.endswith("& fused"):
            forms.setdefault(config.info.name, set()).add(_form(config))
    for name, met in forms.items():
        assert met == ({"closure"} if name == "LBFGS" else {*FORMS}), name


@pytest.mark.parametrize("base", BASES, ids=str)
def test_the_protocol_holds_for_every_torch_optimizer(base: TorchConfig) -> None:
    """Through one form of the protocol (``_form``); also with torch's fused implementation,
    which skips on found_inf itself, where the config has one."""
    for config in FAMILIES[str(base)]:
        if config is base or config.desc.endswith("& fused"):
            _protocol_holds(config, _form(config))


def _protocol_holds(config: TorchConfig, form: str) -> None:
    cls = config.torch_class
    params, ref_params = _params(), _params()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = cls(ref_params, **copy.deepcopy(config.kwargs))
        opt = scaledoptim.with_scaling(cls)(params, **copy.deepcopy(config.kwargs))
        opt.configure_scaling(init_scale=INIT_SCALE, growth_interval=2)
        scale, clean = INIT_SCALE, 0
        for step, overflow in enumerate(SCHEDULE):
            before = _everything(opt)
            found_inf, unscales = _scaled_step(config, opt, params, step, form, overflow)
            if overflow and form != "closure":  # skipped: nothing moved but the scale
                assert found_inf.item() == 1.0
                _assert_bit_identical(_everything(opt), before)
            else:  # taken (after a replay), grads unscaled exactly: torch's step, bit for bit
                assert found_inf.item() == 0.0
                _step_torch(config, ref, ref_params, step)
                _assert_bit_identical(_everything(opt), _everything(ref))
            scale, clean = _moved(scale, clean, unscales)
            assert opt.scale.item() == scale


def _moved(scale: float, clean: int, unscales: list[bool]) -> tuple[float, int]:
    """The scale and the count of clean unscales in a row after ``unscales`` (overflowed or
    not): halved by an overflow, doubled by every second clean one in a row."""
    for overflowed in unscales:
        if overflowed:
            scale, clean = scale / 2, 0
        elif clean + 1 == 2:
            scale, clean = scale * 2, 0
        else:
            clean += 1
    return scale, clean


@pytest.mark.parametrize("config", BASES, ids=str)
def test_a_checkpoint_loads_key_for_key_and_resumes_bit_for_bit(config: TorchConfig) -> None:
    """torch's ``test_state_dict_deterministic``: a load gives back the param groups and state
    it was given, key for key, as torch's own class does (LBFGS, Adafactor and SparseAdam groups
    have no ``differentiable``: a load must not add one); and, saved mid-training, resumes bit
    for bit."""
    expected = _loaded_keys(config, config.torch_class)
    actual = _loaded_keys(config, scaledoptim.with_scaling(config.torch_class))
    assert actual == expected
    if not isinstance(expected, type):
        saved, loaded = actual
        assert loaded == saved
    _resumes_bit_for_bit(config)


def _resumes_bit_for_bit(config: TorchConfig) -> None:
    cls = scaledoptim.with_scaling(config.torch_class)
    form = "closure" if config.info.step_requires_closure else "unscale_and_step"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        params = _params()
        opt = cls(params, **copy.deepcopy(config.kwargs)).configure_scaling(init_scale=INIT_SCALE)
        for step, overflow in enumerate(SCHEDULE[:3]):
            _scaled_step(config, opt, params, step, form, overflow)
        buffer = io.BytesIO()
        torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=False)
        resumed_params = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
        resumed = cls(resumed_params, **copy.deepcopy(config.kwargs))
        resumed.load_state_dict(saved["opt"])
        assert resumed.scale.item() == opt.scale.item()
        for step, overflow in enumerate(SCHEDULE[3:], start=3):
            _scaled_step(config, opt, params, step, form, overflow)
            _scaled_step(config, resumed, resumed_params, step, form, overflow)
            _assert_bit_identical(_everything(resumed), _everything(opt))
            assert resumed.scale.item() == opt.scale.item()



def _loaded_keys(config: TorchConfig, cls: type[torch.optim.Optimizer]) -> Any:
    """The keys of each param group (and of each param's state) of a state_dict after one step,
    and of the state_dict of a fresh optimizer that loaded it."""

    def run() -> Any:
        params = _params()
        opt = cls(params, **copy.deepcopy(config.kwargs))
        _step_torch(config, opt, params, 0)
        loaded = cls(_params(), **copy.deepcopy(config.kwargs))
        loaded.load_state_dict(copy.deepcopy(opt.state_dict()))
        return [
            (
                # less the copy of the loss scale each of our groups carries for DCP
                [sorted(k for k in g if k != "loss_scale") for g in sd["param_groups"]],
                {i: sorted(s) for i, s in sd["state"].items()},
            )
            for sd in (opt.state_dict(), loaded.state_dict())
        ]

    return _outcome(run)
