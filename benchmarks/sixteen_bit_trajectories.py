"""16-bit params: scaledoptim (fp32 state, one rounding per step) against torch.optim (state in
the param's dtype) for every generic config of every optimizer with a torch.optim reference.

Run: ``python benchmarks/sixteen_bit_trajectories.py`` (CPU, a few seconds). Prints, per config
and dtype, the largest distance between the two params in 16-bit ulps after the first and the
20th step (non-finite values counted as the dtype's largest), and the step at which each side
first holds a non-finite param. docs/migration.md ("16-bit params") shows its output.
"""

from __future__ import annotations

import torch

from scaledoptim.testing.optim_db import rows

STEPS = 20


def _ordered(t: torch.Tensor) -> torch.Tensor:
    bits = t.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -32768 - bits, bits)  # sign-magnitude -> monotonic integers


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest elementwise distance between two 16-bit tensors, in ulps."""
    a, b = a.detach().nan_to_num(), b.detach().nan_to_num()
    return int((_ordered(a) - _ordered(b)).abs().max().item())


def first_non_finite(history: list[bool]) -> int | None:
    return next((k + 1 for k, finite in enumerate(history) if not finite), None)


def main() -> None:
    torch.set_num_threads(1)
    for info in rows(fused=True, reference=True):
        assert info.reference is not None
        for config in info.generic_configs:
            for dtype in (torch.float16, torch.bfloat16):
                generator = torch.Generator().manual_seed(0)
                start = torch.randn(4096, generator=generator).to(dtype)
                grads = [
                    (torch.randn(4096, generator=generator) * 1e-3).to(dtype) for _ in range(STEPS)
                ]
                theirs = start.clone().requires_grad_()
                ours = start.clone().requires_grad_()
                torch_opt = info.reference([theirs], **config.kwargs)
                our_opt = info.make([ours], config)
                distances, torch_finite, our_finite = [], [], []
                for grad in grads:
                    theirs.grad, ours.grad = grad.clone(), grad.clone()
                    torch_opt.step()
                    our_opt.step()
                    distances.append(ulps(theirs, ours))
                    torch_finite.append(bool(torch.isfinite(theirs).all()))
                    our_finite.append(bool(torch.isfinite(ours).all()))
                print(
                    f"{info.name:8s} {config.name:28s} {str(dtype)[6:]:9s} "
                    f"step1 {distances[0]:>6} ulp  step{STEPS} {distances[-1]:>6} ulp  "
                    f"torch nonfinite at {first_non_finite(torch_finite)}  "
                    f"ours {first_non_finite(our_finite)}"
                )


if __name__ == "__main__":
    main()
