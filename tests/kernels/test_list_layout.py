"""A kernel's list layout is declared once, by the names in its Python spec: the per-tensor and
per-chunk indices follow from them, and so does the C++ enum its source is compiled with (See
Note [list enums] in kernels/sources.py), which no ``.cu`` file writes by hand."""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import pytest

from scaledoptim import kernels
from scaledoptim.kernels import (
    CUDA_SOURCE_DIR,
    STEP_EPILOGUE,
    MultiTensorKernel,
    emulator,
    registered_kernels,
)
from scaledoptim.kernels.sources import kernel_source
from scaledoptim.optim.adam import ADAM_KERNEL
from scaledoptim.optim.lamb import LAMB_GRAD_NORM_KERNEL, LAMB_KERNEL, LAMB_NORMS_KERNEL
from scaledoptim.optim.sgd import SGD_KERNEL

_ROOT = Path(__file__).resolve().parents[2]


class _Args(ctypes.Structure):
    _fields_ = [("x", ctypes.c_float)]


def test_the_indices_follow_from_the_names() -> None:
    count = len(registered_kernels())
    sgd = SGD_KERNEL
    again = MultiTensorKernel(sgd.source, sgd.name, sgd.lists, sgd.args_type, dtype_lists=(0, 1))
    assert again == SGD_KERNEL and len(registered_kernels()) == count  # nothing new registered
    assert again.per_tensor_lists == (4, 5)  # sr_seeds, steps
    assert LAMB_KERNEL.per_tensor_lists == (7, 8)
    assert LAMB_KERNEL.per_chunk_lists == (4, 5)  # param_sq_partials, update_sq_partials
    assert LAMB_GRAD_NORM_KERNEL.per_chunk_lists == (1,)
    assert STEP_EPILOGUE.per_tensor_lists == ()  # list 0 is walked by element, whatever its name


def _members(kernel: MultiTensorKernel) -> list[str]:
    match = re.fullmatch(rf"enum {kernel.list_enum_name} \{{ ([^}}]*) \}};", kernel.list_enum)
    assert match is not None, kernel.list_enum
    return match.group(1).split(", ")


def test_the_enum_is_made_from_the_names() -> None:
    assert ADAM_KERNEL.list_enum == (
        "enum AdamList { kAdamParams, kAdamGrads, kAdamExpAvgs, kAdamExpAvgSqs, "
        "kAdamMaxExpAvgSqs, kAdamMasterParams, kAdamSrSeeds, kAdamSteps, kAdamLists };"
    )
    assert LAMB_GRAD_NORM_KERNEL.list_enum_name == "LambGradNormList"


@pytest.mark.parametrize("kernel", kernels.builtin_kernels(), ids=lambda k: k.name)
def test_each_list_has_its_member_in_order_then_the_count(kernel: MultiTensorKernel) -> None:
    prefix = "k" + kernel.list_enum_name.removesuffix("List")
    *members, count = _members(kernel)
    assert count == f"{prefix}Lists"
    assert all(m.startswith(prefix) for m in members), members
    # Back from CamelCase to the names: one member per list, in table order.
    snake = [re.sub(r"(?<!^)(?=[A-Z])", "_", m.removeprefix(prefix)).lower() for m in members]
    assert snake == list(kernel.lists)


@pytest.mark.parametrize("kernel", kernels.builtin_kernels(), ids=lambda k: k.name)
def test_the_table_is_sized_by_the_generated_count(kernel: MultiTensorKernel) -> None:
    size = re.search(rf"\b{kernel.name}\s*\(\s*TensorTable<(\w+)>", kernel.source.read_text())
    assert size is not None, kernel.name
    assert size.group(1) == _members(kernel)[-1]


def test_no_cu_file_writes_a_list_enum() -> None:
    generated = {k.list_enum_name for k in registered_kernels()}
    sources = [*CUDA_SOURCE_DIR.glob("*.cu"), *(_ROOT / "tests").rglob("*.cu")]
    assert len(sources) > 8
    for source in sources:
        declared = re.findall(r"\benum\s+(?:class\s+)?(\w+)", source.read_text())
        hand_written = [n for n in declared if n in generated or n.endswith("List")]
        assert not hand_written, f"{source}: {hand_written} (generate it from the names)"


def test_the_text_holds_the_enums_of_every_kernel_of_the_file() -> None:
    text = kernel_source(LAMB_GRAD_NORM_KERNEL)
    enums, body = text.split('#line 1 "lamb.cu"\n')
    for kernel in (LAMB_KERNEL, LAMB_NORMS_KERNEL, LAMB_GRAD_NORM_KERNEL):
        assert kernel.list_enum in enums.splitlines()
    assert body == LAMB_KERNEL.source.read_text()
    assert kernel_source(LAMB_KERNEL) == text  # one text for the file


def test_a_kernel_has_its_own_enum_where_a_variant_shares_its_name(tmp_path: Path) -> None:
    source = tmp_path / "variant.cu"
    source.write_text("// the kernel\n")
    first, other, variant = (
        MultiTensorKernel(source, name, lists, _Args)
        for name, lists in (("v_kernel", ("a",)), ("w_kernel", ("b",)), ("v_kernel", ("c",)))
    )
    assert kernel_source(first).splitlines()[1:3] == [first.list_enum, other.list_enum]
    assert kernel_source(variant).splitlines()[1:3] == [variant.list_enum, other.list_enum]


@pytest.mark.parametrize("written", ["enum SignSgdList { kA };", "enum class SignSgdList {kA};"])
def test_a_source_that_writes_its_list_enum_is_refused_naming_the_fix(
    tmp_path: Path, written: str
) -> None:
    source = tmp_path / "sign_sgd.cu"
    source.write_text(f"// a kernel written before the enums were generated\n{written}\n")
    kernel = MultiTensorKernel(source, "sign_sgd_kernel", ("params", "grads"), _Args)
    with pytest.raises(ValueError, match=r"defines the list enum SignSgdList itself.*delete"):
        kernel_source(kernel)


@pytest.mark.parametrize(
    "changed",
    [("params", "gradients", "steps"), ("grads", "params", "steps")],
    ids=["renamed", "moved"],
)
def test_a_renamed_or_moved_list_changes_the_text_and_the_cache_key(
    tmp_path: Path, changed: tuple[str, ...]
) -> None:
    # NVRTC's program is the text (CuPy's on-disk cache keys on it); the emulator's library
    # entry is named and verified by the key.
    source = tmp_path / "layout.cu"
    source.write_text("// the kernel\n")
    compiler = os.environ.get("CXX", "g++")
    texts, keys = set(), set()
    for lists in (("params", "grads", "steps"), changed):
        kernel = MultiTensorKernel(source, "layout_kernel", lists, _Args)
        texts.add(kernel_source(kernel))
        keys.add(emulator._build_inputs(kernel, emulator._flags(), compiler)[1])
    assert len(texts) == len(keys) == 2


@pytest.mark.parametrize("lists", [("params", "exp avgs"), ("params", "params"), ("a_b", "aB")])
def test_names_that_make_no_distinct_enum_members_are_refused(
    tmp_path: Path, lists: tuple[str, ...]
) -> None:
    count = len(registered_kernels())
    with pytest.raises(ValueError, match="must be C identifiers that make distinct enum members"):
        MultiTensorKernel(tmp_path / "bad.cu", "bad_kernel", lists, _Args)
    assert len(registered_kernels()) == count
