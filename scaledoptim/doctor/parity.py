"""Each fused optimizer, in each param dtype, against its reference on CPU copies: torch.optim's
class in fp32, or (where torch has none) the optimizer's own torch form in float64.

On a GPU the optimizer runs on it (our kernels through CuPy, or torch's fused ops without CuPy);
on a CPU through our kernels' emulator. Each step starts the reference from our current state, so
a 16-bit param is held to the fp32 result rounded once: within one ulp of its dtype (fp32: 1e-6
relative). Then an inf in a grad must leave params and state bit-identical and halve the scale.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from ..testing.optim_db import OptimInfo
from .optimizers import ours
from .outcome import Outcome, backend_label, kernels_env, same_bits, snapshot

__all__ = ["run"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SIZES = (1, 5, 33, 130)  # sub-vector, odd, and a few vectors: small, so the check is quick
STEPS = 3
INIT_SCALE = 2.0**10  # fp16 grads times the scale stay finite


def run(row: OptimInfo, device: torch.device) -> Outcome:
    """Runs the comparison for every dtype; fails on the first mismatch, naming it."""
    with kernels_env(None if device.type == "cuda" else "emulate"):
        backend = backend_label(device)
        for dtype in DTYPES:
            problem = _compare(row, dtype, device)
            if problem is not None:
                return Outcome(False, f"{str(dtype).removeprefix('torch.')}: {problem}")
    return Outcome(
        True,
        f"{backend}, {STEPS} steps x fp32/fp16/bf16 within tolerance, inf step skipped",
    )


def _compare(row: OptimInfo, dtype: torch.dtype, device: torch.device) -> str | None:
    generator = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(n, generator=generator).to(device, dtype)) for n in SIZES
    ]
    opt = ours(row, params).configure_scaling(init_scale=INIT_SCALE)
    for step in range(STEPS):
        grads = [torch.randn(n, generator=generator).to(dtype) for n in SIZES]
        expected = _reference_step(row, opt, params, [g.float() for g in grads])
        for p, g in zip(params, grads):  # scaled by a power of two: unscaling is exact
            p.grad = (g.float() * opt.scale.item()).to(device, dtype)
        opt.unscale_and_step(grads_scaled_by=opt.scale)
        for i, (p, e) in enumerate(zip(params, expected)):
            problem = _mismatch(p.detach().cpu(), e)
            if problem is not None:
                return f"step {step + 1}, param[{i}] of {p.numel()} elements: {problem}"
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(device, dtype)
    last_grad = params[-1].grad
    assert last_grad is not None  # set just above
    last_grad.view(-1)[-1] = float("inf")
    before, scale = snapshot(opt, scale=False), opt.scale.item()
    _, found_inf, new_scale = opt.unscale_and_step(grads_scaled_by=opt.scale)
    after = snapshot(opt, scale=False)
    assert found_inf is not None and new_scale is not None  # grads_scaled_by was given
    if found_inf.item() != 1.0 or new_scale.item() != scale / 2:
        return f"an inf grad gave found_inf={found_inf.item()}, scale {scale} -> {new_scale.item()}"
    difference = same_bits(before, after)
    if difference is not None:
        return f"a step with an inf grad changed something: {difference}"
    return None


def _reference_step(
    row: OptimInfo,
    opt: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    grads: list[torch.Tensor],
) -> list[torch.Tensor]:
    """The reference's step from our current state, on CPU copies (fp32, or float64 for the
    optimizer's own torch form, which runs on torch's ops), rounded once."""
    dtype = row.reference_dtype or torch.float32
    # copy=True: on the CPU, .cpu().float() of an fp32 param would be the param itself
    ref_params = [torch.nn.Parameter(p.detach().to("cpu", dtype, copy=True)) for p in params]
    state_dict = copy.deepcopy(opt.state_dict())
    state_dict.pop("loss_scale")
    for group in state_dict["param_groups"]:  # and the copy each group carries for DCP
        group.pop("loss_scale", None)
    state_dict["state"] = {  # on the CPU, as the reference's params are
        i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in state_dict["state"].items()
    }
    with kernels_env("torch"):
        ref = row.reference_for(ref_params)
        ref.load_state_dict(state_dict)
        for p, g in zip(ref_params, grads):
            p.grad = g.to(dtype)
        ref.step()
    return [r.detach().to(p.dtype, copy=True) for r, p in zip(ref_params, params)]


def _mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    """16-bit: one ulp of the dtype. fp32: 1e-6 relative, where an element that cancels down to a
    small value is held to 1e-6 of the tensor's largest magnitude (kernels fuse multiply-adds
    that torch rounds separately). As the parity table (tests/parity) holds every path."""
    if actual.dtype == torch.float32:
        rtol, atol = 1e-6, 1e-6 * expected.abs().max().item()
    else:
        info = torch.finfo(actual.dtype)
        rtol, atol = info.eps, info.tiny
    try:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)
    except AssertionError as error:
        return " ".join(str(error).split())
    return None
