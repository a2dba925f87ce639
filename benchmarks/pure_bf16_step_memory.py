"""Transient memory of one AdamW step per param rounding option on the CPU (torch's ops): the
peak of what the step allocates beyond params, grads and state, in bytes per param.

    python benchmarks/pure_bf16_step_memory.py

500 params of 10k elements; the third step is profiled (state and plan exist by then).
docs/recipes/pure-bf16.md ("Memory per parameter") shows its output.
"""

from __future__ import annotations

import torch
from transient_memory import peak_transient_bytes

import scaledoptim

OPTIONS = {
    "fp32 params": (torch.float32, {}),
    "bf16, round to nearest": (torch.bfloat16, {}),
    "bf16, master_weights": (torch.bfloat16, dict(master_weights=True)),
    "bf16, stochastic_rounding": (torch.bfloat16, dict(stochastic_rounding=True)),
}


def transient_bytes_per_param(dtype: torch.dtype, options: dict[str, bool]) -> float:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(10_000).to(dtype)) for _ in range(500)]
    for p in params:
        p.grad = (torch.randn(10_000) * 1e-3).to(dtype)
    opt = scaledoptim.AdamW(params, lr=1e-3, **options)
    for _ in range(2):
        opt.unscale_and_step(grads_scaled_by=None)
    peak = peak_transient_bytes(lambda: opt.unscale_and_step(grads_scaled_by=None))
    return peak / sum(p.numel() for p in params)


def main() -> None:
    torch.set_num_threads(1)
    print("| option | step transient (CPU) |")
    print("|---|---|")
    for name, (dtype, options) in OPTIONS.items():
        print(f"| {name} | +{transient_bytes_per_param(dtype, options):.1f} B/param |")


if __name__ == "__main__":
    main()
