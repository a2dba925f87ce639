"""The torch-native backend chooses each group's route once, from one table (Note [route table]
in scaledoptim/fused/backends/route_table.py): what a group of each kind takes on a CPU, the
check of its grads, and that a steady step from the step cache chooses nothing."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import scaledoptim
from scaledoptim.fused.backends import route_table, routes
from scaledoptim.fused.backends.route_table import Check, Form, Route, Working
from scaledoptim.fused.backends.routes import TorchUpdate
from scaledoptim.fused.backends.torch_native import decide_skips_on_device

T, BY_BATCH, WHOLE = Working.TENSORS, Working.COPIES_BY_BATCH, Working.WHOLE_COPIES

#: (optimizer, options, params' dtype, on the host?, the route).
TABLE: list[tuple[str, dict[str, Any], torch.dtype, bool, Route]] = [
    ("AdamW", {}, torch.float32, True, Route(T, Form.FUSED_OP)),
    ("AdamW", {}, torch.float32, False, Route(T, Form.FUSED_OP)),
    ("SGD", {"momentum": 0.9}, torch.float64, True, Route(T, Form.FUSED_OP)),
    ("AdamW", {}, torch.bfloat16, True, Route(BY_BATCH, Form.FUSED_OP)),
    ("Adagrad", {"master_weights": True}, torch.float16, True, Route(BY_BATCH, Form.FUSED_OP)),
    ("AdamW", {"stochastic_rounding": True}, torch.bfloat16, True, Route(BY_BATCH, Form.FUSED_OP)),
    ("RMSprop", {}, torch.float32, True, Route(T, Form.IN_PLACE)),
    ("RMSprop", {}, torch.float32, False, Route(T, Form.ON_CLONES)),
    ("Lion", {}, torch.bfloat16, True, Route(BY_BATCH, Form.IN_PLACE)),
    ("Lion", {}, torch.bfloat16, False, Route(BY_BATCH, Form.ON_CLONES)),
    ("LAMB", {}, torch.float32, True, Route(T, Form.IN_PLACE)),
    ("LAMB", {}, torch.bfloat16, True, Route(WHOLE, Form.IN_PLACE)),  # not elementwise
    ("LAMB", {}, torch.bfloat16, False, Route(WHOLE, Form.ON_CLONES)),
    # params that are views with gaps: torch.optim's implementation (Note [torch.optim route])
    ("Adam", {"gaps": True}, torch.float32, True, Route(T, Form.TORCH_OPTIM)),
    ("Adam", {"gaps": True}, torch.bfloat16, True, Route(WHOLE, Form.TORCH_OPTIM)),
]


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SCALEDOPTIM_KERNELS", raising=False)  # a CPU's default: torch's ops


def _params(dtype: torch.dtype, gaps: bool = False) -> list[torch.Tensor]:
    if gaps:
        return [torch.randn(n, 2).to(dtype)[:, 0].requires_grad_() for n in (3, 1000)]
    return [torch.randn(n).to(dtype).requires_grad_() for n in (3, 1000)]


def _step(opt: Any, params: list[torch.Tensor], on_host: bool) -> None:
    for p in params:
        p.grad = torch.randn(p.shape).to(p.dtype) * opt.scale.item()
    if on_host:
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    else:
        with decide_skips_on_device():
            opt.unscale_and_step(grads_scaled_by=opt.scale)


def _routes(opt: Any, params: list[torch.Tensor]) -> list[TorchUpdate]:
    """The prepared updates of ``opt``'s last plan, planned again the way the step plans."""
    updates = [u for part in opt._plan_step().parts.values() for u in part.updates]
    assert updates and all(isinstance(u, TorchUpdate) for u in updates)
    return updates


@pytest.mark.parametrize(
    ("name", "options", "dtype", "on_host", "route"),
    TABLE,
    ids=[f"{n}-{o}-{d}-{'host' if h else 'device'}" for n, o, d, h, _ in TABLE],
)
def test_each_kind_of_group_takes_its_route_from_the_table(
    name: str, options: dict[str, Any], dtype: torch.dtype, on_host: bool, route: Route
) -> None:
    options = dict(options)
    params = _params(dtype, options.pop("gaps", False))
    opt = getattr(scaledoptim, name)(params, lr=0.1, **options)
    opt.configure_scaling(init_scale=256.0)  # fp16 grads of randn * S stay finite
    _step(opt, params, on_host)
    if on_host:
        (update,) = _routes(opt, params)
    else:
        with decide_skips_on_device():
            (update,) = _routes(opt, params)
    assert update.route == route, str(update.route)
    before = [p.detach().clone() for p in params]
    _step(opt, params, on_host)  # and it steps
    assert not all(map(torch.equal, params, before))


#: (optimizer, params' dtype, on the host?, the check of a step without and with clipping).
CHECKS: list[tuple[str, torch.dtype, bool, list[Check]]] = [
    ("AdamW", torch.float32, True, [Check.UNSCALED_IN_PLACE, Check.BY_NORM]),
    ("AdamW", torch.float32, False, [Check.UNSCALED_IN_PLACE, Check.UNSCALED_IN_PLACE]),
    ("RMSprop", torch.float32, True, [Check.UNSCALED_IN_PLACE, Check.UNSCALED_IN_PLACE]),
    ("AdamW", torch.bfloat16, True, [Check.BY_BATCH, Check.INTO_FP32]),
    ("LAMB", torch.bfloat16, True, [Check.INTO_FP32, Check.INTO_FP32]),
]


@pytest.mark.parametrize(
    ("name", "dtype", "on_host", "checks"),
    CHECKS,
    ids=[f"{n}-{d}-{'host' if h else 'device'}" for n, d, h, _ in CHECKS],
)
def test_the_check_follows_the_routes_and_the_step(
    name: str, dtype: torch.dtype, on_host: bool, checks: list[Check]
) -> None:
    params = _params(dtype)
    opt = getattr(scaledoptim, name)(params, lr=0.1)
    _step(opt, params, on_host)
    if on_host:
        (part,) = opt._plan_step().parts.values()
    else:
        with decide_skips_on_device():
            (part,) = opt._plan_step().parts.values()
    assert part.unscale.checks == checks


def test_a_steady_step_chooses_no_route(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen: list[Route] = []
    choose = route_table.choose_route

    def counting(facts: route_table.GroupFacts) -> Route:
        chosen.append(choose(facts))
        return chosen[-1]

    monkeypatch.setattr(routes, "choose_route", counting)
    params = _params(torch.float32)
    groups = [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.1}]
    opt = scaledoptim.RMSprop(groups, lr=1e-3)
    for _ in range(2):  # the first plan creates state: the second is planned in full too
        _step(opt, params, on_host=True)
    assert chosen == [Route(T, Form.IN_PLACE)] * 4  # one per group and full plan
    chosen.clear()
    for _ in range(3):
        _step(opt, params, on_host=True)  # from the step cache
    assert chosen == []
    # The one fact that can move between a plan and a step: the host-read switch.
    _step(opt, params, on_host=False)
    assert chosen == [Route(T, Form.ON_CLONES)] * 2
