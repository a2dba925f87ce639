"""DTensor params (FSDP2's Shard(0), tensor parallel's Replicate/Shard) on a real gloo world of 2:
every elementwise fused optimizer on both backends steps them as it steps the same plain tensors,
keeps its state as DTensors with the param's placements, and skips an overflow in one rank's
shard on every rank (with ``process_group``); LAMB refuses a Partial placement before anything
changes (it steps Shard and Replicate ones: test_dist_sharded.py). On the kernel path our
kernels step the local shards (Note [DTensor steps on our kernels]), and the reference is the
same backend on the whole tensors; the torch backend runs torch's ops on the local shards
(Note [tensor subclasses]).
"""

from __future__ import annotations

import functools
import pathlib

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world

import scaledoptim
from tests.support.launches import recorded_launches
from tests.support.references import kernels_mode
from tests.support.training import assert_bit_identical

OPTIMIZERS = ("AdamW", "Adam", "SGD", "Adagrad", "RMSprop", "Lion")  # the elementwise ones
TORCH_FUSED_ON_CPU = ("AdamW", "Adam", "SGD")
STEPS = 4
OVERFLOW_STEP = 2  # an inf in rank 1's shard of the first param


def _optimizer(name: str, params: list[torch.Tensor]) -> scaledoptim.Optimizer:
    options = {"momentum": 0.9} if name in ("SGD", "RMSprop") else {}
    opt = getattr(scaledoptim, name)(params, lr=0.01, **options)
    return opt.configure_scaling(init_scale=2.0**8, process_group=dist.group.WORLD)


def _grad(step: int, index: int, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(shape, generator=generator)  # the same on every rank


def _train(name, params, make_grad, overflow_on_rank):
    """Steps ``params``; returns the skip flags, and the scale after each step."""
    opt = _optimizer(name, params)
    found, scales = [], []
    for step in range(STEPS):
        for i, param in enumerate(params):
            param.grad = make_grad(step, i, param)
        if step == OVERFLOW_STEP and overflow_on_rank is not None:
            overflow_on_rank(params[0].grad)
        _, found_inf, S = opt.unscale_and_step(grads_scaled_by=opt.scale)
        found.append(found_inf.item())
        scales.append(S.item())
    return opt, found, scales


def _dtensor_steps_like_plain(name: str, backend: str, rank: int, world_size: int, tmp) -> None:
    from torch.distributed.tensor import (
        DTensor,
        Replicate,
        Shard,
        distribute_tensor,
        init_device_mesh,
    )

    mesh = init_device_mesh("cpu", (world_size,))
    placements = ([Shard(0)], [Replicate()], [Shard(1)])
    shapes = ((6, 4), (3, 5), (4, 8))

    def inf_in_rank_1(grad):
        if rank == 1:
            grad.to_local().view(-1)[0] = float("inf")

    def inf_everywhere(grad):
        grad.view(-1)[-1] = float("inf")

    for dtype in (torch.float32, torch.bfloat16):
        weights = [
            torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(dtype)
            for i, shape in enumerate(shapes)
        ]
        with kernels_mode(backend), recorded_launches() as launched:
            sharded = [
                torch.nn.Parameter(distribute_tensor(w.clone(), mesh, p))
                for w, p in zip(weights, placements)
            ]
            opt, found, scales = _train(
                name,
                sharded,
                lambda step, i, p: distribute_tensor(
                    _grad(step, i, p.shape).to(p.dtype), mesh, p.placements
                ),
                inf_in_rank_1,
            )
        # See Note [DTensor steps on our kernels]: the emulated kernels step the local shards
        assert (opt.kernel.name in launched) == (backend == "emulate")
        with kernels_mode(backend):  # the same backend on the whole tensors
            plain = [torch.nn.Parameter(w.clone()) for w in weights]
            reference, ref_found, ref_scales = _train(
                name, plain, lambda step, i, p: _grad(step, i, p.shape).to(p.dtype), inf_everywhere
            )
        assert found == ref_found == [float(s == OVERFLOW_STEP) for s in range(STEPS)]
        assert scales == ref_scales
        for param, twin in zip(sharded, plain):
            state, ref_state = opt.state[param], reference.state[twin]
            assert state.keys() == ref_state.keys()
            for key, value in state.items():
                if key != "step":  # counters are plain tensors, as torch.optim's
                    assert isinstance(value, DTensor) and value.placements == param.placements
            got = [param.full_tensor()] + [
                v.full_tensor() if isinstance(v, DTensor) else v for v in state.values()
            ]
            want = [twin.detach(), *ref_state.values()]
            if backend == "torch" and name in TORCH_FUSED_ON_CPU:
                # torch's CPU fused AdamW/SGD round the elements past the last full vector
                # differently (measured: the last 3 of a 12-element shard, 1-8 ulp), so a
                # shard's tail differs from the same elements inside the whole tensor.
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=0)
            else:  # elementwise: each shard's update is the whole tensor's, bit for bit
                assert_bit_identical(got, want)


def _lamb_refuses_partial_params(backend: str, rank: int, world_size: int, tmp) -> None:
    """A Partial param's norms are not sums of its shards' (its values are not summed yet)."""
    from torch.distributed.tensor import DTensor, Partial, init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    with kernels_mode(backend):
        param = torch.nn.Parameter(DTensor.from_local(torch.randn(6, 4), mesh, [Partial()]))
        param.grad = DTensor.from_local(torch.randn(6, 4), mesh, [Partial()])
        opt = _optimizer("LAMB", [param])
        before = [param.to_local().clone(), opt.scale.clone()]
        with pytest.raises(ValueError, match=r"LAMB: param group 0: tensor 0 .*Partial.*redistr"):
            opt.unscale_and_step(grads_scaled_by=opt.scale)
        assert not opt.state[param]
        assert_bit_identical(before, [param.to_local(), opt.scale])


def _corrupt_shard_is_refused_on_every_rank(rank: int, world_size: int, tmp) -> None:
    """A NaN in one rank's shard of a loaded moment: every rank refuses the load (one verdict
    over the whole sharded tensor), and nothing changes on any rank."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    param = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]))
    param.grad = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    opt = _optimizer("AdamW", [param])
    opt.unscale_and_step(grads_scaled_by=opt.scale)
    saved = opt.state_dict()
    corrupt = {**saved, "state": {0: dict(saved["state"][0])}}
    exp_avg = saved["state"][0]["exp_avg"].to_local().clone()
    if rank == 1:
        exp_avg[0, 0] = float("nan")
    corrupt["state"][0]["exp_avg"] = DTensor.from_local(exp_avg, mesh, [Shard(0)])
    before = [param.to_local().clone(), *(v.to_local().clone() for v in _moments(opt, param))]
    with pytest.raises(ValueError, match="non-finite"):
        opt.load_state_dict(corrupt)
    assert_bit_identical(before, [param.to_local(), *(v.to_local() for v in _moments(opt, param))])


def _moments(opt, param):
    return [v for k, v in opt.state[param].items() if k != "step"]


SCENARIOS = {
    **{
        f"{name}-{backend}": functools.partial(_dtensor_steps_like_plain, name, backend)
        for name in OPTIMIZERS
        for backend in ("torch", "emulate")
    },
    **{
        f"LAMB-refuses-partial-{backend}": functools.partial(_lamb_refuses_partial_params, backend)
        for backend in ("torch", "emulate")
    },
    "corrupt-shard-refused": _corrupt_shard_is_refused_on_every_rank,
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    return run_world(2, SCENARIOS, pathlib.Path(tmp_path_factory.mktemp("dtensor")))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_dtensor_params_step_like_plain_tensors(outcomes, scenario) -> None:
    failure = outcomes[scenario]
    assert failure is None, failure
