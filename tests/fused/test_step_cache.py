"""The fused optimizers' step cache (scaledoptim/fused/plan.py): a steady-state step reuses
the last plan, and whatever a user can change between steps gives exactly the step a plan built
from scratch gives, or the same error.

The reuse and the random sequences of changes run the default config of every fused row of
optim_db (the cache does not branch on the update's options); AdamW's gets the most examples.
The engine's corner cases run on AdamW.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scaledoptim
from scaledoptim.fused import optimizer as fused_optimizer
from scaledoptim.testing.optim_db import rows

pytestmark = pytest.mark.usefixtures("kernel_backend")  # our kernels (emulated) and torch's ops

#: Examples of the random sequences of changes: AdamW's as many as before the other rows came.
EXAMPLES = {"AdamW": 25}
OTHER_ROWS_EXAMPLES = 8


def _params(channels_last: bool = True) -> list[torch.nn.Parameter]:
    layout = torch.channels_last if channels_last else torch.contiguous_format
    return [
        torch.nn.Parameter(torch.randn(4, 4)),  # square: a transposed grad has its shape
        torch.nn.Parameter(torch.randn(2, 3, 5, 5).to(memory_format=layout)),
        torch.nn.Parameter(torch.randn(7).bfloat16()),
        torch.nn.Parameter(torch.randn(3)),
    ]


def _count_builds(monkeypatch) -> list[int]:
    builds = [0]
    build = fused_optimizer.build_plan

    def counting(optimizer):
        builds[0] += 1
        return build(optimizer)

    monkeypatch.setattr(fused_optimizer, "build_plan", counting)
    return builds


def _steady_state(opt, params) -> None:
    """Three steps with new grads: the state exists and the cache is built."""
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.unscale_and_step(grads_scaled_by=opt.scale)


@pytest.mark.parametrize("info", rows(fused=True), ids=str)
@pytest.mark.parametrize("set_to_none", [False, True])
def test_steady_state_steps_reuse_the_plan(monkeypatch, info, set_to_none) -> None:
    builds = _count_builds(monkeypatch)
    params = _params()
    opt = info.make(params)
    state_made = all(opt.state.get(p) for p in params)  # Adagrad's, by its constructor
    for _ in range(6):
        opt.zero_grad(set_to_none=set_to_none)
        for p in params:
            p.grad = torch.randn_like(p) if p.grad is None else p.grad.copy_(torch.randn_like(p))
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    # A first step that creates the state is not cacheable; the next builds the cache.
    assert builds[0] == (1 if state_made else 2)


def test_the_cache_keeps_no_grad_alive() -> None:
    params = _params()
    opt = scaledoptim.AdamW(params)
    _steady_state(opt, params)
    last = weakref.ref(params[0].grad)
    opt.zero_grad(set_to_none=True)
    assert last() is None


# Assigning a grad's .data bypasses autograd's checks of shape, dtype and device.
BYPASSES = {
    "fewer elements": (3, lambda: torch.randn(5), ValueError, "shape"),
    "same elements, other shape": (0, lambda: torch.randn(2, 8), ValueError, "shape"),
    "integer dtype": (3, lambda: torch.zeros(3, dtype=torch.int32), TypeError, "floating"),
}


@pytest.mark.parametrize("bypass", BYPASSES)
def test_a_grad_changed_through_data_is_refused_and_changes_nothing(bypass) -> None:
    index, make, error, message = BYPASSES[bypass]
    params = _params()
    opt = scaledoptim.AdamW(params)
    _steady_state(opt, params)
    params[index].grad.data = make()
    before = [p.detach().clone() for p in params]
    snapshot = [[t.clone() for t in s.values()] for s in opt.state.values()]
    scale = opt.scale.clone()
    with pytest.raises(error, match=message):
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert all(
        torch.equal(a, b)
        for old, s in zip(snapshot, opt.state.values())
        for a, b in zip(old, s.values())
    )
    assert torch.equal(scale, opt.scale)


def test_loading_a_state_dict_lets_the_old_state_go() -> None:
    params = _params()
    opt = scaledoptim.AdamW(params)
    _steady_state(opt, params)
    old = weakref.ref(opt.state[params[0]]["exp_avg"])
    opt.load_state_dict(opt.state_dict())
    assert old() is None


def test_a_new_param_group_is_stepped() -> None:
    params = _params()
    opt = scaledoptim.AdamW(params[:2], lr=0.1)
    _steady_state(opt, params)
    opt.add_param_group({"params": params[2:]})
    before = [p.detach().clone() for p in params[2:]]
    opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert all(not torch.equal(a, b) for a, b in zip(before, params[2:]))


# Every change a user can make between steps, applied to two optimizers alike: one keeps its
# step cache, the other plans every step from scratch. They must stay bit-identical.
CHANGES = [
    "fresh grads",  # zero_grad(set_to_none=True) and a new backward
    "same grads",  # zero_grad(set_to_none=False) and a new backward
    "overflow",
    "grad storage swapped",  # p.grad.data = ...
    "transposed grad",
    "grad transposed in place",  # the same storage, so the same pointer
    "param transposed in place",
    "param replaced in its group",
    "a grad is None",
    "param storage swapped",  # p.data = ...
    "state tensor replaced",
    "state reloaded",
    "lr changed",
    "split form",
]


def _apply(change: str, opt, params, values: list[torch.Tensor]) -> None:
    def fresh():
        for p, v in zip(params, values):
            p.grad = v.clone(memory_format=torch.preserve_format)

    if change in ("fresh grads", "split form"):
        fresh()
    elif change == "same grads":
        for p, v in zip(params, values):
            if p.grad is None:
                p.grad = v.clone(memory_format=torch.preserve_format)
            else:
                p.grad.copy_(v)
    elif change == "overflow":
        fresh()
        params[1].grad[0, 1, 2, 3] = float("inf")
    elif change == "grad storage swapped":
        fresh()
        params[3].grad.data = values[3].clone() * 2
    elif change == "transposed grad":
        fresh()
        params[0].grad = values[0].t().clone().t()  # same values, column-major
    elif change == "grad transposed in place":
        fresh()
        params[0].grad = params[0].grad.t()
    elif change == "param transposed in place":
        fresh()
        params[0].data = params[0].data.t()
    elif change == "param replaced in its group":
        replacement = torch.nn.Parameter(params[3].detach().clone())
        opt.state.pop(params[3], None)  # as torch.optim needs, for state_dict()
        opt.param_groups[0]["params"][3] = params[3] = replacement
        fresh()
    elif change == "a grad is None":
        fresh()
        params[2].grad = None
    elif change == "param storage swapped":
        fresh()
        params[3].data = params[3].data.clone()
    elif change == "state tensor replaced":
        fresh()
        state = opt.state[params[0]]
        key = next(key for key in opt.state_keys(opt.param_groups[0]) if key is not None)
        state[key] = state[key].clone() * 0.5
    elif change == "state reloaded":
        fresh()
        opt.load_state_dict(opt.state_dict())
    elif change == "lr changed":
        fresh()
        opt.param_groups[0]["lr"] *= 0.5


def _step(change: str, opt, uncached: bool):
    if uncached:
        opt._step_cache = None
    if change == "split form":
        found_inf, _ = opt.unscale(grads_scaled_by=opt.scale)
        if uncached:
            opt._step_cache = None
        opt.step_after_unscale()
        return found_inf
    return opt.unscale_and_step(grads_scaled_by=opt.scale)[1]


@pytest.mark.parametrize("info", rows(fused=True), ids=str)
def test_any_sequence_of_changes_steps_as_a_plan_from_scratch(info) -> None:
    """Slow (hypothesis sequences). Exists for a change between steps (grads freed, params moved,
    groups edited) after which the cached plan would step stale tables."""
    # The fixture only sets SCALEDOPTIM_KERNELS, the same for every example.
    @settings(
        max_examples=EXAMPLES.get(info.name, OTHER_ROWS_EXAMPLES),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        changes=st.lists(st.sampled_from(CHANGES), min_size=1, max_size=8),
        seed=st.integers(0, 2**16),
        channels_last=st.booleans(),  # a group of contiguous params, or one with another layout
    )
    def steps_as_a_plan_from_scratch(changes, seed, channels_last) -> None:
        _check_changes(info, changes, seed, channels_last)

    steps_as_a_plan_from_scratch()


def _check_changes(info, changes, seed, channels_last) -> None:
    generator = torch.Generator().manual_seed(seed)
    base = _params(channels_last)
    twins = []
    for _ in range(2):
        params = [
            torch.nn.Parameter(p.detach().clone(memory_format=torch.preserve_format)) for p in base
        ]
        twins.append((params, info.make(params)))
    for change in ["fresh grads", "fresh grads", *changes]:
        # In each param's layout, as autograd makes grads.
        values = [
            torch.empty_like(p).copy_(torch.randn(p.shape, generator=generator)) for p in base
        ]
        found = []
        for uncached, (params, opt) in enumerate(twins):
            _apply(change, opt, params, values)
            found.append(_step(change, opt, bool(uncached)))
        (cached_params, cached_opt), (plain_params, plain_opt) = twins
        assert torch.equal(found[0], found[1]), change
        for a, b in zip(cached_params, plain_params):
            assert torch.equal(a, b), change
            assert a.stride() == b.stride()
        for a, b in zip(cached_params, plain_params):
            sa, sb = cached_opt.state[a], plain_opt.state[b]
            assert sa.keys() == sb.keys()
            assert all(torch.equal(sa[k], sb[k]) for k in sa), change
        assert torch.equal(cached_opt.scale, plain_opt.scale)


def test_the_check_follows_grads_that_moved_in_a_step_that_then_failed() -> None:
    # Group 0's grads move and are repointed, then group 1's grad is refused: the step fails.
    # Once the grad is restored (group 1 exactly as cached), the inf/nan check must read group
    # 0's grads where they are now.
    params = _params()
    opt = scaledoptim.AdamW([{"params": params[:2]}, {"params": params[2:]}])
    _steady_state(opt, params)
    old = [p.grad for p in params[:2]]  # alive, so the new grads cannot reuse their memory
    for p in params[:2]:
        p.grad = torch.randn_like(p)
    storage = params[3].grad.data
    params[3].grad.data = torch.randn(2)  # a grad of the wrong shape
    with pytest.raises(ValueError, match="shaped like p"):
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    params[3].grad.data = storage
    params[0].grad[1, 2] = float("nan")
    _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert found_inf.item() == 1.0
    assert all(torch.isfinite(g).all() for g in old)
