"""Run by test_emulator_sanitizer.py under AddressSanitizer: ``clean`` launches every kernel of
KERNEL_CASES, with every option of its grid and every param x grad dtype, on odd-sized tensors
and misaligned views, printing ``clean <kernel>`` after each; ``overflow`` deliberately reads
past a tensor, to prove the sanitizer is watching."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo

import ctypes  # noqa: E402
import itertools  # noqa: E402

import torch  # noqa: E402

from scaledoptim import kernels  # noqa: E402
from scaledoptim.kernels import emulator, launch_config  # noqa: E402
from scaledoptim.kernels.table import plan_launches  # noqa: E402
from tests.kernels.kernel_reference import (  # noqa: E402
    CHUNK,
    DTYPES,
    EMULATOR_THREADS,
    misaligned,
)
from tests.kernels.kernel_table import KERNEL_CASES, launch_case  # noqa: E402

launch_config.chunk_size = CHUNK
launch_config.emulator_threads_per_block = EMULATOR_THREADS


def odd_and_misaligned(dtype: torch.dtype) -> list[torch.Tensor]:
    tensors = [torch.randn(n).to(dtype) for n in (1, 3, 5, 63, 65, 199)]
    for n in (1, 3, 7, 64, 199):
        storage = torch.randn(n + 1).to(dtype)
        tensors.append(storage[1:])  # storage offset 1: every vector load misaligned
    return tensors


def clean() -> None:
    generator = torch.Generator().manual_seed(0)
    dtype_pairs = list(itertools.product(DTYPES, DTYPES))
    for case in KERNEL_CASES:
        options = case.all_options()
        # Every option and every param x grad dtype pair at least once, cycling the shorter.
        for i in range(max(len(options), len(dtype_pairs))):
            p_dtype, g_dtype = dtype_pairs[i % len(dtype_pairs)]
            params, grads = odd_and_misaligned(p_dtype), odd_and_misaligned(g_dtype)
            lists = case.make_lists(params, grads, options[i % len(options)], generator)
            if case.update:  # the state misaligned too
                lists[2:-1] = [[misaligned(t) for t in ts] for ts in lists[2:-1]]
            found_inf = torch.zeros(())
            launch_case(case, lists, options[i % len(options)], found_inf, torch.tensor(2.0))
            assert found_inf.item() == 0, case.name  # finite tensors
            if case.update:  # the counters advanced once, found_inf being zero
                assert all(s.item() == 1 for s in lists[-1]), case.name
        print(f"clean {case.name}", flush=True)


def overflow() -> None:
    x = torch.randn(13)
    kernel = kernels.NON_FINITE_CHECK
    found_inf = torch.zeros(())
    args = kernels.NonFiniteCheckArgs(found_inf.data_ptr())
    (planned,) = plan_launches([(x.data_ptr(),)], [x.numel() + 3], 1, launch_config.chunk_size)
    params = (ctypes.c_void_p * 2)(ctypes.addressof(planned.table), ctypes.addressof(args))
    emulator.launch(kernel, kernel.instantiation((torch.float32,)), params, planned.n_chunks, 8)
    print("overflow not detected")


if __name__ == "__main__":
    {"clean": clean, "overflow": overflow}[sys.argv[1]]()
