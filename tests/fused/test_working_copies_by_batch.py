"""16-bit params of an elementwise update run through fp32 working copies a batch at a time
(Note [working copies by batch]): the same bits as whole-tensor working copies, for tensors cut
into pieces too (stochastic rounding keyed by each element's index in its whole tensor), skipped
steps included, on the host's form and the sync-free one (no host read); and no whole-tensor fp32
copy."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import scaledoptim
from scaledoptim.doctor.sync_free import no_host_reads
from scaledoptim.fused.backends import working_copies
from scaledoptim.fused.backends.torch_native import TorchUpdate
from scaledoptim.torch_ops import BATCH, SR_CHUNK, storage_flat

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch) -> None:
    monkeypatch.delenv("SCALEDOPTIM_KERNELS", raising=False)  # a CPU's default: torch's ops


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """Small tensors; tensors cut into pieces whose last one is at most SR_CHUNK elements (a
    run's key) or more (chunked); a transposed one over BATCH (cut in storage order)."""
    shapes = [(3,), (1000,), (2 * BATCH + 3,), (7, 5), (BATCH + SR_CHUNK + 5,), (11,)]
    params = [torch.randn(shape) for shape in shapes]
    params.append(torch.randn(520, 510).t())
    return [torch.nn.Parameter(p.to(dtype)) for p in params]


CASES = {
    "AdamW nearest": (scaledoptim.AdamW, torch.bfloat16, {}),
    "AdamW stochastic": (scaledoptim.AdamW, torch.bfloat16, {"stochastic_rounding": True}),
    "AdamW masters": (scaledoptim.AdamW, torch.bfloat16, {"master_weights": True}),
    "AdamW fp16": (scaledoptim.AdamW, torch.float16, {}),
    "SGD stochastic": (
        scaledoptim.SGD, torch.bfloat16,
        {"momentum": 0.9, "dampening": 0.1, "stochastic_rounding": True},
    ),
    "Adagrad nearest": (scaledoptim.Adagrad, torch.bfloat16, {}),
    "RMSprop stochastic": (
        scaledoptim.RMSprop, torch.bfloat16, {"momentum": 0.9, "stochastic_rounding": True}
    ),
    "Lion masters": (scaledoptim.Lion, torch.bfloat16, {"master_weights": True}),
}


def _run(case: str, grad_dtype: torch.dtype | None, on_device: bool) -> list[torch.Tensor]:
    """The params' bits and every state tensor after 4 steps, the third skipped."""
    optimizer, dtype, kwargs = CASES[case]
    torch.manual_seed(0)
    params = _params(dtype)
    opt = optimizer(params, lr=1e-2, **kwargs)
    if grad_dtype is not None:
        for p in params:
            p.grad_dtype = None  # fp32 grads of 16-bit params
    S = opt.scale
    for step in range(4):
        for p in params:
            p.grad = (torch.randn(p.shape) * S).to(grad_dtype or dtype)
            if p.dim() == 2:
                p.grad = p.grad.t().contiguous().t()  # the param's layout
        if step == 2:
            params[2].grad[-1] = float("inf")
        if on_device:  # the form of every other device: a host read raises
            with no_host_reads():
                opt.unscale_and_step(grads_scaled_by=S)
        else:
            opt.unscale_and_step(grads_scaled_by=S)
        S = opt.scale
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [storage_flat(p.detach()).view(torch.int16) for p in params] + state


def _bit_equal(ours: list[torch.Tensor], whole: list[torch.Tensor]) -> None:
    assert len(ours) == len(whole)
    for i, (a, b) in enumerate(zip(ours, whole)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"tensor {i} differs"


@pytest.mark.parametrize("on_device", [False, True], ids=["host skip", "sync-free"])
@pytest.mark.parametrize("grad_dtype", [None, torch.float32], ids=["16-bit grads", "fp32 grads"])
@pytest.mark.parametrize("case", CASES)
def test_batches_give_the_bits_of_whole_tensor_working_copies(
    case: str, grad_dtype: torch.dtype | None, on_device: bool, monkeypatch
) -> None:
    """Exists for a batch boundary that changes the bits (a piece of a large tensor updated twice or
    not at all, a per-param factor taken from another batch's param)."""
    ours = _run(case, grad_dtype, on_device)
    # The whole-tensor working copies (p.float(), g.float()) of every other update.
    monkeypatch.setattr(working_copies.WorkingCopies, "fits", staticmethod(lambda *a: False))
    _bit_equal(ours, _run(case, grad_dtype, on_device))


def _peak_transient_bytes():
    """benchmarks/transient_memory.py's measure (torch's profiler), as the benchmarks report it."""
    path = ROOT / "benchmarks" / "transient_memory.py"
    spec = importlib.util.spec_from_file_location("transient_memory", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.peak_transient_bytes


@pytest.mark.parametrize("kwargs", [{}, {"stochastic_rounding": True}], ids=["nearest", "SR"])
def test_a_large_16bit_param_takes_no_whole_tensor_fp32_copy(kwargs: dict) -> None:
    n = 16 * BATCH
    param = torch.nn.Parameter(torch.randn(n).bfloat16())
    opt = scaledoptim.AdamW([param], lr=1e-3, **kwargs)
    grad = (torch.randn(n) * opt.scale).bfloat16()
    param.grad = grad.clone()
    for _ in range(2):  # the state, then the plan the step cache keeps (its buffers) made
        opt.unscale_and_step(grads_scaled_by=opt.scale)

    def step() -> None:
        param.grad.copy_(grad)
        opt.unscale_and_step(grads_scaled_by=opt.scale)

    # A whole fp32 copy of the param or of its grad would be 4 * n bytes.
    assert _peak_transient_bytes()(step) <= 4 * 4 * BATCH  # a few batches' worth


@pytest.mark.parametrize("on_device", [False, True], ids=["host skip", "sync-free"])
def test_a_grad_that_overflows_when_unscaled_skips_the_step(on_device: bool) -> None:
    """At a scale below 1 a finite 16-bit grad can unscale past float32's range: the batched
    check finds it (the 16-bit grads' own check would not), as the whole-tensor unscale does."""
    param = torch.nn.Parameter(torch.randn(1000).bfloat16())
    before = param.detach().clone()
    opt = scaledoptim.AdamW([param], lr=1e-2)
    opt.configure_scaling(init_scale=2.0**-10)
    grad = torch.randn(1000).bfloat16()
    grad[7] = 1e36  # finite in bf16; times 2**10 past float32's range
    param.grad = grad
    if on_device:
        with no_host_reads():
            _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
    else:
        _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert found_inf.item() == 1.0
    assert torch.equal(param.detach(), before)


def test_working_copies_are_made_by_batch_on_a_cpu_only() -> None:
    # On a GPU the caching allocator hands out whole copies with no page faults, and batches of
    # BATCH elements would multiply a step's launches: another device keeps whole copies.
    opt = scaledoptim.AdamW([torch.nn.Parameter(torch.zeros(2))])

    def lists(device: str) -> list[list[torch.Tensor]]:
        param = torch.zeros(BATCH + 1, dtype=torch.bfloat16, device=device)
        exp_avg, exp_avg_sq = (torch.zeros(BATCH + 1, device=device) for _ in range(2))
        step = torch.zeros((), device=device)
        return [[param], [torch.zeros_like(param)], [exp_avg], [exp_avg_sq], [], [], [], [step]]

    group = opt.param_groups[0]
    assert TorchUpdate(opt, group, lists("cpu")).copies is not None
    assert TorchUpdate(opt, group, lists("meta")).copies is None


@pytest.mark.parametrize("init_scale", [2.0**16, 3 * 2.0**14], ids=["power of two", "not"])
@pytest.mark.parametrize("case", ["AdamW nearest", "SGD stochastic", "Adagrad nearest"])
def test_the_unscale_in_the_update_gives_the_bits_of_the_multiply(
    case: str, init_scale: float, monkeypatch
) -> None:
    """16-bit grads unscaled by torch's fused op where it reads them (a division by the scale)
    give the bits of the multiplication by ``inv_scale`` of the whole-tensor copies; where the
    scale is not a power of two (the division would differ), by the multiplication."""
    optimizer, dtype, kwargs = CASES[case]

    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in (BATCH + 5, 7)]
        opt = optimizer(params, lr=1e-2, **kwargs)
        opt.configure_scaling(init_scale=init_scale, growth_interval=10**6)
        for _ in range(2):
            for p in params:
                p.grad = (torch.randn(p.shape) * 1e-3 * opt.scale).to(dtype)
            opt.unscale_and_step(grads_scaled_by=opt.scale)
        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return [p.detach().view(torch.int16) for p in params] + state

    ours = run()
    monkeypatch.setattr(working_copies.WorkingCopies, "fits", staticmethod(lambda *a: False))
    _bit_equal(ours, run())
