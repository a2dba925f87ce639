"""Regions of other device types nested in a scaledoptim region leave its policies alone.

torch keeps one autocast nesting counter for all device types; which region governs an op
on a device is the innermost region *of that device*, whatever other devices' regions were
entered since. The property test draws stacks of scaledoptim and plain torch regions on
``cpu`` and ``cuda`` (a CUDA region is accepted, and disabled, on a machine without CUDA)
and checks each op's dtype against that rule.
"""

from __future__ import annotations

import contextlib
import pathlib
import subprocess
import sys
import warnings

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaledoptim import amp
from scaledoptim.amp.regions import in_scaledoptim_region

LOW = st.sampled_from([torch.bfloat16, torch.float16])
Region = tuple[str, str, bool, torch.dtype]  # (kind, device type, enabled, dtype)
REGIONS = st.tuples(
    st.sampled_from(["scaledoptim", "torch"]),
    st.sampled_from(["cpu", "cuda"]),
    st.booleans(),
    LOW,
)


def _enter(stack: contextlib.ExitStack, region: Region) -> None:
    kind, device_type, enabled, dtype = region
    if device_type == "cuda":
        dtype = torch.float16  # CUDA's default; bf16 is refused where CUDA is missing
    factory = amp.autocast if kind == "scaledoptim" else torch.autocast
    stack.enter_context(factory(device_type, dtype=dtype, enabled=enabled))


def _expected_mm_and_softmax(regions: list[Region]) -> tuple[torch.dtype, torch.dtype]:
    cpu = [region for region in regions if region[1] == "cpu"]
    if not cpu or not cpu[-1][2]:
        return torch.float32, torch.float32  # autocast off on cpu
    kind, _, _, dtype = cpu[-1]
    if kind == "scaledoptim":
        return torch.float32, dtype  # the edits: mm pinned to fp32, softmax to low
    return dtype, torch.float32  # torch's policies


def _mm_and_softmax() -> tuple[torch.dtype, torch.dtype]:
    x = torch.randn(3, 3)
    return torch.mm(x, x).dtype, torch.softmax(x, -1).dtype


@settings(max_examples=60, deadline=None)
@given(regions=st.lists(REGIONS, min_size=1, max_size=5))
def test_the_innermost_region_of_the_op_device_governs_it(regions):
    amp.set_policy("aten::mm", "fp32", "cpu")
    amp.set_policy("aten::softmax.int", "lower_precision_fp", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.autocast("cuda") without CUDA warns
        with contextlib.ExitStack() as stack:
            for depth, region in enumerate(regions, 1):
                _enter(stack, region)
                assert _mm_and_softmax() == _expected_mm_and_softmax(regions[:depth])
    assert _mm_and_softmax() == (torch.float32, torch.float32)
    assert not in_scaledoptim_region("cpu")


@settings(max_examples=60, deadline=None)
@given(regions=st.lists(REGIONS, min_size=1, max_size=5))
def test_exiting_nested_regions_restores_the_outer_region(regions):
    amp.set_policy("aten::mm", "fp32", "cpu")
    amp.set_policy("aten::softmax.int", "lower_precision_fp", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stacks = []
        try:
            for region in regions:
                stack = contextlib.ExitStack()
                stack.__enter__()
                _enter(stack, region)
                stacks.append(stack)
            for depth in range(len(regions), 0, -1):
                assert _mm_and_softmax() == _expected_mm_and_softmax(regions[:depth])
                stacks.pop().close()
        finally:
            while stacks:
                stacks.pop().close()
    assert _mm_and_softmax() == (torch.float32, torch.float32)


def test_disabled_cuda_region_inside_a_cpu_region():
    # A region that does nothing on the CPU still switched the policies off, when regions were
    # told apart by torch's one nesting counter (Note [telling regions apart]).
    amp.set_policy("aten::mm", "fp32", "cpu")
    x = torch.randn(3, 3)
    with amp.autocast("cpu", dtype=torch.bfloat16):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast("cuda", enabled=False):
                assert torch.mm(x, x).dtype == torch.float32
                assert in_scaledoptim_region("cpu")
        assert torch.mm(x, x).dtype == torch.float32


def test_a_region_entered_without_torch_autocast_gets_torch_policies():
    # Raw state changes leave no record of their device type (Note [telling regions apart]):
    # scaledoptim's policies stand down, as in a plain torch region, until the level is back.
    amp.set_policy("aten::mm", "fp32", "cpu")
    x = torch.randn(3, 3)
    with amp.autocast("cpu", dtype=torch.bfloat16):
        torch.autocast_increment_nesting()
        try:
            assert torch.mm(x, x).dtype == torch.bfloat16
        finally:
            torch.autocast_decrement_nesting()
        assert torch.mm(x, x).dtype == torch.float32


def test_torch_autocast_in_torchscript_still_works():
    with amp.autocast("cpu"):  # scaledoptim now records torch.autocast regions
        pass

    @torch.jit.script
    def scripted(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.mm(x, x)

    x = torch.randn(3, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert torch.equal(scripted(x), torch.mm(x.bfloat16(), x.bfloat16()))


def test_importing_scaledoptim_leaves_torch_autocast_alone():
    # The recording hooks are installed by the first scaledoptim region, not by the import;
    # they call torch's methods unchanged.
    script = (
        "import torch\n"
        "cls = torch.amp.autocast_mode.autocast\n"
        "enter, exit_ = cls.__enter__, cls.__exit__\n"
        "import scaledoptim.amp as amp\n"
        "assert (cls.__enter__, cls.__exit__) == (enter, exit_)\n"
        "with amp.autocast('cpu'):\n"
        "    pass\n"
        "assert cls.__enter__.__wrapped__ is enter and cls.__exit__.__wrapped__ is exit_\n"
    )
    root = str(pathlib.Path(__file__).resolve().parents[2])
    subprocess.run([sys.executable, "-c", script], check=True, cwd=root, timeout=120)
