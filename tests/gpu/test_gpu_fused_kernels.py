"""The fused kernels on a real GPU, driven by the fused rows of optim_db: every row's update
(every config, every param x grad dtype) against the row's reference, with no host sync, and a
whole step captured in a CUDA graph; the rows whose torch.optim class has a fused CUDA
implementation against it, with grad scaling. Skipped without a CUDA device (the CPU emulator
tests in tests/kernels cover the same kernels)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from scaledoptim import kernels
from scaledoptim.testing.optim_db import Config, OptimInfo, Tolerance, rows
from tests.support.gpu import CUDA_KERNEL_MARKS
from tests.support.launches import RowUpdate, check_parity, row_update
from tests.support.references import ulp_distance
from tests.support.tensors import DTYPES

pytestmark = list(CUDA_KERNEL_MARKS)

SIZES = (1, 3, 5, 4096 + 3, 3 * 65536 + 7)  # odd, sub-vector, multi-chunk
CONFIGS = [
    pytest.param(info, config, id=f"{info.name}-{config.name}")
    for info in rows(fused=True)
    for config in info.configs
]


@contextlib.contextmanager
def sync_debug_error():
    """Any host sync torch performs inside the block raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _torch_fused(info: OptimInfo, params: list[torch.Tensor], config: Config):
    """The row's torch.optim class with ``fused=True`` over CUDA ``params``, or a skip."""
    if info.reference is None:
        pytest.skip(f"torch.optim has no {info.name}")
    try:
        return info.reference_for(params, config, fused=True)
    except (RuntimeError, TypeError, ValueError) as error:
        pytest.skip(f"torch.optim.{info.name} takes no fused=True: {error}")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("info", rows(fused=True), ids=str)
def test_matches_torchs_fused_optimizer_with_grad_scaling(info, dtype):
    """Each row's default config against torch's fused CUDA kernel on the same scaled grads (as
    GradScaler.step runs a fused optimizer: grads divided by grad_scale in-kernel)."""
    torch.manual_seed(0)
    ours = [torch.randn(n, device="cuda").to(dtype) for n in SIZES]
    theirs = [p.clone().requires_grad_() for p in ours]
    torch_opt = _torch_fused(info, theirs, info.default)
    scale = torch.tensor(1024.0, device="cuda")
    inv_scale = scale.reciprocal()
    found_inf = torch.zeros((), device="cuda")
    grads = [torch.zeros_like(p) for p in ours]
    update = row_update(info, ours, grads, info.default)
    n_steps = 5 if dtype == torch.float32 else 1  # 16-bit params: one rounding, compared in ulps
    for step in range(n_steps):
        for g in grads:
            g.copy_((torch.randn(g.shape, device="cuda") * scale).to(dtype))
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        torch_opt.grad_scale, torch_opt.found_inf = scale, found_inf
        try:
            torch_opt.step()
        except (NotImplementedError, RuntimeError) as error:
            if step:
                raise
            pytest.skip(f"torch.optim.{info.name}(fused=True) does not run on CUDA: {error}")
        update.launch(found_inf, inv_scale)
    for a, b in zip(ours, theirs):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
        else:
            assert ulp_distance(a, b.detach()).max().item() <= 1
    if dtype == torch.float32:  # torch keeps a 16-bit param's state in its dtype, we in fp32
        for state, p in zip(update.state_dicts(), theirs):
            for key, value in state.items():
                if key != "step":
                    torch.testing.assert_close(value, torch_opt.state[p][key], rtol=1e-5, atol=1e-7)
    assert all(s.item() == n_steps for s in update.steps)


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
@pytest.mark.parametrize("info", rows(fused=True), ids=str)
def test_update_matches_its_reference_on_cuda(info, param_dtype, grad_dtype):
    for config in info.configs:
        params, grads = cuda_params_and_grads(param_dtype, grad_dtype)
        tolerance = Tolerance(
            *(
                max(a, b)
                for a, b in zip(vars(CUDA_TOLERANCE).values(), vars(info.tolerance).values())
            )
        )
        check_parity(info, config, params, grads, inv_scale=0.25, tolerance=tolerance)


def checked_step(update: RowUpdate, found_inf, inv_scale):
    """A loss-scaled step as the optimizer runs it on device: clear found_inf, check the grads,
    then the update (skipped where found_inf is set)."""
    found_inf.zero_()
    kernels.non_finite_check_(update.grads, found_inf)
    update.launch(found_inf, inv_scale)


@pytest.mark.parametrize("info", rows(fused=True), ids=str)
def test_a_step_does_not_sync_with_the_host(info):
    found_inf, inv_scale = torch.zeros((), device="cuda"), torch.full((), 0.5, device="cuda")
    for config in info.configs:
        params, grads = cuda_params_and_grads(torch.float32, torch.float32)
        update = row_update(info, params, grads, config)
        checked_step(update, found_inf, inv_scale)  # compiles, builds the tables
        torch.cuda.synchronize()
        with sync_debug_error():
            checked_step(update, found_inf, inv_scale)
            checked_step(update, found_inf, inv_scale)
        torch.cuda.synchronize()
        assert all(s.item() == 3 for s in update.steps)


@pytest.mark.parametrize(("info", "config"), CONFIGS)
def test_a_whole_step_is_captured_and_replayed_in_a_cuda_graph(info, config):
    params, grads = cuda_params_and_grads(torch.float32, torch.bfloat16)
    found_inf, inv_scale = torch.zeros((), device="cuda"), torch.full((), 0.5, device="cuda")

    def twin() -> RowUpdate:
        """The update on copies of the params, with state of its own: all share the grads."""
        return row_update(info, [p.clone() for p in params], grads, config)

    update, reference, warm_up = row_update(info, params, grads, config), twin(), twin()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, tables) outside the capture
        checked_step(warm_up, found_inf, inv_scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        checked_step(update, found_inf, inv_scale)

    for replay in range(3):
        torch.manual_seed(replay)
        for g in grads:
            g.copy_(torch.randn(g.shape, device="cuda"))
        graph.replay()
        checked_step(reference, found_inf, inv_scale)  # eager, on the copies
    torch.cuda.synchronize()
    for ours, theirs in zip(update.lists, reference.lists):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    assert all(s.item() == 3 for s in update.steps)

    written = [t for i, ts in enumerate(update.lists) if i != 1 for t in ts]
    before = [t.clone() for t in written]
    grads[2][1] = float("nan")
    graph.replay()  # found_inf set on device: the replayed step is skipped
    torch.cuda.synchronize()
    assert found_inf.item() == 1
    assert all(torch.equal(a, b) for a, b in zip(before, written))
