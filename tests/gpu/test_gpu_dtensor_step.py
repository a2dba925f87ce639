"""A DTensor step on one device, as the GPU report runs it: FSDP2 (``fully_shard``) on a world of
one process, ``scaledoptim.AdamW`` stepping the local shards with our kernels (Note [DTensor
steps on our kernels]), against ``torch.optim.AdamW`` + ``torch.amp.GradScaler`` on the same
model unsharded, with an overflow on one step. On a CUDA device (NCCL, our kernels through
CuPy: marked ``gpu``) and on the CPU (gloo, the same kernels in the emulator), which runs in the
suite without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import scaledoptim
from scaledoptim.doctor.sync_free import no_host_reads
from tests.support.launches import recorded_launches
from tests.support.references import kernels_mode

OVERFLOW_STEP = 2
STEPS = 4


@pytest.fixture
def world_of_one(device: torch.device):
    """A process group of this process alone (an in-process store: no port), for ``device``."""
    if not dist.is_available():
        pytest.skip("needs torch.distributed")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model(device: torch.device) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = (torch.nn.Linear(8, 33), torch.nn.Tanh(), torch.nn.Linear(33, 4))
    return torch.nn.Sequential(*layers).to(device)


def _loss(model: torch.nn.Module, step: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator)
    return torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))


def test_a_dtensor_step_on_one_device_follows_torch(device, world_of_one) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, init_device_mesh

    mesh = init_device_mesh(device.type, (1,))
    model = _model(device)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    mode = "cupy" if device.type == "cuda" else "emulate"
    found = []
    with kernels_mode(mode), recorded_launches() as launched:
        opt = scaledoptim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        opt.configure_scaling(init_scale=2.0**10, growth_interval=2)
        for step in range(STEPS):
            opt.zero_grad()
            scaledoptim.scale_outputs(_loss(model, step, device), opt.scale).backward()
            if step == OVERFLOW_STEP:
                model[0].weight.grad.to_local()[0, 0] = float("inf")
            with no_host_reads():  # nothing reads the device between backward and step's end
                _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
            found.append(found_inf.item())
    assert launched.count("adam_kernel") >= STEPS  # our kernels, on the local shards
    assert all(isinstance(v, DTensor) for p in model.parameters() for v in _moments(opt, p))

    reference = _model(device)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
    ref_found = []
    for step in range(STEPS):
        ref_opt.zero_grad()
        scaler.scale(_loss(reference, step, device)).backward()
        if step == OVERFLOW_STEP:
            reference[0].weight.grad[0, 0] = float("inf")
        scale = scaler.get_scale()
        scaler.step(ref_opt)
        scaler.update()
        ref_found.append(float(scaler.get_scale() < scale))
    assert found == ref_found == [float(step == OVERFLOW_STEP) for step in range(STEPS)]
    assert opt.scale.item() == scaler.get_scale()
    for param, twin in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.full_tensor(), twin.detach(), rtol=1e-5, atol=1e-6)


def _moments(opt: scaledoptim.Optimizer, param: torch.Tensor) -> list[torch.Tensor]:
    return [v for k, v in opt.state[param].items() if k != "step"]
