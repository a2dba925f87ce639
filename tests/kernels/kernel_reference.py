"""The test oracle: torch.optim's single-tensor (foreach=False) math on fp32 copies; and the
setup and checks that the kernel tests, tests/gpu and benchmarks/test_bench_cuda_kernels.py share
(imported there as ``tests.kernels.kernel_reference``).

Each reference step starts from the kernel's current state (params upcast from their 16-bit
storage), so a 16-bit param is compared with the fp32 result rounded once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch
from torch import Tensor
from torch.optim.adam import adam as torch_adam
from torch.optim.sgd import sgd as torch_sgd

from scaledoptim import kernels

# Chunk size of the kernel tests (set by conftest.py): 3 * CHUNK + 7 elements span four chunks.
CHUNK = 64
SIZES_IN_CHUNKS = (0, 1, 3, 4, 5, "c-1", "c", "c+1", "3c+7")
EMULATOR_THREADS = 8  # emulated threads per block: 2 vector iterations per chunk of CHUNK
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Marks of the tests that launch the kernels on a CUDA device (they also need CuPy).
CUDA_KERNEL_MARKS = (
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("needs_cupy"),
)


@pytest.fixture
def needs_cupy() -> None:
    """Used through CUDA_KERNEL_MARKS: a module using those marks imports this fixture too."""
    pytest.importorskip(
        "cupy", reason="CUDA kernels launch through CuPy (pip install scaledoptim[cuda12])"
    )


def test_sizes(chunk: int) -> list[int]:
    """0, 1, 3, 4, 5, chunk-1, chunk, chunk+1, 3*chunk+7."""
    named = {"c-1": chunk - 1, "c": chunk, "c+1": chunk + 1, "3c+7": 3 * chunk + 7}
    return [named.get(s, s) for s in SIZES_IN_CHUNKS]


test_sizes.__test__ = False  # a helper, not a test


def misaligned(t: Tensor) -> Tensor:
    """A copy of ``t`` viewed at storage offset 1, so no 16-byte vector load is aligned."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = storage[1:].view(t.shape)
    view.copy_(t)
    return view


def make_tensors(
    sizes: list[int], dtype: torch.dtype, generator: torch.Generator, scale: float = 1.0
) -> list[Tensor]:
    """Random tensors of ``sizes``; the last size is also added as a misaligned view."""
    tensors = [(torch.randn(n, generator=generator) * scale).to(dtype) for n in sizes]
    tensors.append(misaligned((torch.randn(sizes[-1], generator=generator) * scale).to(dtype)))
    return tensors


def boundary_params_and_grads(
    param_dtype: torch.dtype, grad_dtype: torch.dtype, generator: torch.Generator
) -> tuple[list[Tensor], list[Tensor]]:
    """Params and grads of every size of ``test_sizes(CHUNK)``, plus a misaligned view each."""
    sizes = test_sizes(CHUNK)
    return make_tensors(sizes, param_dtype, generator), make_tensors(sizes, grad_dtype, generator)


def mixed_params_and_grads(
    sizes: Sequence[int], dtypes: Sequence[tuple[torch.dtype, torch.dtype]], seed: int
) -> tuple[list[Tensor], list[Tensor]]:
    """A param and a grad per ``(param_dtype, grad_dtype)`` of ``dtypes``, sized by ``sizes``."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=generator).to(p) for n, (p, _) in zip(sizes, dtypes)]
    grads = [torch.randn(n, generator=generator).to(g) for n, (_, g) in zip(sizes, dtypes)]
    return params, grads


def adam_options(**changes: float | bool) -> dict:
    """The keyword arguments of ``kernels.adam_`` but found_inf and inv_scale: torch.optim.AdamW's
    defaults, with ``changes``."""
    return dict(
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.01,
        decoupled_weight_decay=True,
        amsgrad=False,
        maximize=False,
    ) | changes


def sgd_options(**changes: float | bool) -> dict:
    """The keyword arguments of ``kernels.sgd_`` but found_inf and inv_scale: lr 0.1 and plain
    momentum 0.9, with ``changes``."""
    return dict(
        lr=0.1,
        momentum=0.9,
        dampening=0.0,
        nesterov=False,
        weight_decay=0.0,
        maximize=False,
    ) | changes


def zero_adam_state(params: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Zero exp_avgs, exp_avg_sqs (fp32) and step counters for ``params``, on their device."""
    return (
        [torch.zeros_like(p, dtype=torch.float32) for p in params],
        [torch.zeros_like(p, dtype=torch.float32) for p in params],
        [torch.zeros((), device=p.device) for p in params],
    )


def checked_adam_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    found_inf: Tensor,
    inv_scale: Tensor,
) -> None:
    """A loss-scaled AdamW step as the optimizer runs it on device: clear found_inf, check the
    grads, then the update (unscaling in registers; skipped where found_inf is set)."""
    found_inf.zero_()
    kernels.non_finite_check_(grads, found_inf)
    kernels.adam_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        **adam_options(),
        found_inf=found_inf,
        inv_scale=inv_scale,
    )


def snapshot(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [t.clone() for t in tensors]


def assert_bytes_unchanged(before: Sequence[Tensor], after: Sequence[Tensor]) -> None:
    for b, a in zip(before, after):
        assert torch.equal(b.reshape(-1).view(torch.uint8), a.reshape(-1).view(torch.uint8))


def compare_steps(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    n_steps: int,
    generator: torch.Generator,
    step: Callable[[int], Sequence[Tensor]],
) -> None:
    """Runs ``n_steps`` steps, each on fresh gradients drawn from ``generator``: ``step(i)`` runs
    the reference and the kernel, checks the state, and returns the reference's fp32 params,
    which ``params`` must match. The update must leave the grads unwritten."""
    for i in range(n_steps):
        for g in grads:  # fresh gradients every step
            g.copy_(torch.randn(g.shape, generator=generator).to(g.dtype))
        grads_before = snapshot(grads)
        expected_params = step(i)
        for actual, reference in zip(params, expected_params):
            assert_param_close(actual, reference)
        assert_bytes_unchanged(grads_before, grads)  # update kernels never write grads


@dataclass
class AdamState:
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    max_exp_avg_sqs: list[Tensor]
    steps: list[Tensor] = field(default_factory=list)


def reference_adam(
    params: list[Tensor],
    grads: list[Tensor],
    state: AdamState,
    inv_scale: float | None,
    options: dict,
) -> tuple[list[Tensor], AdamState]:
    """One torch Adam/AdamW step on fp32 copies; returns the new fp32 params and state."""
    p32 = [p.float().clone() for p in params]
    g32 = [g.float() * inv_scale if inv_scale is not None else g.float() for g in grads]
    new = AdamState(
        [t.clone() for t in state.exp_avgs],
        [t.clone() for t in state.exp_avg_sqs],
        [t.clone() for t in state.max_exp_avg_sqs],
        [t.clone() for t in state.steps],
    )
    torch_adam(
        p32,
        g32,
        new.exp_avgs,
        new.exp_avg_sqs,
        new.max_exp_avg_sqs,
        new.steps,
        foreach=False,
        fused=False,
        **options,
    )
    return p32, new


def reference_sgd(
    params: list[Tensor],
    grads: list[Tensor],
    buffers: list[Tensor],
    steps: list[Tensor],
    inv_scale: float | None,
    options: dict,
) -> tuple[list[Tensor], list[Tensor]]:
    """One torch SGD step on fp32 copies; a param whose step is 0 gets its buffer created."""
    p32 = [p.float().clone() for p in params]
    g32 = [g.float() * inv_scale if inv_scale is not None else g.float() for g in grads]
    torch_buffers: list[Tensor | None] = (
        [None if s.item() == 0 else b.clone() for b, s in zip(buffers, steps)]
        if options["momentum"] != 0
        else [None] * len(params)
    )
    torch_sgd(p32, g32, torch_buffers, foreach=False, fused=False, **options)
    return p32, torch_buffers


def ulp_distance(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise distance in units in the last place between two 16-bit float tensors."""

    def ordered(t: Tensor) -> Tensor:
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -32768 - bits, bits)  # sign-magnitude -> monotonic integers

    return (ordered(a) - ordered(b)).abs()


def assert_param_close(actual: Tensor, expected32: Tensor) -> None:
    """fp32: 1e-6 relative; 16-bit: within one ulp of the fp32 reference rounded once."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected32, rtol=1e-6, atol=1e-6)
    else:
        expected = expected32.to(actual.dtype)
        distance = ulp_distance(actual, expected)
        assert (
            distance.numel() == 0 or distance.max().item() <= 1
        ), f"{actual.dtype} param off by {distance.max().item()} ulp: {actual} vs {expected}"


def assert_state_close(actual: Tensor, expected: Tensor) -> None:
    """fp32 state: 1e-6 relative, plus 1e-7 absolute for values that cancel to near zero
    (torch's vectorised CPU lerp uses FMA, the emulator does not; gradients are O(1))."""
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-7)


def lion_options(**changes: float | bool) -> dict:
    """The keyword arguments of ``kernels.lion_`` but found_inf and inv_scale, with ``changes``."""
    return dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.0, maximize=False) | changes


def reference_lion(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], inv_scale: float | None, options: dict
) -> tuple[list[Tensor], list[Tensor]]:
    """One Lion step from the formula in float64; returns the new params and exp_avgs (fp64)."""
    new_params, new_exp_avgs = [], []
    for p, g, m in zip(params, grads, exp_avgs):
        g = g.double() * (inv_scale if inv_scale is not None else 1.0) * (-1 if options["maximize"] else 1)
        m = m.double()
        c = options["beta1"] * m + (1 - options["beta1"]) * g
        new_params.append(p.double() * (1 - options["lr"] * options["weight_decay"]) - options["lr"] * torch.sign(c))
        new_exp_avgs.append(options["beta2"] * m + (1 - options["beta2"]) * g)
    return new_params, new_exp_avgs


def adagrad_options(**changes: float | bool) -> dict:
    """The keyword arguments of ``kernels.adagrad_`` but found_inf and inv_scale, with ``changes``."""
    return dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, eps=1e-10, maximize=False) | changes


def reference_adagrad(
    params: list[Tensor], grads: list[Tensor], sums: list[Tensor], steps: list[Tensor],
    inv_scale: float | None, options: dict,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:  # fmt: skip
    """One torch.optim.Adagrad step (foreach=False) on fp32 copies: new params, sums, steps."""
    from torch.optim.adagrad import adagrad as torch_adagrad

    p32 = [p.float().clone() for p in params]
    g32 = [g.float() * inv_scale if inv_scale is not None else g.float() for g in grads]
    new_sums, new_steps = [s.clone() for s in sums], [s.clone() for s in steps]
    torch_adagrad(p32, g32, new_sums, new_steps, foreach=False, fused=False, has_sparse_grad=False,
                  has_complex=False, **options)  # fmt: skip
    return p32, new_sums, new_steps


def lamb_options(**changes: float | bool) -> dict:
    """The keyword arguments of ``kernels.lamb_`` but found_inf and inv_scale: Apex FusedLAMB's
    defaults but lr 1e-2, with ``changes``."""
    return dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, bias_correction=True,
                max_grad_norm=1.0, adam_w_mode=True, grad_averaging=True, use_nvlamb=False) | changes  # fmt: skip


def reference_lamb(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    steps: list[Tensor], inv_scale: float | None, options: dict,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:  # fmt: skip
    """One LAMB step in float64 (tests/reference_optimizers.py's formula) from the kernel's
    current state: new params, exp_avgs, exp_avg_sqs."""
    from reference_optimizers import LambReference  # tests/ is on sys.path under pytest

    o = dict(options)
    betas = (o.pop("beta1"), o.pop("beta2"))
    p64 = [torch.nn.Parameter(p.double().clone()) for p in params]
    for p, g in zip(p64, grads):
        p.grad = g.double() * (inv_scale if inv_scale is not None else 1.0)
    opt = LambReference(p64, betas=betas, **o)
    for p, m, v, s in zip(p64, exp_avgs, exp_avg_sqs, steps):
        opt.state[p] = dict(step=s.clone(), exp_avg=m.double(), exp_avg_sq=v.double())
    opt.step()
    return ([p.detach() for p in p64], [opt.state[p]["exp_avg"] for p in p64],
            [opt.state[p]["exp_avg_sq"] for p in p64])  # fmt: skip
