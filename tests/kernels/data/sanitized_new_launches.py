"""Run by test_emulator_sanitizer_new_kernels.py under AddressSanitizer: the Lion, Adagrad and
LAMB kernels, and every kernel's rounding lists, on odd-sized tensors and misaligned views."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [
    str(Path(__file__).resolve().parents[i]) for i in (3, 2, 1)
]  # repo, tests, tests/kernels

import torch
from kernel_reference import (
    CHUNK,
    EMULATOR_THREADS,
    adagrad_options,
    adam_options,
    lamb_options,
    lion_options,
)
from sanitized_launches import odd_and_misaligned

from scaledoptim import kernels
from scaledoptim.kernels import launch_config
from scaledoptim.optim.rounding import initial_seed

launch_config.chunk_size = CHUNK
launch_config.emulator_threads_per_block = EMULATOR_THREADS


def clean() -> None:
    for p_dtype in (torch.float32, torch.float16, torch.bfloat16):
        params, grads = odd_and_misaligned(p_dtype), odd_and_misaligned(torch.bfloat16)
        state = [[torch.zeros(p.numel() + 1)[1:] for p in params] for _ in range(2)]
        steps = [torch.zeros(()) for _ in params]
        masters = [torch.zeros(p.numel() + 1)[1:].copy_(p) for p in params]
        rounding = [dict(), dict(master_params=masters)]
        if p_dtype == torch.bfloat16:
            rounding.append(dict(sr_seeds=[initial_seed(i) for i in range(len(params))]))
        for r in rounding:
            common = dict(found_inf=torch.zeros(()), inv_scale=torch.tensor(0.5), **r)
            kernels.lion_(
                params, grads, state[0], steps, **lion_options(weight_decay=0.1), **common
            )
            kernels.adagrad_(
                params, grads, state[1], steps, **adagrad_options(weight_decay=0.1), **common
            )
            kernels.lamb_(params, grads, *state, steps, **lamb_options(), **common)
            kernels.adam_(params, grads, *state, [], steps, **adam_options(), **common)
        assert all(s.item() == 4 * len(rounding) for s in steps)
    print("clean")


if __name__ == "__main__":
    clean()
