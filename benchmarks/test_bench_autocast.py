"""Per-op overhead of scaledoptim.amp.autocast against torch.autocast (CPU, small tensors).

Run from the repository root::

    python3 -m pytest benchmarks/test_bench_autocast.py -q

Each benchmark times ``CALLS`` calls of one op inside an already entered region, so the
numbers are per-op dispatch overhead, not region entry. The summary at the end of the run
(benchmarks/conftest.py) gives, for each case, scaledoptim's time over torch's (ops left on
torch's kernels: ~1.0x) and the extra microseconds per call of an op whose policy was edited
(goal: <= 10 us). An op edited and then reset keeps scaledoptim's kernel for the process, so
both runs of the "edited then reset" cases go through it (~1.0x); its cost against torch's
own kernel is that case's time against the "default policy" case. Since an edited op keeps
its kernel for the process, the torch run of a later case of the same op (softmax's second
case) goes through that kernel too; the reset cases come last for that reason.
"""

from __future__ import annotations

import pytest
import torch

from scaledoptim import amp

CALLS = 100
LOW = torch.bfloat16
X32 = torch.randn(8, 8)
XLOW = X32.to(LOW)

# case: (op call, policy edits for the scaledoptim run); RESET edits and resets the op
# first, so its kernel stays registered and calls torch's (docs/autocast.md).
RESET = "reset"
CASES = {
    # torch's C++ autocast kernel (casts fp32 -> bf16) in both runs
    "mm fp32 in, default policy": (lambda: torch.mm(X32, X32), {}),
    # no autocast kernel: falls through in both runs
    "add, falls through": (lambda: torch.add(X32, X32), {}),
    # same math (no cast: inputs already bf16), Python kernel in the scaledoptim run
    "mm bf16 in, edited to promote": (lambda: torch.mm(XLOW, XLOW), {"aten::mm": "promote"}),
    # torch falls through; the scaledoptim run goes through the Python kernel (no cast)
    "softmax fp32 in, edited to fp32": (
        lambda: torch.softmax(X32, -1), {"aten::softmax.int": "fp32"}
    ),
    # the edited kernel casts fp32 -> bf16 (torch: falls through, computes in fp32)
    "softmax fp32 in, edited to lower_precision_fp": (
        lambda: torch.softmax(X32, -1), {"aten::softmax.int": "lower_precision_fp"}
    ),
    # edited once, then reset: scaledoptim's kernel calls torch's C++ kernel, in both runs
    "mm fp32 in, edited then reset": (lambda: torch.mm(X32, X32), {"aten::mm": RESET}),
    # edited once, then reset: scaledoptim's kernel falls through, in both runs
    "softmax fp32 in, edited then reset": (
        lambda: torch.softmax(X32, -1), {"aten::softmax.int": RESET}
    ),
}


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    # Per-op overhead is the quantity; waking a thread pool for 8x8 tensors adds noise.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _loop(call):
    def run():
        for _ in range(CALLS):
            call()

    return run


@pytest.mark.parametrize("region", ["torch", "scaledoptim"])
@pytest.mark.parametrize("case", list(CASES))
def test_op_overhead(benchmark, case, region):
    call, edits = CASES[case]
    benchmark.group = f"autocast: {case}"
    benchmark.extra_info.update(baseline=region == "torch", calls=CALLS)
    try:
        for op, policy in edits.items():
            if policy == RESET:  # the kernel stays for the process: both runs go through it
                amp.set_policy(op, "fp32", "cpu")
                amp.reset_policy(op)
            elif region == "scaledoptim":
                amp.set_policy(op, policy, "cpu")
        if region == "torch":
            context = torch.autocast("cpu", dtype=LOW)
        else:
            context = amp.autocast("cpu", dtype=LOW)
        with context:
            benchmark(_loop(call))
    finally:
        amp.reset_policy()
