"""DDP needs no ``process_group`` (docs/recipes/ddp.md): its all-reduce leaves every rank the same
grads, an overflow of one rank's backward included, so every rank finds the same ``found_inf``
and the same norm, skips together and clips alike; on a gloo world of 2, against torch's DDP
loop with ``GradScaler`` + ``clip_grad_norm_``, both backends.
"""

from __future__ import annotations

import functools
import math
import pathlib

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world

import scaledoptim
from tests.support.references import kernels_mode
from tests.support.training import loss_of, make_model

STEPS = 5
OVERFLOW = (2, 1)  # (step, rank): that rank's loss overflows in its backward
MAX_NORM = 0.05
INIT_SCALE = 2.0**10


def _loss(model, step: int, rank: int) -> torch.Tensor:
    loss = loss_of(model, 10 * step + rank)  # each rank its own batch: DDP averages the grads
    return loss * 1e38 if (step, rank) == OVERFLOW else loss


def _ddp_skips_and_clips_together(backend: str, rank: int, world_size: int, tmp) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make_model(seed=7))
    reference = DistributedDataParallel(make_model(seed=7))
    with kernels_mode(backend):
        opt = scaledoptim.AdamW(model.parameters(), lr=0.01)  # no process_group
        opt.configure_scaling(init_scale=INIT_SCALE)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        for step in range(STEPS):
            model.zero_grad(set_to_none=True)
            scaledoptim.scale_outputs(_loss(model, step, rank), opt.scale).backward()
            _, found_inf, _ = opt.unscale_and_step(
                grads_scaled_by=opt.scale, max_grad_norm=MAX_NORM
            )
            reference.zero_grad(set_to_none=True)
            scaler.scale(_loss(reference, step, rank)).backward()
            scaler.unscale_(ref_opt)
            total = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
            scaler.step(ref_opt)
            scaler.update()

            flags = [None] * world_size
            dist.all_gather_object(flags, (found_inf.item(), opt.grad_norm.item()))
            assert len(set(map(str, flags))) == 1, flags  # every rank: the same flag and norm
            assert found_inf.item() == (1.0 if step == OVERFLOW[0] else 0.0)
            if step != OVERFLOW[0]:
                assert total > MAX_NORM  # the clip binds
                torch.testing.assert_close(opt.grad_norm, total, rtol=1e-6, atol=0)
            else:
                assert not math.isfinite(opt.grad_norm.item())
            assert opt.scale.item() == scaler.get_scale()
            for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-7)
        flat = torch.cat([p.detach().view(-1) for p in model.parameters()])
        replicas = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(replicas, flat)
        assert all(torch.equal(replicas[0], r) for r in replicas)


SCENARIOS = {
    f"ddp-{backend}": functools.partial(_ddp_skips_and_clips_together, backend)
    for backend in ("torch", "emulate")
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    return run_world(2, SCENARIOS, pathlib.Path(tmp_path_factory.mktemp("ddp")))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ddp_ranks_skip_and_clip_together_without_process_group(outcomes, scenario) -> None:
    failure = outcomes[scenario]
    assert failure is None, failure
