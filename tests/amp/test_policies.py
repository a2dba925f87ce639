"""Default tables against the installed torch, and the policy editing API."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from scaledoptim import amp
from scaledoptim.amp import policies

_TORCHS_AUTOCAST_OPS = (
    "import json, torch\n"
    "keys = {'cpu': 'AutocastCPU', 'cuda': 'AutocastCUDA'}\n"
    "print(json.dumps({device: sorted(\n"
    "    name for name in torch._C._dispatch_get_all_op_names()\n"
    "    if torch._C._dispatch_has_kernel_for_dispatch_key(name, key))\n"
    "    for device, key in keys.items()}))\n"
)


@pytest.fixture(scope="module")
def torchs_autocast_ops() -> dict[str, set[str]]:
    """The ops torch itself has Autocast kernels for, read in a fresh interpreter.

    In this process, scaledoptim's kernels stay registered for every op a test edited
    (Note [policy slots]), so the dispatcher here would list those ops too.
    """
    output = subprocess.run(
        [sys.executable, "-c", _TORCHS_AUTOCAST_OPS], check=True, capture_output=True,
        text=True, timeout=120,
    ).stdout
    return {device: set(names) for device, names in json.loads(output).items()}


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_default_table_covers_exactly_torchs_autocast_ops(device_type, torchs_autocast_ops):
    table = set(policies.DEFAULT_POLICIES[device_type]) | policies.UNSAFE_TO_AUTOCAST[device_type]
    assert table == torchs_autocast_ops[device_type]


def _probe_policy(fn, make_inputs) -> str | None:
    """Classify torch's CPU policy for ``fn`` from output dtypes under torch.autocast."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        from_fp32 = fn(*make_inputs(torch.float32)).dtype
        from_bf16 = fn(*make_inputs(torch.bfloat16)).dtype
    if from_fp32 == torch.bfloat16:
        return policies.LOWER_PRECISION_FP
    if from_bf16 == torch.float32:
        return policies.FP32
    return None


def _matrices(n: int, shape=(3, 3)):
    return lambda dtype: [torch.randn(*shape, dtype=dtype) for _ in range(n)]


PROBES = {
    "aten::mm": (torch.mm, _matrices(2)),
    "aten::bmm": (torch.bmm, _matrices(2, (2, 3, 3))),
    "aten::matmul": (torch.matmul, _matrices(2)),
    "aten::addmm": (torch.addmm, _matrices(3)),
    "aten::baddbmm": (torch.baddbmm, _matrices(3, (2, 3, 3))),
    "aten::linear": (torch.nn.functional.linear, _matrices(2)),
    "aten::conv1d": (
        torch.nn.functional.conv1d,
        lambda d: [torch.randn(1, 2, 5, dtype=d), torch.randn(3, 2, 2, dtype=d)],
    ),
    "aten::conv2d": (
        torch.nn.functional.conv2d,
        lambda d: [torch.randn(1, 2, 5, 5, dtype=d), torch.randn(3, 2, 2, 2, dtype=d)],
    ),
    "aten::mse_loss": (torch.nn.functional.mse_loss, _matrices(2)),
    "aten::cross_entropy_loss": (
        torch.nn.functional.cross_entropy,
        lambda d: [torch.randn(4, 3, dtype=d), torch.tensor([0, 1, 2, 1])],
    ),
    "aten::softmax.int": (lambda x: torch.softmax(x, -1), _matrices(1)),
    "aten::log_softmax.int": (lambda x: torch.log_softmax(x, -1), _matrices(1)),
    "aten::layer_norm": (lambda x: torch.nn.functional.layer_norm(x, (3,)), _matrices(1)),
    "aten::add.Tensor": (torch.add, _matrices(2)),
    "aten::mul.Tensor": (torch.mul, _matrices(2)),
    "aten::sum": (torch.sum, _matrices(1)),
    "aten::mean": (torch.mean, _matrices(1)),
    "aten::exp": (torch.exp, _matrices(1)),
    "aten::log": (torch.log, _matrices(1)),
    "aten::prod": (torch.prod, _matrices(1)),
    "aten::trace": (torch.trace, _matrices(1)),
}


@pytest.mark.parametrize("op_name", sorted(PROBES))
def test_cpu_table_matches_probed_policy(op_name):
    fn, make_inputs = PROBES[op_name]
    assert _probe_policy(fn, make_inputs) == policies.default_policy(op_name, "cpu")


@pytest.mark.parametrize("op_name", ["aten::cat", "aten::stack"])
def test_cpu_promote_ops_widen_mixed_inputs(op_name):
    fn = torch.cat if op_name == "aten::cat" else torch.stack
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = fn([torch.randn(2, dtype=torch.bfloat16), torch.randn(2)])
        low = fn([torch.randn(2, dtype=torch.bfloat16)] * 2)
    assert (mixed.dtype, low.dtype) == (torch.float32, torch.bfloat16)
    assert amp.get_policy(op_name, "cpu") == policies.PROMOTE


def test_get_policy_reads_defaults_and_edits():
    assert amp.get_policy(torch.ops.aten.mm, "cpu") == "lower_precision_fp"
    assert amp.get_policy("aten::softmax", "cpu") is None
    assert amp.get_policy("aten::softmax.int", "cuda") == "fp32_set_opt_dtype"
    assert amp.get_policy(torch.ops.aten.norm.Scalar, "cuda") == "fp32_append_dtype"
    amp.set_policy(torch.ops.aten.softmax, "fp32", "cpu")
    assert amp.get_policy(torch.ops.aten.softmax.int, "cpu") == "fp32"
    assert amp.get_policy(torch.ops.aten.softmax, "cpu") == "fp32"
    assert amp.get_policy(torch.ops.aten.softmax, "cuda") == "fp32_set_opt_dtype"
    amp.reset_policy(torch.ops.aten.softmax, "cpu")
    assert amp.get_policy(torch.ops.aten.softmax, "cpu") is None


def test_get_policy_of_packet_with_differing_overloads_names_them():
    amp.set_policy("aten::pow.Scalar", "fp32", "cpu")
    with pytest.raises(ValueError, match=r"pow\.Tensor_Tensor"):
        amp.get_policy("aten::pow", "cpu")


def _autocast_kernel_source(op_name: str) -> str:
    dump = torch._C._dispatch_dump(op_name)
    return next(line for line in dump.splitlines() if line.startswith("AutocastCPU:"))


def test_an_op_never_edited_keeps_torchs_cpp_kernel():
    # No other test edits addbmm; setting torch's own policy must install nothing.
    assert "autocast_mode.cpp" in _autocast_kernel_source("aten::addbmm")
    amp.set_policy("aten::addbmm", "lower_precision_fp", "cpu")
    assert "autocast_mode.cpp" in _autocast_kernel_source("aten::addbmm")
    assert amp.edited_policies() == {}


def _mm_and_softmax_dtypes():
    x = torch.randn(3, 3)
    return torch.mm(x, x).dtype, torch.softmax(x, -1).dtype


def test_edited_then_reset_op_keeps_its_kernel_and_behaves_like_torch():
    amp.set_policy("aten::mm", "fp32", "cpu")
    amp.set_policy("aten::softmax", "lower_precision_fp", "cpu")
    assert "scaledoptim" in _autocast_kernel_source("aten::mm")
    with amp.autocast("cpu", dtype=torch.bfloat16):
        assert _mm_and_softmax_dtypes() == (torch.float32, torch.bfloat16)
    amp.reset_policy()
    # The kernel is never removed (Note [policy slots]); it now runs torch's policy.
    assert "scaledoptim" in _autocast_kernel_source("aten::mm")
    assert amp.get_policy("aten::mm", "cpu") == "lower_precision_fp"
    assert amp.get_policy("aten::softmax", "cpu") is None
    for region in (amp.autocast, torch.autocast):
        with region("cpu", dtype=torch.bfloat16):
            assert _mm_and_softmax_dtypes() == (torch.bfloat16, torch.float32)
    amp.set_policy("aten::mm", "fp32", "cpu")  # editing again swaps the policy back in
    with amp.autocast("cpu", dtype=torch.bfloat16):
        assert _mm_and_softmax_dtypes() == (torch.float32, torch.float32)


def test_reset_policy_filters_by_op_and_device():
    amp.set_policy("aten::mm", "fp32", "cpu")
    amp.set_policy("aten::mm", "fp32", "cuda")
    amp.set_policy("aten::exp", "lower_precision_fp", "cpu")
    amp.reset_policy(device_type="cuda")
    assert set(amp.edited_policies()) == {("aten::mm", "cpu"), ("aten::exp", "cpu")}
    amp.reset_policy("aten::mm")
    assert set(amp.edited_policies()) == {("aten::exp", "cpu")}


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: amp.set_policy("aten::mm", "half", "cpu"), "Unknown policy 'half'"),
        (lambda: amp.set_policy("aten::no_such_op", "fp32", "cpu"), "Unknown op"),
        (lambda: amp.set_policy("softmax", "fp32", "cpu"), "namespace::name"),
        (lambda: amp.set_policy("aten::softmax.nope", "fp32", "cpu"), "Unknown overload"),
        (lambda: amp.set_policy("aten::mm", "fp32", "xpu"), "Unsupported device_type 'xpu'"),
        (lambda: amp.set_policy("aten::mm", "fp32_set_opt_dtype", "cpu"), "optional dtype"),
        (lambda: amp.set_policy("aten::mm", "fp32_append_dtype", "cpu"), "trailing"),
        (lambda: amp.autocast("xpu"), "Unsupported device_type"),
    ],
)
def test_errors_name_the_problem(call, message):
    with pytest.raises(ValueError, match=message):
        call()
    assert amp.edited_policies() == {}


def test_set_policy_rejects_non_ops():
    with pytest.raises(TypeError, match="OpOverloadPacket"):
        amp.set_policy(torch.mm, "fp32", "cpu")


def test_importing_scaledoptim_leaves_torch_autocast_kernels_alone():
    script = (
        "import torch\n"
        "names = torch._C._dispatch_get_all_op_names()\n"
        "def snapshot():\n"
        "    return {n: torch._C._dispatch_dump(n) for n in names\n"
        "            if 'Autocast' in torch._C._dispatch_dump(n)}\n"
        "before = snapshot()\n"
        "import scaledoptim.amp\n"
        "assert snapshot() == before\n"
    )
    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    subprocess.run([sys.executable, "-c", script], check=True, cwd=root, timeout=120)
