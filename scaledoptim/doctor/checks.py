"""The checks, as one list of named functions, and the loop that runs them."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import torch

from . import compile_check, graphs, host_cost, lowbit, parity, performance, sync_free
from .optimizers import OPTIMIZERS
from .outcome import Outcome

__all__ = ["CHECKS", "Check", "CheckResult", "Outcome", "run_checks"]


@dataclasses.dataclass(frozen=True)
class Check:
    """A named check.

    Args:
        name: short and stable (``--only`` and the JSON use it).
        description: what it verifies, one line.
        run: ``run(device) -> Outcome``; an exception counts as a failure, and
            ``Outcome.skip(why)`` as skipped.
        needs_gpu: reported as skipped on a machine without a CUDA device.
    """

    name: str
    description: str
    run: Callable[[torch.device], Outcome]
    needs_gpu: bool = False


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """A check's result: ``status`` is ``"pass"``, ``"fail"`` or ``"skip"``."""

    name: str
    description: str
    status: str
    detail: str
    seconds: float


CHECKS: tuple[Check, ...] = (
    Check("nvrtc-compile", "the CUDA kernels compile with NVRTC", compile_check.run),
    *(
        Check(
            f"parity:{row.name}",
            f"{row.name} x fp32/fp16/bf16 matches "
            f"{f'torch.optim.{row.name}' if row.reference else 'its torch form in float64'}; "
            "an inf skips the step",
            functools.partial(parity.run, row),
        )
        for row in OPTIMIZERS
    ),
    Check("parity:AdamW-8bit", "AdamW(state_bits=8) matches its torch form; an inf skips the "
          "step", lowbit.parity),
    Check("no-host-sync", "unscale_and_step never syncs with the host", sync_free.run),
    Check("cuda-graph", "unscale_and_step captured in a CUDA graph replays exactly",
          graphs.run, needs_gpu=True),
    Check("bandwidth", "fused AdamW moves bytes at near copy bandwidth",
          performance.bandwidth, needs_gpu=True),
    Check("step-time", "fused AdamW step vs GradScaler + torch fused AdamW",
          performance.step_time, needs_gpu=True),
    Check("clip-bandwidth", "fused AdamW clipping in the step moves bytes at near copy bandwidth",
          performance.clip_bandwidth, needs_gpu=True),
    Check("clip-step-time", "unscale_and_step(max_grad_norm=) vs GradScaler unscale_ + clip + step",
          performance.clip_step_time, needs_gpu=True),
    Check("lowbit-bandwidth", "AdamW(state_bits=8) moves its bytes at near copy bandwidth",
          lowbit.bandwidth, needs_gpu=True),
    Check("host-cost", "host time of a step, per tensor (launches off)", host_cost.run),
)


def run_checks(
    device: torch.device,
    checks: Sequence[Check] = CHECKS,
    report: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Runs ``checks`` on ``device`` in order; ``report`` sees each result as it comes."""
    results = []
    for check in checks:
        started = time.perf_counter()
        if check.needs_gpu and device.type != "cuda":
            status, detail = "skip", "skipped (no GPU)"
        else:
            try:
                outcome = check.run(device)
                status = "skip" if outcome.skipped else "pass" if outcome.passed else "fail"
                detail = outcome.detail
            except Exception as error:
                status, detail = "fail", f"{type(error).__name__}: {error}"
        result = CheckResult(
            check.name, check.description, status, detail, time.perf_counter() - started
        )
        results.append(result)
        if report is not None:
            report(result)
    return results
