"""DTensor and plain params in one fused optimizer (tensor parallel leaves the modules it does
not parallelize plain), on a gloo world of 2, on both backends: every step runs, with and
without clipping, and follows torch.optim + GradScaler over the same tensors unsharded (Lion
and LAMB, which torch lacks: our own on the unsharded tensors); an overflow in one rank's shard,
or in a plain grad on one rank only, skips the step on every rank (Note [DTensor steps on our
kernels]). What the step cannot take on local shards beside plain params is refused before
anything changes, naming the fix.
"""

from __future__ import annotations

import functools
import pathlib

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world

import scaledoptim
from tests.support.references import kernels_mode
from tests.support.training import assert_bit_identical

OPTIMIZERS = ("AdamW", "SGD", "Adagrad", "RMSprop", "Lion", "LAMB")
SHAPES = ((3, 5), (6, 4), (4,), (4, 8))  # plain, Shard(0), Replicate, Shard(1)
STEPS = 6
#: step -> (the param whose grad gets an inf, the rank that puts it there): a DTensor's shard on
#: rank 1, a plain grad on rank 0 only.
INJECTED = {2: (1, 1), 4: (0, 0)}
CLIP = 0.5  # the grads' norm is about 8: every clipping step clips


def _options(name: str) -> dict[str, float]:
    if name in ("SGD", "RMSprop"):
        return {"momentum": 0.9, "weight_decay": 0.01}
    if name == "LAMB":
        return {"weight_decay": 0.1, "max_grad_norm": 1.0}
    return {"weight_decay": 0.01}


def _full_grad(step: int, index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + index)
    return torch.randn(SHAPES[index], generator=generator)  # the same on every rank


def _weights() -> list[torch.Tensor]:
    return [
        torch.randn(shape, generator=torch.Generator().manual_seed(i))
        for i, shape in enumerate(SHAPES)
    ]


def _placements():
    from torch.distributed.tensor import Replicate, Shard

    return (None, [Shard(0)], [Replicate()], [Shard(1)])


def _train_mixed(name: str, clip: float | None, rank: int, mesh):
    """Ours over a plain param and three DTensors; the skips, the scales and the params' full
    values after each step."""
    from torch.distributed.tensor import distribute_tensor

    params = [
        torch.nn.Parameter(w if p is None else distribute_tensor(w, mesh, p))
        for w, p in zip(_weights(), _placements())
    ]
    opt = getattr(scaledoptim, name)(params, lr=1e-2, **_options(name))
    opt.configure_scaling(init_scale=2.0**8, growth_interval=2)
    found, scales = [], []
    for step in range(STEPS):
        S = opt.scale.item()
        for i, (param, placements) in enumerate(zip(params, _placements())):
            grad = _full_grad(step, i) * S
            param.grad = grad if placements is None else distribute_tensor(grad, mesh, placements)
        index, on_rank = INJECTED.get(step, (None, None))
        if on_rank == rank:
            grad = params[index].grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
        before = [_full(p).clone() for p in params]
        _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale, max_grad_norm=clip)
        found.append(found_inf.item())
        scales.append(opt.scale.item())
        if found[-1]:
            assert_bit_identical(before, [_full(p) for p in params])
    return found, scales, [_full(p).detach().clone() for p in params]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _train_reference(name: str, clip: float | None, world_size: int):
    """The same steps over the unsharded tensors: torch.optim + GradScaler, or (Lion, LAMB) our
    own on torch's ops. An inf put into a shard lands where that shard is in the whole grad."""
    params = [torch.nn.Parameter(w) for w in _weights()]
    found, scales = [], []
    if name in ("Lion", "LAMB"):
        with kernels_mode("torch"):
            opt = getattr(scaledoptim, name)(params, lr=1e-2, **_options(name))
            opt.configure_scaling(init_scale=2.0**8, growth_interval=2)
            for step in range(STEPS):
                S = opt.scale.item()
                for i, param in enumerate(params):
                    param.grad = _full_grad(step, i) * S
                _inject(params, step, world_size)
                _, found_inf, _ = opt.unscale_and_step(
                    grads_scaled_by=opt.scale, max_grad_norm=clip
                )
                found.append(found_inf.item())
                scales.append(opt.scale.item())
        return found, scales, [p.detach() for p in params]
    ref_opt = getattr(torch.optim, name)(params, lr=1e-2, **_options(name))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    scaler.scale(torch.ones(()))  # creates its scale: the grads below come scaled already
    for step in range(STEPS):
        S = scaler.get_scale()
        for i, param in enumerate(params):
            param.grad = _full_grad(step, i) * S
        _inject(params, step, world_size)
        if clip is not None:
            scaler.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_(params, clip)
        scaler.step(ref_opt)
        scaler.update()
        found.append(float(scaler.get_scale() < S))
        scales.append(scaler.get_scale())
    return found, scales, [p.detach() for p in params]


def _inject(params: list[torch.Tensor], step: int, world_size: int) -> None:
    """The inf of ``INJECTED`` where it lands in the whole grad: the first element of rank 1's
    Shard(0) rows, or a plain grad's first element."""
    if step not in INJECTED:
        return
    index, on_rank = INJECTED[step]
    grad = params[index].grad
    assert grad is not None
    rows = -(-grad.shape[0] // world_size) if index == 1 else 0  # torch's even split: ceil
    grad[on_rank * rows if index == 1 else 0].view(-1)[0] = float("inf")


def _mixed_like_unsharded(
    name: str, backend: str, clip: float | None, rank: int, world_size: int, tmp
) -> None:
    from torch.distributed.tensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    with kernels_mode(backend):
        found, scales, params = _train_mixed(name, clip, rank, mesh)
    ref_found, ref_scales, ref_params = _train_reference(name, clip, world_size)
    seen = [None] * world_size
    dist.all_gather_object(seen, (found, scales))  # first: one verdict on every rank
    assert all(s == seen[0] for s in seen)
    assert found == ref_found == [float(step in INJECTED) for step in range(STEPS)]
    assert scales == ref_scales
    for param, twin in zip(params, ref_params):
        torch.testing.assert_close(param, twin, rtol=1e-5, atol=1e-6)


def _partial_beside_plain_is_refused(backend: str, rank: int, world_size: int, tmp) -> None:
    """A Partial DTensor (values not summed yet) cannot step on its local shard: beside a plain
    param it is refused before anything changes, naming the fix."""
    from torch.distributed.tensor import DTensor, Partial, init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    with kernels_mode(backend):
        partial = torch.nn.Parameter(DTensor.from_local(torch.randn(6, 4), mesh, [Partial()]))
        partial.grad = DTensor.from_local(torch.randn(6, 4), mesh, [Partial()])
        plain = torch.nn.Parameter(torch.randn(3))
        plain.grad = torch.randn(3)
        opt = scaledoptim.AdamW([plain, partial], lr=1e-2)
        before = [plain.detach().clone(), partial.to_local().clone(), opt.scale.clone()]
        grads = [plain.grad.clone(), partial.grad.to_local().clone()]
        with pytest.raises(ValueError, match=r"mix plain tensors and \['DTensor'\].*Replicate"):
            opt.unscale_and_step(grads_scaled_by=opt.scale)
        assert not opt.state[plain] and not opt.state[partial]
        assert_bit_identical(
            before + grads,
            [plain.detach(), partial.to_local(), opt.scale, plain.grad, partial.grad.to_local()],
        )


SCENARIOS = {
    **{
        f"{name}-{backend}-{'clip' if clip else 'no-clip'}": functools.partial(
            _mixed_like_unsharded, name, backend, clip
        )
        for name in OPTIMIZERS
        for backend in ("torch", "emulate")
        for clip in (None, CLIP)
    },
    **{
        f"partial-beside-plain-refused-{backend}": functools.partial(
            _partial_beside_plain_is_refused, backend
        )
        for backend in ("torch", "emulate")
    },
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    return run_world(2, SCENARIOS, pathlib.Path(tmp_path_factory.mktemp("mixed")))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_dtensor_and_plain_params_step_in_one_optimizer(outcomes, scenario) -> None:
    failure = outcomes[scenario]
    assert failure is None, failure
