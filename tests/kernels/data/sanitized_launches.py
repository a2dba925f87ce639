"""Run by test_emulator_sanitizer.py under AddressSanitizer: ``clean`` launches every kernel on
odd-sized tensors and misaligned views; ``overflow`` deliberately reads past a tensor, to prove
the sanitizer is watching."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (3, 1)]  # repo, tests/kernels

import ctypes  # noqa: E402

import torch  # noqa: E402
from kernel_reference import CHUNK, EMULATOR_THREADS, adam_options, sgd_options  # noqa: E402

from scaledoptim import kernels  # noqa: E402
from scaledoptim.kernels import emulator, launch_config  # noqa: E402
from scaledoptim.kernels.table import plan_launches  # noqa: E402

launch_config.chunk_size = CHUNK
launch_config.emulator_threads_per_block = EMULATOR_THREADS


def odd_and_misaligned(dtype: torch.dtype) -> list[torch.Tensor]:
    tensors = [torch.randn(n).to(dtype) for n in (1, 3, 5, 63, 65, 199)]
    for n in (1, 3, 7, 64, 199):
        storage = torch.randn(n + 1).to(dtype)
        tensors.append(storage[1:])  # storage offset 1: every vector load misaligned
    return tensors


def clean() -> None:
    for p_dtype in (torch.float32, torch.float16, torch.bfloat16):
        for g_dtype in (torch.float32, torch.bfloat16):
            params, grads = odd_and_misaligned(p_dtype), odd_and_misaligned(g_dtype)
            state = [[torch.zeros(p.numel() + 1)[1:] for p in params] for _ in range(3)]
            steps = [torch.zeros(()) for _ in params]
            found_inf = torch.zeros(())
            kernels.non_finite_check_(grads, found_inf)
            kernels.adam_(
                params,
                grads,
                *state,
                steps,
                **adam_options(
                    lr=0.1,
                    weight_decay=0.1,
                    decoupled_weight_decay=False,
                    amsgrad=True,
                    maximize=True,
                ),
                found_inf=found_inf,
                inv_scale=torch.tensor(2.0),
            )
            kernels.sgd_(
                params,
                grads,
                state[0],
                steps,
                **sgd_options(dampening=0.1, weight_decay=0.1),
                found_inf=found_inf,
                inv_scale=None,
            )
            assert found_inf.item() == 0 and all(s.item() == 2 for s in steps)
    print("clean")


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
