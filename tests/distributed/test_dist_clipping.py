"""Clipping in the step (``unscale_and_step(..., max_grad_norm=c)``) on a gloo world of 2, both
backends: the norm is the norm of the whole model across ranks, as ``clip_grad_norm_`` computes
it, and the params move as torch's loop moves them (``torch.amp.GradScaler.unscale_`` +
``clip_grad_norm_`` + ``step`` + ``update``):

* ``process_group`` with ``grads_across_ranks="sharded"``: each rank's optimizer owns its part of
  the model (a sharded optimizer); the reference is one torch optimizer over the whole model,
  clipped over all of it;
* DDP with ``process_group`` and ``grads_across_ranks="replicated"``: every rank holds the same
  grads of the whole model; the reference is torch's loop over the same DDP model on the same
  rank, whose ``clip_grad_norm_`` is the rank's own (not sqrt(world size) times it); without
  ``grads_across_ranks`` the clip is refused before anything changes;
* FSDP2 (``fully_shard``, DTensor params) and tensor parallel (``Colwise``/``RowwiseParallel``:
  params sharded on either dimension and a replicated bias): the reference is torch's AdamW over
  the same sharded model, clipped by ``clip_grad_norm_`` over the sharded params (its DTensor
  norm); on the emulated backend our kernels run on the local shards.

Every scenario clips on every step (the norm is above ``c``) but one, overflows on one rank at
one step (every rank skips, ``grad_norm`` is not finite), and runs in the one world the module
spawns.
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
from tests.support.launches import recorded_launches
from tests.support.references import kernels_mode
from tests.support.training import loss_of, make_model

STEPS = 5
OVERFLOW = (2, 1)  # (step, rank): an inf in that rank's grads
MAX_NORM = {0: 0.05, 1: 0.05, 2: 0.05, 3: 1e6, 4: 0.05}  # step 3 does not clip
INIT_SCALE = 2.0**10


def _torch_and_ours(name: str):
    options = {"momentum": 0.9} if name == "SGD" else {}
    return (
        functools.partial(getattr(torch.optim, name), lr=0.01, **options),
        functools.partial(getattr(scaledoptim, name), lr=0.01, **options),
    )


def _gathered(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _poison_if(step: int, rank: int, grads: list[torch.Tensor]) -> None:
    if (step, rank) == OVERFLOW:
        grads[0].view(-1)[0] = float("inf")


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)
    return (full_tensor() if full_tensor is not None else t).detach().clone()


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _scaled_backward(model, step: int, scale) -> None:
    model.zero_grad(set_to_none=True)
    (loss_of(model, step) * scale).backward()


def _process_group_norm_is_the_whole_models(
    name: str, backend: str, rank: int, world_size: int, tmp
) -> None:
    """A sharded optimizer: rank r steps params r, r + world_size, ... of the same model."""
    make_torch, make_ours = _torch_and_ours(name)
    model, reference = make_model(seed=3), make_model(seed=3)
    params = list(model.parameters())
    mine = params[rank::world_size]
    with kernels_mode(backend):
        opt = make_ours(mine).configure_scaling(
            init_scale=INIT_SCALE, process_group=dist.group.WORLD, grads_across_ranks="sharded"
        )
        ref_opt = make_torch(reference.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        for step in range(STEPS):
            _scaled_backward(model, step, opt.scale)
            _poison_if(step, rank, [p.grad for p in mine])
            _, found_inf, _ = opt.unscale_and_step(
                grads_scaled_by=opt.scale, max_grad_norm=MAX_NORM[step]
            )
            for i, param in enumerate(params):  # each owner sends its params (as ZeRO gathers)
                dist.broadcast(param.data, src=i % world_size)
            # torch's loop over the whole model, with the overflow wherever a rank had it
            reference.zero_grad(set_to_none=True)
            scaler.scale(loss_of(reference, step)).backward()
            if step == OVERFLOW[0]:
                owner = list(reference.parameters())[OVERFLOW[1] :: world_size][0]
                owner.grad.view(-1)[0] = float("inf")
            scaler.unscale_(ref_opt)
            total = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM[step])
            scaler.step(ref_opt)
            scaler.update()

            norm = opt.grad_norm
            assert norm is not None and norm.dtype == torch.float32 and norm.dim() == 0
            if step == OVERFLOW[0]:
                assert found_inf.item() == 1.0 and not math.isfinite(norm.item())
            else:
                assert found_inf.item() == 0.0
                torch.testing.assert_close(norm, total, rtol=1e-6, atol=0)
                assert (total > MAX_NORM[step]).item() == (step != 3)
            assert opt.scale.item() == scaler.get_scale()
            ref_params = list(reference.parameters())[rank::world_size]
            for ours, theirs in zip(mine, ref_params, strict=True):
                torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-7)
        norms = _gathered(opt.grad_norm.item())
        assert norms[0] == norms[1]  # every rank clipped by the same norm


def _dtensor_norm_is_the_sharded_models(
    layout: str, name: str, backend: str, rank: int, world_size: int, tmp
):
    """FSDP2 (every param ``Shard(0)``) or tensor parallel (``Shard(0)``, ``Shard(1)`` and a
    ``Replicate`` bias: no one sum of squares serves them all): ours and torch's optimizer over
    the same sharded model; on the emulated backend our kernels step the local shards (Note
    [DTensor steps on our kernels])."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    def sharded():
        model = make_model(seed=5)
        if layout == "tp":  # 16 hidden units: TP's forward takes even shards only
            torch.manual_seed(5)
            model = torch.nn.Sequential(
                torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
            )
            mesh = init_device_mesh("cpu", (world_size,))
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
            return parallelize_module(model, mesh, plan)
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        fully_shard(model)
        return model

    make_torch, make_ours = _torch_and_ours(name)
    model, reference = sharded(), sharded()
    with kernels_mode(backend), recorded_launches() as launched:
        opt = make_ours(model.parameters()).configure_scaling(
            init_scale=INIT_SCALE, process_group=dist.group.WORLD
        )
        ref_opt = make_torch(reference.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        for step in range(STEPS):
            _scaled_backward(model, step, opt.scale)
            _poison_if(step, rank, [_local(p.grad) for p in model.parameters()])
            _, found_inf, _ = opt.unscale_and_step(
                grads_scaled_by=opt.scale, max_grad_norm=MAX_NORM[step]
            )
            reference.zero_grad(set_to_none=True)
            scaler.scale(loss_of(reference, step)).backward()
            _poison_if(step, rank, [_local(p.grad) for p in reference.parameters()])
            scaler.unscale_(ref_opt)
            # GradScaler's found_inf is per rank: agree on it as ShardedGradScaler would.
            for found in scaler._per_optimizer_states[id(ref_opt)]["found_inf_per_device"].values():
                dist.all_reduce(found, op=dist.ReduceOp.MAX)
            total = _full(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM[step]))
            scaler.step(ref_opt)
            scaler.update()

            norm = opt.grad_norm
            assert norm is not None and norm.dim() == 0 and norm.dtype == torch.float32
            if step == OVERFLOW[0]:
                assert found_inf.item() == 1.0 and not math.isfinite(norm.item())
            else:
                assert found_inf.item() == 0.0
                torch.testing.assert_close(_full(norm), total, rtol=1e-6, atol=0)
            for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(_full(ours), _full(theirs), rtol=1e-5, atol=1e-7)
        assert len(set(_gathered(_full(opt.grad_norm).item()))) == 1
    # FSDP2's one sum comes from the check; tensor parallel's per tensor, from foreach norms
    check = "non_finite_check_norm_kernel" if layout == "fsdp2" else "non_finite_check_kernel"
    ours = [check, opt.kernel.name, "step_epilogue_kernel"]
    assert launched == (ours * STEPS if backend == "emulate" else [])


def _ddp_norm_is_each_ranks_own(name: str, backend: str, rank: int, world_size: int, tmp):
    """DDP: every rank's grads are the all-reduced ones; the norm is clip_grad_norm_'s on any
    rank, and the replicas stay identical."""
    from torch.nn.parallel import DistributedDataParallel

    make_torch, make_ours = _torch_and_ours(name)
    model = DistributedDataParallel(make_model(seed=7))
    reference = DistributedDataParallel(make_model(seed=7))
    with kernels_mode(backend):
        opt = make_ours(model.parameters()).configure_scaling(
            init_scale=INIT_SCALE, process_group=dist.group.WORLD, grads_across_ranks="replicated"
        )
        ref_opt = make_torch(reference.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        for step in range(STEPS):
            # each rank its own batch: DDP averages the grads
            model.zero_grad(set_to_none=True)
            (loss_of(model, 10 * step + rank) * opt.scale).backward()
            _poison_if(step, rank, [p.grad for p in model.parameters()])
            _, found_inf, _ = opt.unscale_and_step(
                grads_scaled_by=opt.scale, max_grad_norm=MAX_NORM[step]
            )
            reference.zero_grad(set_to_none=True)
            scaler.scale(loss_of(reference, 10 * step + rank)).backward()
            if step == OVERFLOW[0]:
                next(iter(reference.parameters())).grad.view(-1)[0] = float("inf")
            scaler.unscale_(ref_opt)
            total = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM[step])
            scaler.step(ref_opt)
            scaler.update()
            norm = opt.grad_norm
            assert norm is not None
            if step == OVERFLOW[0]:
                # one rank's inf, every rank skips (the other rank's grads are clean)
                assert found_inf.item() == 1.0
            else:
                assert found_inf.item() == 0.0
                torch.testing.assert_close(norm, total, rtol=1e-6, atol=0)
            assert opt.scale.item() == scaler.get_scale()
            for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-7)
        flat = torch.cat([p.detach().view(-1) for p in model.parameters()])
        replicas = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(replicas, flat)
        assert all(torch.equal(replicas[0], r) for r in replicas)


def _ddp_clip_without_grads_across_ranks_is_refused(rank: int, world_size: int, tmp) -> None:
    """process_group, plain params, no grads_across_ranks: refused before anything changes."""
    from tests.support.training import assert_bit_identical

    model = make_model(seed=1)
    opt = scaledoptim.AdamW(model.parameters(), lr=0.01)
    opt.configure_scaling(process_group=dist.group.WORLD)
    (loss_of(model, 0) * opt.scale).backward()
    before = [p.detach().clone() for p in model.parameters()] + [opt.scale.clone()]
    with pytest.raises(ValueError, match="grads_across_ranks='replicated'"):
        opt.unscale_and_step(grads_scaled_by=opt.scale, max_grad_norm=1.0)
    assert not any(opt.state[p] for p in model.parameters()) and opt.grad_norm is None
    assert_bit_identical(before, [p.detach() for p in model.parameters()] + [opt.scale])
    _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)  # without the clip: steps
    assert found_inf.item() == 0.0


def _mixed_params_are_refused(rank: int, world_size: int, tmp) -> None:
    """DTensor and plain params in one optimizer under process_group: refused, nothing changed."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from tests.support.training import assert_bit_identical

    mesh = init_device_mesh("cpu", (world_size,))
    sharded = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]))
    plain = torch.nn.Parameter(torch.randn(3))
    sharded.grad = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    plain.grad = torch.randn(3)
    opt = scaledoptim.AdamW([sharded, plain], lr=0.01)
    opt.configure_scaling(process_group=dist.group.WORLD)
    before = [sharded.to_local().clone(), plain.detach().clone(), opt.scale.clone()]
    with pytest.raises(ValueError, match="mix DTensors"):
        opt.unscale_and_step(grads_scaled_by=opt.scale, max_grad_norm=1.0)
    assert not opt.state[sharded] and not opt.state[plain] and opt.grad_norm is None
    assert_bit_identical(before, [sharded.to_local(), plain.detach(), opt.scale])


SCENARIOS = {
    "mixed-params-refused": _mixed_params_are_refused,
    "ddp-without-grads-across-ranks-refused": _ddp_clip_without_grads_across_ranks_is_refused,
    **{
        f"ddp-{name}-{backend}": functools.partial(_ddp_norm_is_each_ranks_own, name, backend)
        for name in ("AdamW", "SGD")
        for backend in ("torch", "emulate")
    },
    **{
        f"process-group-{name}-{backend}": functools.partial(
            _process_group_norm_is_the_whole_models, name, backend
        )
        for name in ("AdamW", "SGD")
        for backend in ("torch", "emulate")
    },
    **{
        f"{layout}-{name}-{backend}": functools.partial(
            _dtensor_norm_is_the_sharded_models, layout, name, backend
        )
        for layout in ("fsdp2", "tp")
        for name in ("AdamW",)
        for backend in ("torch", "emulate")
    },
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    return run_world(2, SCENARIOS, pathlib.Path(tmp_path_factory.mktemp("clipping")))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_clipping_norm_is_the_whole_models_across_ranks(outcomes, scenario) -> None:
    failure = outcomes[scenario]
    assert failure is None, failure
