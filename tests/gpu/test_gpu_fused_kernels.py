"""The fused kernels on a real GPU: parity with torch's fused optimizers, no host sync, and a
whole step captured in a CUDA graph. Skipped without a CUDA device (the CPU emulator tests in
tests/kernels cover the same kernels)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from scaledoptim import kernels
from tests.kernels.kernel_reference import (
    CUDA_KERNEL_MARKS,
    adam_options,
    checked_adam_step_,
    needs_cupy,  # noqa: F401 (the fixture CUDA_KERNEL_MARKS uses)
    sgd_options,
    ulp_distance,
    zero_adam_state,
)

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
        kernels.adam_(
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
        kernels.sgd_(ours, grads, buffers, steps, **options, found_inf=None, inv_scale=None)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def test_a_step_does_not_sync_with_the_host():
    params = [torch.randn(n, device="cuda") for n in SIZES]
    grads = [torch.randn(n, device="cuda") for n in SIZES]
    m, v, steps = zero_adam_state(params)
    buffers = [torch.zeros_like(p) for p in params]
    found_inf, inv_scale = torch.zeros((), device="cuda"), torch.full((), 0.5, device="cuda")

    def step():
        found_inf.zero_()
        kernels.non_finite_check_(grads, found_inf)
        kernels.adam_(
            params,
            grads,
            m,
            v,
            [],
            steps,
            **adam_options(weight_decay=0.0),
            found_inf=found_inf,
            inv_scale=inv_scale,
        )
        kernels.sgd_(
            params, grads, buffers, steps, **sgd_options(), found_inf=found_inf, inv_scale=None
        )

    step()  # compiles the kernels and builds the tables
    torch.cuda.synchronize()
    with sync_debug_error():
        step()
        step()
    torch.cuda.synchronize()


def test_a_whole_step_is_captured_and_replayed_in_a_cuda_graph():
    torch.manual_seed(0)
    params = [torch.randn(n, device="cuda") for n in SIZES]
    grads = [torch.randn(n, device="cuda") for n in SIZES]
    m, v, steps = zero_adam_state(params)
    found_inf, inv_scale = torch.zeros((), device="cuda"), torch.full((), 0.5, device="cuda")
    reference = (
        [t.clone() for t in params],
        [t.clone() for t in m],
        [t.clone() for t in v],
        [t.clone() for t in steps],
    )

    def step(params, m, v, steps):
        checked_adam_step_(params, grads, m, v, steps, found_inf, inv_scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, tables) outside the capture
        step(*[[t.clone() for t in ts] for ts in (params, m, v, steps)])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(params, m, v, steps)

    for replay in range(3):
        torch.manual_seed(replay)
        for g in grads:
            g.copy_(torch.randn(g.shape, device="cuda"))
        graph.replay()
        step(*reference)  # eager on copies
    torch.cuda.synchronize()
    for ours, theirs in zip((params, m, v, steps), reference):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    assert all(s.item() == 3 for s in steps)

    before = [t.clone() for t in (*params, *m, *v, *steps)]
    grads[2][1] = float("nan")
    graph.replay()  # found_inf set on device: the replayed step is skipped
    torch.cuda.synchronize()
    assert found_inf.item() == 1
    assert all(torch.equal(a, b) for a, b in zip(before, (*params, *m, *v, *steps)))
