"""check_during_backward under data parallelism, on a real gloo group of 2 processes: the skips,
the scale and the params must equal the plain form's (Note [overlapped overflow check]).

A hook sees each rank's *local* grad, before DDP all-reduces it, and the step uses the reduced
one; the in-place collectives of ``torch.distributed`` move no version counter, so a grad reduced
in place after its hook looks unchanged. The last two scenarios fail where the hooks trust it.
"""

from __future__ import annotations

import contextlib
import functools
import pathlib

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world
from torch.nn.parallel import DistributedDataParallel

import scaledoptim
from tests.support.references import kernels_mode
from tests.support.training import assert_bit_identical, batch, make_model

STEPS = 8
INJECTED = {1: (0, 0), 3: (1, 1), 4: (1, 0), 6: (0, 1)}  # step -> (rank, micro-batch) of the inf
BACKENDS = ("torch", "emulate")  # SCALEDOPTIM_KERNELS: torch's fused ops, our kernels emulated
FORMS = (False, True)  # check_during_backward


def _gathered(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _optimizer(model, check: bool, agree: bool = True) -> scaledoptim.Optimizer:
    return scaledoptim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1).configure_scaling(
        init_scale=2.0**10, growth_interval=3, hysteresis=2,
        process_group=dist.group.WORLD if agree else None, check_during_backward=check,
    )


def _sum_in_place(state, bucket):
    """A comm hook that all-reduces the bucket in place and hands it back (the loss is divided
    by the world size beforehand): DDP then writes nothing more, so no version counter moves."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _train_accumulating(rank, check, bucket_view, set_to_none, comm_hook=None):
    """STEPS steps of 2 micro-batches (the first under no_sync()), the inf of INJECTED in one
    rank's input; returns (found_inf, scale) per step and the final params."""
    model = DistributedDataParallel(make_model(), gradient_as_bucket_view=bucket_view)
    if comm_hook is not None:
        model.register_comm_hook(None, comm_hook)
    opt = _optimizer(model, check)
    seen = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        for micro in (0, 1):
            x, y = batch(100 * step + 10 * micro + rank)
            if INJECTED.get(step) == (rank, micro):
                x[0, 0] = float("inf")
            with model.no_sync() if micro == 0 else contextlib.nullcontext():  # forward included
                loss = torch.nn.functional.mse_loss(model(x), y) / 2  # mean of the micro-batches
                if comm_hook is not None:  # it sums
                    loss = loss / dist.get_world_size()
                scaledoptim.scale_outputs(loss, opt.scale).backward()
            if step == 0 and micro == 0:  # the teeth: the first micro-batch's grads stay local
                grads = _gathered([p.grad.clone() for p in model.parameters()])
                assert not any(map(torch.equal, grads[0], grads[1]))
        _, found_inf, S = opt.unscale_and_step(grads_scaled_by=opt.scale)
        seen.append((found_inf.item(), S.item()))
    return seen, [p.detach().clone() for p in model.parameters()]


def _assert_forms_and_ranks_agree(results) -> None:
    """results: form -> (per-step (found_inf, scale), params) on this rank."""
    (plain_seen, plain_params), (checked_seen, checked_params) = results[False], results[True]
    assert [found for found, _ in plain_seen] == [float(s in INJECTED) for s in range(STEPS)]
    assert checked_seen == plain_seen, (checked_seen, plain_seen)
    assert_bit_identical(plain_params, checked_params)
    everywhere = _gathered((plain_seen, plain_params))
    for other_seen, other_params in everywhere[1:]:
        assert other_seen == everywhere[0][0], (other_seen, everywhere[0][0])
        assert_bit_identical(everywhere[0][1], other_params)


def _ddp_case(bucket_view: bool, set_to_none: bool, comm_hook=None):
    def scenario(rank, world_size, tmp):
        for backend in BACKENDS:
            with kernels_mode(backend):
                _assert_forms_and_ranks_agree(
                    {
                        check: _train_accumulating(rank, check, bucket_view, set_to_none, comm_hook)
                        for check in FORMS
                    }
                )

    return scenario


def ddp_overflow_in_one_ranks_backward_is_skipped_alike(rank, world_size, tmp):
    """DDP's default: the reducer copies the reduced bucket back into each grad (a new version)."""
    _ddp_case(bucket_view=False, set_to_none=True)(rank, world_size, tmp)


def ddp_bucket_view_grads_are_skipped_alike(rank, world_size, tmp):
    """gradient_as_bucket_view: the grads are views of the bucket and stay so across steps."""
    _ddp_case(bucket_view=True, set_to_none=False)(rank, world_size, tmp)


def ddp_in_place_comm_hook_is_skipped_alike(rank, world_size, tmp):
    """Bucket-view grads reduced in place by the comm hook: only the collective writes them."""
    _ddp_case(bucket_view=True, set_to_none=False, comm_hook=_sum_in_place)(rank, world_size, tmp)


def _train_summing_huge_grads(rank, check):
    """4 steps of a one-weight model whose scaled grad is 2e38 on every rank in step 2 (finite;
    their sum is not); returns (found_inf, scale) per step, the weight, and whether every local
    grad a hook saw was finite."""
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1, bias=False), gradient_as_bucket_view=True)
    model.register_comm_hook(None, _sum_in_place)
    local = []
    model.module.weight.register_post_accumulate_grad_hook(
        lambda p: local.append(bool(torch.isfinite(p.grad).all()))
    )
    opt = _optimizer(model, check)
    seen = []
    for step in range(4):
        opt.zero_grad(set_to_none=False)
        x = torch.full((1, 1), 2.0e38 / opt.scale.item() if step == 2 else 1.0 + rank)
        scaledoptim.scale_outputs(model(x).sum(), opt.scale).backward()  # d/dw = S * x
        _, found_inf, S = opt.unscale_and_step(grads_scaled_by=opt.scale)
        seen.append((found_inf.item(), S.item()))
    return seen, model.module.weight.detach().clone(), all(local)


def ddp_overflow_made_by_the_reduction_is_skipped_alike(rank, world_size, tmp):
    """Every rank's grad is finite, their sum is not: only a check of the reduced grad sees it,
    agreeing on found_inf does not help."""
    for backend in BACKENDS:
        with kernels_mode(backend):
            (plain, plain_weight, _), (checked, checked_weight, local_finite) = (
                _train_summing_huge_grads(rank, check) for check in FORMS
            )
            assert local_finite, "the teeth: no rank's local grad overflowed"
            assert [found for found, _ in plain] == [0.0, 0.0, 1.0, 0.0]
            assert checked == plain, (checked, plain)
            assert torch.equal(checked_weight, plain_weight)


def _train_hand_rolled(rank, check):
    """No DDP: STEPS steps, dist.all_reduce(p.grad) after backward, no process group."""
    model = make_model()
    opt = _optimizer(model, check, agree=False)
    seen = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(100 * step + rank)
        if step in INJECTED and INJECTED[step][0] == rank:
            x[0, 0] = float("inf")
        loss = torch.nn.functional.mse_loss(model(x), y) / dist.get_world_size()
        scaledoptim.scale_outputs(loss, opt.scale).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        _, found_inf, S = opt.unscale_and_step(grads_scaled_by=opt.scale)
        seen.append((found_inf.item(), S.item()))
    return seen, [p.detach().clone() for p in model.parameters()]


def hand_rolled_all_reduce_is_skipped_alike(rank, world_size, tmp):
    """The all-reduce makes every rank's grads equal, so the plain form agrees on found_inf
    without a process group; the checked form must too."""
    for backend in BACKENDS:
        with kernels_mode(backend):
            _assert_forms_and_ranks_agree(
                {check: _train_hand_rolled(rank, check) for check in FORMS}
            )


SCENARIOS = {
    f.__name__: f
    for f in (
        ddp_overflow_in_one_ranks_backward_is_skipped_alike,
        ddp_bucket_view_grads_are_skipped_alike,
        ddp_in_place_comm_hook_is_skipped_alike,
        ddp_overflow_made_by_the_reduction_is_skipped_alike,
        hand_rolled_all_reduce_is_skipped_alike,
    )
}


@functools.cache
def _outcomes(tmp_root: pathlib.Path) -> dict[str, str | None]:
    return run_world(2, SCENARIOS, tmp_root)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return _outcomes(tmp_path_factory.mktemp("gloo-backward-check"))


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_gloo_scenario(outcomes, scenario) -> None:
    failure = outcomes[scenario]
    assert failure is None, failure
