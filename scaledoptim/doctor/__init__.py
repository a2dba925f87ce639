"""``python -m scaledoptim.doctor``: what this machine runs, and whether it runs it right.

Prints the environment (torch, CUDA, CuPy, NVRTC, device, compute capability), then runs
:data:`~scaledoptim.doctor.checks.CHECKS` and prints a pass/fail table; ``--json PATH`` writes the
same as JSON. The exit status is 1 when any check failed. On a CPU-only machine the GPU checks
report *skipped* and the kernels run through the CPU emulator; the whole run takes well under a
minute there. Run it first on a new machine, and on a GPU after any driver or CUDA upgrade.

``python -m scaledoptim.doctor.gpu_report REPORT.md`` runs the GPU tests, the CUDA benchmarks and
the doctor, and writes one report.
"""

from __future__ import annotations

from .checks import CHECKS, Check, CheckResult, run_checks
from .environment import environment
from .optimizers import OPTIMIZERS
from .outcome import Outcome

__all__ = [
    "CHECKS",
    "OPTIMIZERS",
    "Check",
    "CheckResult",
    "Outcome",
    "environment",
    "run_checks",
]
