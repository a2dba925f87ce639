"""See Note [vector lanes] (cuda/multi_tensor_apply.cuh): the update kernels move every list in
16-byte accesses where its chunk is aligned (one per 8 lanes of a 16-bit list, two float4 of an
fp32 one) and fall back to guarded scalars elsewhere, with the same bits either way.

Checked on the CPU: the PTX NVRTC generates (no GPU needed), and the emulator on tensors whose
storage offsets leave every alignment, with tails of every length 1..7 after the last whole
vector, aligned and misaligned tensors in one list, against the same update on fresh (aligned)
copies. Parity with each row's reference is the parity table's (tests/parity)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from prerequisites import require_module

from scaledoptim.kernels import MultiTensorKernel
from scaledoptim.optim.adagrad import ADAGRAD_KERNEL
from scaledoptim.optim.adam import ADAM_KERNEL
from scaledoptim.optim.lion import LION_KERNEL
from scaledoptim.optim.rmsprop import RMSPROP_KERNEL
from scaledoptim.optim.sgd import SGD_KERNEL
from scaledoptim.testing.optim_db import rows
from tests.support.launches import row_update
from tests.support.tensors import CHUNK, DTYPES, assert_bytes_unchanged

# The kernels built on update_each; LAMB's sum across lanes, so they keep 4 lanes.
UPDATE_EACH_KERNELS = (ADAM_KERNEL, SGD_KERNEL, RMSPROP_KERNEL, LION_KERNEL, ADAGRAD_KERNEL)
_GLOBAL_VECTOR_ACCESS = re.compile(r"\b(?:ld|st)\.global\.v([24])\.[a-z]+(\d+)\b")


def _ptx_entries(kernel: MultiTensorKernel, arch: int = 90) -> dict[str, str]:
    """Each instantiation's PTX, compiled by NVRTC as the CUDA backend compiles it."""
    from cupy.cuda import nvrtc

    from scaledoptim.kernels.nvrtc import compile_options
    from scaledoptim.kernels.sources import kernel_source

    program = nvrtc.createProgram(kernel_source(kernel), kernel.source.name, [], [])
    try:
        for name in kernel.instantiations():
            nvrtc.addNameExpression(program, name)
        nvrtc.compileProgram(
            program, [*compile_options(kernel), f"--gpu-architecture=compute_{arch}"]
        )
        ptx = nvrtc.getPTX(program)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        return {
            name: ptx.split(f".entry {nvrtc.getLoweredName(program, name)}(")[1].split(".entry")[0]
            for name in kernel.instantiations()
        }
    finally:
        nvrtc.destroyProgram(program)


@pytest.mark.parametrize("kernel", UPDATE_EACH_KERNELS, ids=lambda k: k.name)
def test_every_vector_access_of_an_update_kernel_moves_16_bytes(kernel: MultiTensorKernel) -> None:
    require_module("cupy", "the PTX comes from CuPy's NVRTC bindings")
    for name, ptx in _ptx_entries(kernel).items():
        widths = {int(n) * int(bits) // 8 for n, bits in _GLOBAL_VECTOR_ACCESS.findall(ptx)}
        assert widths == {16}, f"{name}: vector accesses of {sorted(widths)} bytes"


def _at_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of ``t`` viewed at storage offset ``offset`` (in elements)."""
    storage = torch.empty(t.numel() + offset, dtype=t.dtype)
    view = storage[offset:]
    view.copy_(t)
    return view


# Whole vectors of 8 lanes plus a tail of each length 0..7, within one chunk and across chunks.
SIZES = [8 * k + tail for k, tail in zip((1, 2, 3, 5, 6, 7, 1, 2), range(8))] + [3 * CHUNK + 5]
OFFSETS = range(8)  # fp32: 16-byte aligned at 0 and 4; 16-bit: at 0 only


@pytest.mark.parametrize(
    "info", [i for i in rows(fused=True) if set(i.launched_kernels) <= set(UPDATE_EACH_KERNELS)],
    ids=str,
)
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("param_dtype", DTYPES, ids=str)
def test_misaligned_tensors_and_tails_update_as_aligned_ones(info, param_dtype, grad_dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    params = [torch.randn(n, generator=generator).to(param_dtype) for n in SIZES]
    grads = [torch.randn(n, generator=generator).to(grad_dtype) for n in SIZES]
    aligned = row_update(info, params, grads)
    # List k of tensor i at storage offset (i + k) % 8: each list mixes aligned and misaligned
    # tensors, and a tensor's lists disagree (the kernel then takes scalars for all of them).
    shifted = [
        [_at_offset(t, (i + k) % len(OFFSETS)) if t.dim() else t.clone() for i, t in enumerate(ts)]
        for k, ts in enumerate(aligned.lists)
    ]
    misaligned = dataclasses.replace(aligned, lists=shifted)
    found_inf, inv_scale = torch.zeros(()), torch.tensor(0.5)
    for _ in range(2):
        aligned.launch(found_inf, inv_scale)
        misaligned.launch(found_inf, inv_scale)
    assert_bytes_unchanged(aligned.tensors, misaligned.tensors)
