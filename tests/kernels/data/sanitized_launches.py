"""Run by test_emulator_sanitizer.py under AddressSanitizer: ``clean`` launches the update of
every fused row of optim_db (its grad reduction, kernels and step epilogue), with every config
and every param x grad dtype pair, on odd-sized tensors and misaligned views (state and rounding
lists misaligned too), printing ``clean <row>`` after each, and the inf/nan check, printing
``clean non_finite_check``; ``overflow`` deliberately reads past a tensor, to prove the
sanitizer is watching."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo

import ctypes
import itertools
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from scaledoptim import kernels
from scaledoptim.kernels import emulator, launch_config
from scaledoptim.kernels.table import plan_launches
from scaledoptim.testing.optim_db import rows
from tests.support.launches import row_update
from tests.support.tensors import CHUNK, DTYPES, EMULATOR_THREADS, misaligned

launch_config.chunk_size = CHUNK
launch_config.emulator_threads_per_block = EMULATOR_THREADS


def odd_and_misaligned(dtype: torch.dtype) -> list[torch.Tensor]:
    tensors = [torch.randn(n).to(dtype) for n in (1, 3, 5, 63, 65, 199)]
    for n in (1, 3, 7, 64, 199):
        storage = torch.randn(n + 1).to(dtype)
        tensors.append(storage[1:])  # storage offset 1: every vector load misaligned
    return tensors


def build_every_kernel() -> None:
    """Builds the sanitized emulator library of every built-in kernel, on every core: the
    compiles are most of this script's time, and each is a g++ process of its own. Prints
    ``built <kernel>`` after each (the test's progress)."""
    every = kernels.builtin_kernels()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for kernel, _ in zip(every, pool.map(emulator.emulator_library, every)):
            print(f"built {kernel.name}", flush=True)


def clean() -> None:
    build_every_kernel()
    dtype_pairs = list(itertools.product(DTYPES, DTYPES))
    for info in rows(fused=True):
        configs = info.configs
        # Every config and every param x grad dtype pair at least once, cycling the shorter.
        for i in range(max(len(configs), len(dtype_pairs))):
            p_dtype, g_dtype = dtype_pairs[i % len(dtype_pairs)]
            params, grads = odd_and_misaligned(p_dtype), odd_and_misaligned(g_dtype)
            update = row_update(info, params, grads, configs[i % len(configs)])
            # The state, scratch and rounding lists misaligned too.
            update.lists[2:-1] = [[misaligned(t) for t in ts] for ts in update.lists[2:-1]]
            found_inf = torch.zeros(())
            update.launch(found_inf, torch.tensor(2.0))
            assert found_inf.item() == 0, info.name  # finite tensors
            assert all(s.item() == 1 for s in update.steps), info.name  # advanced once
        print(f"clean {info.name}", flush=True)
    for dtype in DTYPES:
        found_inf = torch.zeros(())
        kernels.non_finite_check_(odd_and_misaligned(dtype), found_inf)
        assert found_inf.item() == 0
    print("clean non_finite_check", flush=True)


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
