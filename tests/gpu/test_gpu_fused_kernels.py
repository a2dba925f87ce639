"""The fused kernels on a real GPU: every update kernel of KERNEL_CASES against its reference,
with no host sync, and a whole step captured in a CUDA graph; AdamW and SGD against torch's fused
optimizers. Skipped without a CUDA device (the CPU emulator tests in tests/kernels cover the same
kernels)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import scaledoptim
from scaledoptim import kernels
from tests.kernels.kernel_reference import (
    CUDA_KERNEL_MARKS,
    DTYPES,
    adam_options,
    needs_cupy,  # noqa: F401 (the fixture CUDA_KERNEL_MARKS uses)
    ulp_distance,
    zero_adam_state,
)
from tests.kernels.kernel_table import UPDATE_CASES, Tolerance, case_id, check_parity, launch_case

pytestmark = list(CUDA_KERNEL_MARKS)

SIZES = (1, 3, 5, 4096 + 3, 3 * 65536 + 7)  # odd, sub-vector, multi-chunk


@contextlib.contextmanager
def sync_debug_error():
    """Any host sync torch performs inside the block raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_adamw_matches_torch_fused_adamw_with_grad_scaling(dtype):
    torch.manual_seed(0)
    ours = [torch.randn(n, device="cuda").to(dtype) for n in SIZES]
    theirs = [p.clone().requires_grad_() for p in ours]
    torch_opt = torch.optim.AdamW(theirs, lr=1e-3, weight_decay=0.01, fused=True)
    m, v, steps = zero_adam_state(ours)
    scale = torch.tensor(1024.0, device="cuda")
    inv_scale = scale.reciprocal()
    found_inf = torch.zeros((), device="cuda")
    n_steps = 5 if dtype == torch.float32 else 1  # 16-bit params: one rounding, compared in ulps
    for _ in range(n_steps):
        grads = [(torch.randn(p.shape, device="cuda") * scale).to(dtype) for p in ours]
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        # As GradScaler.step does for fused optimizers: grads are divided by grad_scale in-kernel.
        torch_opt.grad_scale, torch_opt.found_inf = scale, found_inf
        torch_opt.step()
        scaledoptim.optim.adam.adam_(
            ours,
            grads,
            m,
            v,
            [],
            steps,
            **adam_options(),
            found_inf=found_inf,
            inv_scale=inv_scale,
        )
    for a, b in zip(ours, theirs):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
        else:
            assert ulp_distance(a, b.detach()).max().item() <= 1
    for a, b in zip(m, theirs):
        torch.testing.assert_close(a, torch_opt.state[b]["exp_avg"], rtol=1e-5, atol=1e-7)
    assert all(s.item() == n_steps for s in steps)


def test_sgd_matches_torch_fused_sgd():
    torch.manual_seed(0)
    ours = [torch.randn(n, device="cuda") for n in SIZES]
    theirs = [p.clone().requires_grad_() for p in ours]
    options = dict(
        lr=0.1, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=1e-4, maximize=False
    )
    torch_opt = torch.optim.SGD(theirs, fused=True, **options)
    buffers = [torch.empty_like(p) for p in ours]
    steps = [torch.zeros((), device="cuda") for _ in ours]
    for _ in range(4):
        grads = [torch.randn(p.shape, device="cuda") for p in ours]
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        torch_opt.step()
        scaledoptim.optim.sgd.sgd_(ours, grads, buffers, steps, **options, found_inf=None, inv_scale=None)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def cuda_params_and_grads(param_dtype, grad_dtype, seed=0):
    """A param and a grad of each of SIZES, plus a misaligned view each (storage offset 1)."""
    generator = torch.Generator().manual_seed(seed)

    def tensors(dtype):
        ts = [torch.randn(n, generator=generator).to("cuda", dtype) for n in SIZES]
        storage = torch.randn(SIZES[-1] + 1, generator=generator).to("cuda", dtype)
        return [*ts, storage[1:]]

    return tensors(param_dtype), tensors(grad_dtype)


# The GPU's expf/logf/sqrtf are not the CPU's: fp32 results agree to a few ulps of accumulation.
CUDA_TOLERANCE = Tolerance(param_rtol=1e-5, param_atol=1e-6, state_rtol=1e-5, state_atol=1e-7)


@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("param_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", UPDATE_CASES, ids=case_id)
def test_update_kernel_matches_its_reference_on_cuda(case, param_dtype, grad_dtype):
    for options in case.all_options():
        params, grads = cuda_params_and_grads(param_dtype, grad_dtype)
        check_parity(case, params, grads, options, inv_scale=0.25, tolerance=CUDA_TOLERANCE)


def checked_step(case, lists, options, found_inf, inv_scale):
    """A loss-scaled step as the optimizer runs it on device: clear found_inf, check the grads,
    then the update (skipped where found_inf is set)."""
    found_inf.zero_()
    kernels.non_finite_check_(lists[1], found_inf)
    launch_case(case, lists, options, found_inf, inv_scale)


@pytest.mark.parametrize("case", UPDATE_CASES, ids=case_id)
def test_a_step_does_not_sync_with_the_host(case):
    found_inf, inv_scale = torch.zeros((), device="cuda"), torch.full((), 0.5, device="cuda")
    for options in case.all_options():
        params, grads = cuda_params_and_grads(torch.float32, torch.float32)
        lists = case.make_lists(params, grads, options, torch.Generator().manual_seed(0))
        checked_step(case, lists, options, found_inf, inv_scale)  # compiles, builds the tables
        torch.cuda.synchronize()
        with sync_debug_error():
            checked_step(case, lists, options, found_inf, inv_scale)
            checked_step(case, lists, options, found_inf, inv_scale)
        torch.cuda.synchronize()
        assert all(s.item() == 3 for s in lists[-1])


@pytest.mark.parametrize("case", UPDATE_CASES, ids=case_id)
def test_a_whole_step_is_captured_and_replayed_in_a_cuda_graph(case):
    options = case.all_options()[-1]  # the grid's last row (Adam, SGD: every option on)
    params, grads = cuda_params_and_grads(torch.float32, torch.bfloat16)
    lists = case.make_lists(params, grads, options, torch.Generator().manual_seed(0))
    found_inf, inv_scale = torch.zeros((), device="cuda"), torch.full((), 0.5, device="cuda")
    # The eager copies share the grads (list 1) with the captured step.
    reference = [ts if i == 1 else [t.clone() for t in ts] for i, ts in enumerate(lists)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, tables) outside the capture
        warm_up = [ts if i == 1 else [t.clone() for t in ts] for i, ts in enumerate(lists)]
        checked_step(case, warm_up, options, found_inf, inv_scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        checked_step(case, lists, options, found_inf, inv_scale)

    for replay in range(3):
        torch.manual_seed(replay)
        for g in grads:
            g.copy_(torch.randn(g.shape, device="cuda"))
        graph.replay()
        checked_step(case, reference, options, found_inf, inv_scale)  # eager on copies
    torch.cuda.synchronize()
    for ours, theirs in zip(lists, reference):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    assert all(s.item() == 3 for s in lists[-1])

    written = [t for i, ts in enumerate(lists) if i != 1 for t in ts]
    before = [t.clone() for t in written]
    grads[2][1] = float("nan")
    graph.replay()  # found_inf set on device: the replayed step is skipped
    torch.cuda.synchronize()
    assert found_inf.item() == 1
    assert all(torch.equal(a, b) for a, b in zip(before, written))
