"""``import scaledoptim`` against ``import torch``: wall time of the import in fresh interpreters.

Each round starts one interpreter per module, interleaved, with ``python -X importtime -c "import
<module>"`` and reads the cumulative time of the module's own top-level entry (so the interpreter's
start-up is left out; ``import scaledoptim`` includes ``import torch``). Prints the median of the
rounds for each module and the ratio of the medians (the goal: at most 1.15, importing scaledoptim
costs little beyond torch). Also says which heavy torch modules ``import scaledoptim`` pulled in.

    python benchmarks/import_time.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

HEAVY = ("torch._dynamo", "torch._inductor", "torch.fx.experimental.symbolic_shapes", "sympy")


def import_us(module: str) -> int:
    """Microseconds ``import module`` takes in a fresh interpreter (``-X importtime``)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        capture_output=True, text=True, check=True,
    )
    for line in reversed(done.stderr.splitlines()):
        # "import time:   self [us] | cumulative | imported package"; top level has no indent.
        parts = line.split("|")
        if len(parts) == 3 and parts[2].rstrip() == f" {module}":
            return int(parts[1])
    raise RuntimeError(f"no top-level import time for {module!r} in:\n{done.stderr[-2000:]}")


def heavy_modules(module: str) -> list[str]:
    code = f"import sys, {module}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[int]] = {"torch": [], "scaledoptim": []}
    import_us("scaledoptim")  # warm the file-system cache and the bytecode caches
    for _ in range(args.rounds):
        for module in times:
            times[module].append(import_us(module))
    medians = {module: statistics.median(values) for module, values in times.items()}
    for module, values in times.items():
        print(f"import {module:<12} median {medians[module] / 1e3:8.1f} ms  "
              f"runs {[round(v / 1e3, 1) for v in values]}")
    print(
        f"ratio scaledoptim/torch: {medians['scaledoptim'] / medians['torch']:.3f} (target <= 1.15)"
    )
    print(f"heavy modules after import scaledoptim: {heavy_modules('scaledoptim') or 'none'}")


if __name__ == "__main__":
    main()
