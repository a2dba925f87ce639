"""scaledoptim.amp.autocast gives torch.autocast's dtypes and values, forward and backward.

Each case runs three ways: plain ``torch.autocast`` (torch's C++ kernels), a
``scaledoptim.amp.autocast`` region with default policies (the same C++ kernels), and a
scaledoptim region where the op is forced onto scaledoptim's Python kernel with torch's
default policy, which checks that the Python policies reproduce ATen's exactly.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from scaledoptim import amp
from scaledoptim.amp import policies, registry
from scaledoptim.amp.cast_kernels import PolicySlot, make_autocast_kernel, make_preparer
from scaledoptim.amp.op_names import resolve_overloads


@contextlib.contextmanager
def python_kernels(op_names: list[str], device_type: str = "cpu") -> Iterator[None]:
    """Run scaledoptim's kernel with torch's own policy forced on (set_policy would not).

    An op that scaledoptim already has a kernel for gets the forced policy in that kernel's
    slot. Otherwise a kernel is registered and destroyed afterwards, which is only safe
    because no other thread runs ops here (see Note [policy slots]). (Never one registered
    over scaledoptim's and destroyed: torch's tracing would keep calling the destroyed one,
    and later tests compile these ops.)
    """
    libraries = []
    restore = []
    try:
        for name in op_names:
            (overload,) = resolve_overloads(name)
            policy = policies.default_policy(name, device_type)
            edit = (policy, make_preparer(overload, device_type, policy))
            installed = registry._slots.get((name, device_type))
            if installed is not None:
                restore.append((installed, installed.edit))
                installed.edit = edit
                continue
            slot = PolicySlot(edit)
            kernel = make_autocast_kernel(overload, device_type, slot)
            namespace, _, op = name.partition("::")
            library = torch.library.Library(namespace, "IMPL")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # overriding torch's C++ kernel on purpose
                key = policies.AUTOCAST_DISPATCH_KEYS[device_type]
                library.impl(op, kernel, key, with_keyset=True)
            libraries.append(library)
        yield
    finally:
        for library in libraries:
            library._destroy()
        for installed, edit in restore:
            installed.edit = edit


Shapes = st.integers(min_value=1, max_value=4)


class Sample:
    """Random inputs of one example: fp32 leaves, the second optionally in low precision."""

    def __init__(self, n: int, k: int, m: int, low: torch.dtype, mixed: bool, seed: int):
        self.n, self.k, self.m = n, k, m
        self.low, self.mixed = low, mixed
        self.generator = torch.Generator().manual_seed(seed)

    def tensor(self, *shape: int, second: bool = False) -> torch.Tensor:
        dtype = self.low if (second and self.mixed) else torch.float32
        data = torch.randn(*shape, generator=self.generator).to(dtype)
        return data.requires_grad_()


# name: (ops forced onto the Python kernel, function, inputs)
CASES: dict[str, tuple[list[str], Callable, Callable[[Sample], list[torch.Tensor]]]] = {
    "linear": (
        ["aten::linear"],
        F.linear,
        lambda s: [s.tensor(s.n, s.k), s.tensor(s.m, s.k, second=True), s.tensor(s.m)],
    ),
    "mm": (["aten::mm"], torch.mm, lambda s: [s.tensor(s.n, s.k), s.tensor(s.k, s.m, second=True)]),
    "bmm": (
        ["aten::bmm"],
        torch.bmm,
        lambda s: [s.tensor(2, s.n, s.k), s.tensor(2, s.k, s.m, second=True)],
    ),
    "matmul": (
        ["aten::matmul"],
        torch.matmul,
        lambda s: [s.tensor(2, s.n, s.k), s.tensor(s.k, s.m, second=True)],
    ),
    "conv1d": (
        ["aten::conv1d"],
        F.conv1d,
        lambda s: [s.tensor(1, s.k, s.n + 2), s.tensor(s.m, s.k, 2, second=True), s.tensor(s.m)],
    ),
    "conv2d": (
        ["aten::conv2d"],
        F.conv2d,
        lambda s: [s.tensor(1, s.k, s.n + 2, 3), s.tensor(s.m, s.k, 2, 2, second=True)],
    ),
    "addmm": (
        ["aten::addmm"],
        torch.addmm,
        lambda s: [s.tensor(s.n, s.m), s.tensor(s.n, s.k, second=True), s.tensor(s.k, s.m)],
    ),
    "baddbmm": (
        ["aten::baddbmm"],
        torch.baddbmm,
        lambda s: [
            s.tensor(2, s.n, s.m),
            s.tensor(2, s.n, s.k, second=True),
            s.tensor(2, s.k, s.m),
        ],
    ),
    "softmax": (
        ["aten::softmax.int"],
        lambda x: torch.softmax(x, -1),
        lambda s: [s.tensor(s.n, s.m)],
    ),
    "log_softmax": (
        ["aten::log_softmax.int"],
        lambda x: torch.log_softmax(x, -1),
        lambda s: [s.tensor(s.n, s.m)],
    ),
    "layer_norm": (
        ["aten::layer_norm"],
        lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
        lambda s: [s.tensor(s.n, s.m, second=True), s.tensor(s.m), s.tensor(s.m)],
    ),
    "cross_entropy": (
        ["aten::cross_entropy_loss"],
        lambda x, t: F.cross_entropy(x, t),
        lambda s: [s.tensor(s.n, s.m), torch.randint(0, s.m, (s.n,), generator=s.generator)],
    ),
    "mse_loss": (
        ["aten::mse_loss"],
        F.mse_loss,
        lambda s: [s.tensor(s.n, s.m), s.tensor(s.n, s.m, second=True)],
    ),
    "cat": (
        ["aten::cat"],
        lambda a, b: torch.cat([a, b]),
        lambda s: [s.tensor(s.n, s.m), s.tensor(s.k, s.m, second=True)],
    ),
    "stack": (
        ["aten::stack"],
        lambda a, b: torch.stack([a, b]),
        lambda s: [s.tensor(s.n, s.m), s.tensor(s.n, s.m, second=True)],
    ),
    "add": (
        ["aten::add.Tensor"],
        torch.add,
        lambda s: [s.tensor(s.n, s.m), s.tensor(s.n, s.m, second=True)],
    ),
    "mul": (
        ["aten::mul.Tensor"],
        torch.mul,
        lambda s: [s.tensor(s.n, s.m), s.tensor(s.n, s.m, second=True)],
    ),
    "sum": (["aten::sum"], torch.sum, lambda s: [s.tensor(s.n, s.m)]),
    "mean": (["aten::mean"], torch.mean, lambda s: [s.tensor(s.n, s.m)]),
    "exp": (["aten::exp"], torch.exp, lambda s: [s.tensor(s.n, s.m)]),
    "log": (["aten::log"], lambda x: torch.log(x.abs() + 1), lambda s: [s.tensor(s.n, s.m)]),
}


def _run(region, fn, inputs):
    with region:
        output = fn(*inputs)
    leaves = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad(output, leaves, torch.ones_like(output))
    return output, grads


def _assert_identical(actual, expected):
    (out, grads), (ref_out, ref_grads) = actual, expected
    assert out.dtype == ref_out.dtype
    assert torch.equal(out, ref_out)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert grad.dtype == ref_grad.dtype
        assert torch.equal(grad, ref_grad)


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=6, deadline=None)
@given(
    n=Shapes, k=Shapes, m=Shapes.map(lambda v: v + 1),
    low=st.sampled_from([torch.bfloat16, torch.float16]),
    mixed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_parity_with_torch_autocast(case, n, k, m, low, mixed, seed):
    op_names, fn, make_inputs = CASES[case]

    def run(region):
        inputs = make_inputs(Sample(n, k, m, low, mixed, seed))
        return _run(region, fn, inputs)

    expected = run(torch.autocast("cpu", dtype=low))
    _assert_identical(run(amp.autocast("cpu", dtype=low)), expected)
    with python_kernels(op_names):
        _assert_identical(run(amp.autocast("cpu", dtype=low)), expected)
        # In a plain torch region the Python kernel must stand in for torch's exactly too.
        _assert_identical(run(torch.autocast("cpu", dtype=low)), expected)
