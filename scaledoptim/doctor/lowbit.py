"""AdamW with 8-bit states (``state_bits=8``): its update on the device's backend against its
torch form on CPU copies, and, on a GPU, its bytes per second as a fraction of a copy's.

Parity: our kernels (through CuPy on a GPU, the emulator on a CPU) and the torch form decode,
step and encode the same way (Note [block-wise codes], Note [dithered rounding]): the codes
agree but for an element whose two Adam updates (torch's fused op, cuda/adam.cu) differ in the
last bit across a code's boundary, the scales and params to float32 rounding; an inf then leaves
every byte as it was.
"""

from __future__ import annotations

import torch

import scaledoptim

from ..fused.backends import select
from .outcome import Outcome, kernels_env, same_bits, snapshot
from .performance import BANDWIDTH_FLOOR, BANDWIDTH_TARGET, _copy_bytes_per_second, seconds_per_call

__all__ = ["BYTES_PER_PARAM", "bandwidth", "parity"]

SIZES = (1, 33, 300, 1000)  # a block, part of one, several, and a tail
BLOCK_SIZE = 64
STEPS = 3
# Inf check reads g (4); the update reads p, g (8) and both moments' codes (2), writes p (4) and
# the codes (2); the scales, 2 x 4 bytes read and written per 256 elements: 0.0625. (Its second
# pass over a block rereads what the first read, from cache: Note [low-bit blocks in a chunk].)
BYTES_PER_PARAM = 4 + 8 + 2 + 4 + 2 + 16 / 256
N_PARAMS = 1 << 25
SCALE = 2.0**16  # the grads are scaled as the default loss scale scales them


def _run(params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> scaledoptim.AdamW:
    opt = scaledoptim.AdamW(params, lr=1e-2, state_bits=8, block_size=BLOCK_SIZE)
    for step in range(STEPS):
        for p, g in zip(params, grads):
            p.grad = (g * (step + 1)).to(p.device)
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    return opt


def parity(device: torch.device) -> Outcome:
    """Fails naming the first state or param out of tolerance, or a skip that changed a byte."""
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(n, generator=generator) for n in SIZES]
    grads = [torch.randn(n, generator=generator) * SCALE for n in SIZES]
    with kernels_env(None if device.type == "cuda" else "emulate"):
        backend = select(device).name
        params = [torch.nn.Parameter(t.to(device, copy=True)) for t in start]
        ours = _run(params, grads)
    with kernels_env("torch"):
        reference_params = [torch.nn.Parameter(t.clone()) for t in start]
        reference = _run(reference_params, grads)
    for i, (p, r) in enumerate(zip(params, reference_params)):
        if not torch.allclose(p.detach().cpu(), r.detach(), rtol=1e-5, atol=1e-6):
            return Outcome(False, f"param[{i}] of {p.numel()} elements differs from the torch form")
        for key, value in reference.state[r].items():
            got = ours.state[p][key].cpu()
            if key.endswith("_codes"):
                steps = (got.int() - value.int()).abs()
                if steps.max() > 1 or steps.float().mean() > 0.01:
                    return Outcome(False, f"param[{i}] {key}: codes differ by up to {steps.max()}")
            elif not torch.allclose(got, value, rtol=1e-5, atol=0):
                return Outcome(False, f"param[{i}] {key} differs from the torch form")
    with kernels_env(None if device.type == "cuda" else "emulate"):
        for p, g in zip(params, grads):
            p.grad = g.to(device)
        params[-1].grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        before = snapshot(ours, scale=False)
        ours.unscale_and_step(grads_scaled_by=ours.scale)
        after = snapshot(ours, scale=False)
    difference = same_bits(before, after)
    if difference is not None:
        return Outcome(False, f"a step with an inf grad changed something: {difference}")
    return Outcome(
        True,
        f"{backend} backend, {STEPS} steps of 8-bit AdamW match its torch form, inf step skipped",
    )


def bandwidth(device: torch.device, n_params: int = N_PARAMS) -> Outcome:
    """8-bit AdamW's ``unscale_and_step`` in bytes per second, over a copy's; fails below the
    float32 step's floor."""
    param = torch.nn.Parameter(torch.randn(n_params, device=device) * 0.02)
    opt = scaledoptim.AdamW([param], lr=1e-3, state_bits=8)
    param.grad = torch.randn_like(param) * SCALE * 1e-3
    seconds = seconds_per_call(lambda: opt.unscale_and_step(grads_scaled_by=opt.scale), device)
    copy_rate = _copy_bytes_per_second(device, int(BYTES_PER_PARAM * n_params))
    achieved = BYTES_PER_PARAM * n_params / seconds
    fraction = achieved / copy_rate
    return Outcome(
        BANDWIDTH_FLOOR <= fraction,
        f"{achieved / 1e9:.0f} GB/s at {BYTES_PER_PARAM:.2f} B/param (float32 states: 32) = "
        f"{fraction:.2f} of copy ({copy_rate / 1e9:.0f} GB/s), 8-bit AdamW unscale_and_step, "
        f"{select(device).name} backend; target >= {BANDWIDTH_TARGET}, fails below "
        f"{BANDWIDTH_FLOOR}",
    )
