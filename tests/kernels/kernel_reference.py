"""The test oracles: torch.optim's single-tensor (foreach=False) math on fp32 copies, one
``reference_xxx`` per update kernel of kernel_table.py's KERNEL_CASES; and the setup and checks
that the kernel tests, tests/gpu and benchmarks/test_bench_cuda_kernels.py share (imported as
``tests.kernels.kernel_reference``; it needs no hypothesis, which the benchmarks lack).

Each reference step starts from the kernel's current state (params upcast from their 16-bit
storage), so a 16-bit param is compared with the fp32 result rounded once.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import Tensor
from torch.optim.adam import adam as torch_adam
from torch.optim.sgd import sgd as torch_sgd

import scaledoptim
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
        "cupy", reason='CUDA kernels launch through CuPy (pip install -e ".[cuda12]")'
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
    """The keyword arguments of ``scaledoptim.optim.adam.adam_`` but found_inf and inv_scale: torch.optim.AdamW's
    defaults, with ``changes``."""
    return (
        dict(
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.01,
            decoupled_weight_decay=True,
            amsgrad=False,
            maximize=False,
        )
        | changes
    )


def sgd_options(**changes: float | bool) -> dict:
    """The keyword arguments of ``scaledoptim.optim.sgd.sgd_`` but found_inf and inv_scale: lr 0.1 and plain
    momentum 0.9, with ``changes``."""
    return (
        dict(
            lr=0.1,
            momentum=0.9,
            dampening=0.0,
            nesterov=False,
            weight_decay=0.0,
            maximize=False,
        )
        | changes
    )


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
    scaledoptim.optim.adam.adam_(
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


def reference_adam(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    state: Sequence[Sequence[Tensor]],
    steps: Sequence[Tensor],
    inv_scale: float | None,
    options: dict,
) -> tuple[list[Tensor], list[list[Tensor]]]:
    """One torch Adam/AdamW step on fp32 copies of ``params`` and of ``state`` (exp_avgs,
    exp_avg_sqs, max_exp_avg_sqs: empty without amsgrad); returns the new params and state."""
    p32 = [p.float().clone() for p in params]
    g32 = [g.float() * inv_scale if inv_scale is not None else g.float() for g in grads]
    exp_avgs, exp_avg_sqs, max_exp_avg_sqs = ([t.clone() for t in ts] for ts in state)
    torch_adam(
        p32,
        g32,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        [s.clone() for s in steps],
        foreach=False,
        fused=False,
        **options,
    )
    return p32, [exp_avgs, exp_avg_sqs, max_exp_avg_sqs]


def reference_sgd(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    state: Sequence[Sequence[Tensor]],
    steps: Sequence[Tensor],
    inv_scale: float | None,
    options: dict,
) -> tuple[list[Tensor], list[list[Tensor]]]:
    """One torch SGD step on fp32 copies (``state``: the momentum buffers, empty without
    momentum); a param whose step is 0 gets its buffer created, as torch does."""
    (buffers,) = state
    p32 = [p.float().clone() for p in params]
    g32 = [g.float() * inv_scale if inv_scale is not None else g.float() for g in grads]
    torch_buffers: list[Tensor | None] = (
        [None if s.item() == 0 else b.clone() for b, s in zip(buffers, steps)]
        if options["momentum"] != 0
        else [None] * len(params)
    )
    torch_sgd(p32, g32, torch_buffers, foreach=False, fused=False, **options)
    return p32, [torch_buffers if options["momentum"] != 0 else []]


def ulp_distance(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise distance in units in the last place between two 16-bit float tensors."""

    def ordered(t: Tensor) -> Tensor:
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -32768 - bits, bits)  # sign-magnitude -> monotonic integers

    return (ordered(a) - ordered(b)).abs()


def assert_param_close(
    actual: Tensor, expected32: Tensor, rtol: float = 1e-6, atol: float = 1e-6
) -> None:
    """fp32: ``rtol``/``atol``; 16-bit: within one ulp of the fp32 reference rounded once."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected32, rtol=rtol, atol=atol)
    else:
        expected = expected32.to(actual.dtype)
        distance = ulp_distance(actual, expected)
        assert distance.numel() == 0 or distance.max().item() <= 1, (
            f"{actual.dtype} param off by {distance.max().item()} ulp: {actual} vs {expected}"
        )


def assert_state_close(
    actual: Tensor, expected: Tensor, rtol: float = 1e-6, atol: float = 1e-7
) -> None:
    """fp32 state: 1e-6 relative, plus 1e-7 absolute for values that cancel to near zero
    (torch's vectorised CPU lerp uses FMA, the emulator does not; gradients are O(1))."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
