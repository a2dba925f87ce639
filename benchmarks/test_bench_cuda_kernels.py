"""Fused CUDA AdamW: step time against GradScaler + torch's fused AdamW, and achieved bandwidth.

Run on a GPU: ``python -m pytest benchmarks/test_bench_cuda_kernels.py -p no:cacheprovider``.
The bandwidth case reports (in ``extra_info`` and on stdout) the bytes a checked, unscaled AdamW
step must move -- 32 B/param for fp32 (read-only inf check 4; read p, g, m, v 16; write p, m, v 12)
-- per second, as a fraction of a device-to-device copy measured in the same run. The design
target is >= 0.9.
"""

from __future__ import annotations

import pytest
import torch

from scaledoptim import kernels
from scaledoptim.doctor.adamw_loops import SCALE, gradscaler_loop
from scaledoptim.testing.optim_db import row
from tests.support.gpu import (
    CUDA_KERNEL_MARKS,
    needs_cupy,  # noqa: F401 (the fixture CUDA_KERNEL_MARKS uses)
)
from tests.support.launches import row_update

pytestmark = list(CUDA_KERNEL_MARKS)

SHAPES = {"1x25M": [25_000_000], "500x10k": [10_000] * 500}
BYTES_PER_PARAM = 32


def _synchronized(step):
    def run():
        step()
        torch.cuda.synchronize()

    return run


def _scaled_grads(sizes):
    torch.manual_seed(0)
    return [torch.randn(n, device="cuda") * SCALE for n in sizes]


def _scaledoptim_step(sizes):
    """A loss-scaled AdamW step as the optimizer runs it on device (optim_db's AdamW row, with
    the baseline's hyper-parameters): clear found_inf, check the grads, then the update
    (unscaling in registers; skipped where found_inf is set)."""
    params = [torch.randn(n, device="cuda") for n in sizes]
    grads = _scaled_grads(sizes)
    update = row_update(row("AdamW"), params, grads, lr=1e-3, weight_decay=0.01)
    found_inf = torch.zeros((), device="cuda")
    inv_scale = torch.full((), 1 / SCALE, device="cuda")

    def step():
        found_inf.zero_()
        kernels.non_finite_check_(grads, found_inf)
        update.launch(found_inf, inv_scale)

    step()  # compile and build tables outside the timed rounds
    return step


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_gradscaler_fused_adamw_cuda(benchmark, shape) -> None:
    """GradScaler's ``step`` + ``update`` over torch's fused AdamW, on grads of a backward of
    ``scaler.scale(loss)`` (its ``step`` needs the scale that call creates)."""
    benchmark.group = f"adamw-step-cuda-{shape}"
    benchmark.extra_info["baseline"] = True
    loop = gradscaler_loop(SHAPES[shape], torch.device("cuda"))
    loop.step()
    benchmark.pedantic(_synchronized(loop.step), rounds=30, warmup_rounds=3)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_scaledoptim_fused_adamw_cuda(benchmark, shape) -> None:
    benchmark.group = f"adamw-step-cuda-{shape}"
    benchmark.pedantic(_synchronized(_scaledoptim_step(SHAPES[shape])), rounds=30, warmup_rounds=3)


def _copy_bandwidth(n_bytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * n_bytes * repeats / (start.elapsed_time(end) / 1e3)


def test_scaledoptim_adamw_bandwidth_vs_copy(benchmark) -> None:
    benchmark.group = "adamw-bandwidth-cuda"
    sizes = SHAPES["1x25M"]
    step = _scaledoptim_step(sizes)
    repeats = 20
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed_steps():
        start.record()
        for _ in range(repeats):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats

    seconds_per_step = benchmark.pedantic(timed_steps, rounds=5, warmup_rounds=1)  # the last round
    achieved = BYTES_PER_PARAM * sum(sizes) / seconds_per_step
    copy = _copy_bandwidth()
    benchmark.extra_info.update(
        achieved_gb_s=achieved / 1e9, copy_gb_s=copy / 1e9, fraction_of_copy=achieved / copy
    )
    print(
        f"\nAdamW {achieved / 1e9:.0f} GB/s at 32 B/param = {achieved / copy:.2f} of copy "
        f"({copy / 1e9:.0f} GB/s)"
    )
    assert (
        0 < achieved / copy < 1.5
    )  # sanity: a result above copy bandwidth means a bad measurement
