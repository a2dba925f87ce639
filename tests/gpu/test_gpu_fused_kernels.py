"""The fused kernels on a real GPU, driven by the fused rows of optim_db: every row's update
(every config, every param x grad dtype) against the row's reference, with no host sync, and a
whole step captured in a CUDA graph; the rows whose torch.optim class has a fused CUDA
implementation against it, with grad scaling.

Each test body but the sync check also runs on the CPU once per row (the ``device`` fixture of
conftest.py: our kernels in the emulator, a plain call for the graph's capture and replay), so a
failure of the harness shows without a GPU, and one that shows only on a GPU points at the
device; every config, dtype and layout runs emulated in the parity table (tests/parity), and a
twin of each here would repeat it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch

from scaledoptim import kernels
from scaledoptim.kernels import launch_config
from scaledoptim.testing.optim_db import Config, OptimInfo, Tolerance, rows
from tests.support.gpu import CUDA_KERNEL_MARKS
from tests.support.launches import RowUpdate, check_parity, row_update
from tests.support.references import ulp_distance
from tests.support.tensors import DTYPES


def sizes() -> tuple[int, ...]:
    """Odd, sub-vector, within one chunk, and across chunks: on a GPU (chunks of 65536)
    1, 3, 5, 4099 and 196615 elements."""
    chunk = launch_config.chunk_size
    return (1, 3, 5, chunk // 16 + 3, 3 * chunk + 7)


@contextlib.contextmanager
def sync_debug_error():
    """Any host sync torch performs inside the block raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _torch_fused(info: OptimInfo, params: list[torch.Tensor], config: Config):
    """The row's torch.optim class with ``fused=True`` over ``params``, or a skip."""
    if info.reference is None:
        pytest.skip(f"torch.optim has no {info.name}")
    try:
        return info.reference_for(params, config, fused=True)
    except (RuntimeError, TypeError, ValueError) as error:
        pytest.skip(f"torch.optim.{info.name} takes no fused=True: {error}")


def _on_cuda_and_once_emulated(*cases: tuple, emulated: tuple) -> list:
    """``cases`` on a CUDA device (marked ``gpu``), and ``emulated`` on the CPU's emulator."""
    def name(values: tuple) -> str:
        return "-".join(map(str, values))

    return [
        *(pytest.param("cuda", *case, marks=pytest.mark.gpu, id=f"cuda-{name(case)}")
          for case in cases),
        *(pytest.param("emulated", *case, id=f"emulated-{name(case)}") for case in emulated),
    ]


@pytest.mark.parametrize(
    ("device", "info", "dtype"),
    _on_cuda_and_once_emulated(
        *((info, dtype) for info in rows(fused=True)
          for dtype in (torch.float32, torch.bfloat16, torch.float16)),
        emulated=tuple((info, torch.float32) for info in rows(fused=True)),
    ),
    indirect=["device"],
)
def test_matches_torchs_fused_optimizer_with_grad_scaling(info, dtype, device):
    """Each row's default config against torch's fused kernel on the same scaled grads (as
    GradScaler.step runs a fused optimizer: grads divided by grad_scale in-kernel)."""
    if device.type == "cpu" and dtype != torch.float32:
        # torch's CPU fused SGD and Adagrad put 16-bit params thousands of ulp from its CUDA
        # ones and from torch.optim's single-tensor form (one step, default configs; not looked
        # into further): no reference for 16-bit on a CPU. test_update_matches_its_reference
        # holds every row's 16-bit params to torch.optim there.
        pytest.skip("torch's CPU fused kernels are no 16-bit reference")
    torch.manual_seed(0)
    ours = [torch.randn(n, device=device).to(dtype) for n in sizes()]
    theirs = [p.clone().requires_grad_() for p in ours]
    torch_opt = _torch_fused(info, theirs, info.default)
    scale = torch.tensor(1024.0, device=device)
    inv_scale = scale.reciprocal()
    found_inf = torch.zeros((), device=device)
    grads = [torch.zeros_like(p) for p in ours]
    update = row_update(info, ours, grads, info.default)
    n_steps = 5 if dtype == torch.float32 else 1  # 16-bit params: one rounding, compared in ulps
    for step in range(n_steps):
        for g in grads:
            g.copy_((torch.randn(g.shape, device=device) * scale).to(dtype))
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        torch_opt.grad_scale, torch_opt.found_inf = scale, found_inf
        try:
            torch_opt.step()
        except (NotImplementedError, RuntimeError) as error:
            if step:
                raise
            pytest.skip(f"torch.optim.{info.name}(fused=True) does not run on {device}: {error}")
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


def params_and_grads(device, param_dtype, grad_dtype, seed=0):
    """A param and a grad of each of :func:`sizes`, plus a misaligned view each (storage
    offset 1)."""
    generator = torch.Generator().manual_seed(seed)

    def tensors(dtype):
        ts = [torch.randn(n, generator=generator).to(device, dtype) for n in sizes()]
        storage = torch.randn(sizes()[-1] + 1, generator=generator).to(device, dtype)
        return [*ts, storage[1:]]

    return tensors(param_dtype), tensors(grad_dtype)


# The GPU's expf/logf/sqrtf are not the CPU's: fp32 results agree to a few ulps of accumulation.
CUDA_TOLERANCE = Tolerance(param_rtol=1e-5, param_atol=1e-6, state_rtol=1e-5, state_atol=1e-7)


# Every dtype pair on a GPU; on the CPU one pair, which runs this test's harness (its sizes and
# tolerances) once: the parity table runs every config emulated.
DEVICE_AND_DTYPES = [
    *(
        pytest.param("cuda", param, grad, marks=pytest.mark.gpu, id=f"cuda-{param}-{grad}")
        for param in DTYPES
        for grad in DTYPES
    ),
    pytest.param("emulated", torch.bfloat16, torch.float16, id="emulated-bfloat16-float16"),
]


@pytest.mark.parametrize(
    ("device", "param_dtype", "grad_dtype"), DEVICE_AND_DTYPES, indirect=["device"]
)
@pytest.mark.parametrize("info", rows(fused=True), ids=str)
def test_update_matches_its_reference(info, param_dtype, grad_dtype, device):
    for config in info.configs:
        params, grads = params_and_grads(device, param_dtype, grad_dtype)
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


def cuda_only(test):
    """``test`` with CUDA_KERNEL_MARKS: no CPU twin (there is no host sync to catch on a CPU)."""
    for mark in CUDA_KERNEL_MARKS:
        test = mark(test)
    return test


@pytest.mark.parametrize("info", rows(fused=True), ids=str)
@cuda_only
def test_a_step_does_not_sync_with_the_host(info):
    found_inf, inv_scale = torch.zeros((), device="cuda"), torch.full((), 0.5, device="cuda")
    for config in info.configs:
        params, grads = params_and_grads("cuda", torch.float32, torch.float32)
        update = row_update(info, params, grads, config)
        checked_step(update, found_inf, inv_scale)  # compiles, builds the tables
        torch.cuda.synchronize()
        with sync_debug_error():
            checked_step(update, found_inf, inv_scale)
            checked_step(update, found_inf, inv_scale)
        torch.cuda.synchronize()
        assert all(s.item() == 3 for s in update.steps)


def captured(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``step`` captured in a CUDA graph, as the graph's replay; on a CPU (no graphs) ``step``
    itself, so the emulated run checks all but the capture."""
    if device.type != "cuda":
        return step
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def warmed_up(step: Callable[[], None], device: torch.device) -> None:
    """Runs ``step`` once (compiles, builds the tables) outside any capture: on a side stream
    on a GPU, as torch advises before a capture."""
    if device.type != "cuda":
        step()
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)


@pytest.mark.parametrize(
    ("device", "info"),
    _on_cuda_and_once_emulated(*((info,) for info in rows(fused=True)),
                               emulated=tuple((info,) for info in rows(fused=True))),
    indirect=["device"],
)
def test_a_whole_step_is_captured_and_replayed_in_a_cuda_graph(info, device):
    """Every config on a GPU; the default one emulated (the harness, without a capture)."""
    configs = info.configs if device.type == "cuda" else (info.default,)
    for config in configs:
        _captured_and_replayed(info, config, device)


def _captured_and_replayed(info, config, device):
    params, grads = params_and_grads(device, torch.float32, torch.bfloat16)
    found_inf, inv_scale = torch.zeros((), device=device), torch.full((), 0.5, device=device)

    def twin() -> RowUpdate:
        """The update on copies of the params, with state of its own: all share the grads."""
        return row_update(info, [p.clone() for p in params], grads, config)

    update, reference, warm_up = row_update(info, params, grads, config), twin(), twin()
    warmed_up(lambda: checked_step(warm_up, found_inf, inv_scale), device)
    replay = captured(lambda: checked_step(update, found_inf, inv_scale), device)

    for seed in range(3):
        torch.manual_seed(seed)
        for g in grads:
            g.copy_(torch.randn(g.shape, device=device))
        replay()
        checked_step(reference, found_inf, inv_scale)  # eager, on the copies
    if device.type == "cuda":
        torch.cuda.synchronize()
    for ours, theirs in zip(update.lists, reference.lists):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    assert all(s.item() == 3 for s in update.steps)

    kept = [t for ts in update.persistent for t in ts]
    before = [t.clone() for t in kept]
    grads[2][1] = float("nan")
    replay()  # found_inf set on device: the replayed step is skipped
    assert found_inf.item() == 1
    assert all(torch.equal(a, b) for a, b in zip(before, kept))
