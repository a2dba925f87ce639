"""The mutation check: does the test suite still catch the defects it caught?

Each mutant of ``tools/mutant_catalog.py`` is applied to a fresh copy of the checkout (the files
git tracks or would track: uncommitted edits included, the working tree itself never touched),
and the suite runs against that copy with ``-x``: first the mutant's own test paths, then, only
if they all pass, the rest of the suite. A failure (or an error, in collection too) is *caught*;
a suite that passes is *missed*; a mutant whose original text no longer occurs exactly once is
*stale* (update it in the catalog); one that runs past ``--timeout`` is *timeout*.

Usage (from the repository root)::

    python tools/mutants.py                      # every mutant; a line each, then a summary
    python tools/mutants.py --list               # which apply, which are stale; runs nothing
    python tools/mutants.py -k lion -k lamb      # those whose name contains a word
    python tools/mutants.py --first-only         # only each mutant's own test paths (quick)
    python tools/mutants.py --json after.json --compare before.json

``--compare`` names the mutants a previous report caught that this run did not catch, and exits
non-zero if there are any.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mutant_catalog import CATALOG, Mutant

ROOT = Path(__file__).resolve().parents[1]
PYTEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider", "-rfE", "--no-header")
_FAILURE_LINE = re.compile(r"^(FAILED|ERROR) (\S+)", re.MULTILINE)


@dataclasses.dataclass
class Outcome:
    """What one mutant did: ``status`` is caught, missed, stale, timeout or broken."""

    name: str
    status: str
    phase: str = ""  # "first" (its own paths) or "rest" (the rest of the suite)
    test: str = ""  # the first failing test, when caught
    seconds: float = 0.0
    detail: str = ""


def checkout_files(root: Path) -> list[str]:
    """The files git tracks or would track in ``root`` (ignored files left out)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, check=True, capture_output=True,
    ).stdout.decode()
    return [name for name in listed.split("\0") if name and (root / name).is_file()]


def copy_checkout(root: Path, files: list[str], into: Path) -> None:
    for name in files:
        if not (root / name).is_file():  # deleted since it was listed
            continue
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)


def stale_reason(root: Path, mutant: Mutant) -> str | None:
    """Why ``mutant`` no longer applies to ``root``, or ``None``."""
    for edit in mutant.edits:
        path = root / edit.path
        if not path.is_file():
            return f"{edit.path} is gone"
        count = path.read_text().count(edit.original)
        if count != 1:
            return f"its text occurs {count} times in {edit.path}"
    return None


def apply_edits(copy: Path, mutant: Mutant) -> None:
    for edit in mutant.edits:
        path = copy / edit.path
        path.write_text(path.read_text().replace(edit.original, edit.replacement, 1))


def run_pytest(
    copy: Path, paths: list[str], ignore: list[str], env: dict[str, str], timeout: float
) -> tuple[int | None, str]:
    """pytest ``-x`` on ``paths`` in ``copy``: (exit code or ``None`` on timeout, output)."""
    command = [sys.executable, "-m", "pytest", *PYTEST_ARGS, *paths]
    command += [f"--ignore={path}" for path in ignore]
    process = subprocess.Popen(
        command, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # pytest and any worlds it spawned
        output, _ = process.communicate()
        return None, output
    return process.returncode, output


def first_failure(output: str) -> str:
    match = _FAILURE_LINE.search(output)
    if match:
        return match.group(2)
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def run_mutant(mutant: Mutant, env: dict[str, str], args: argparse.Namespace) -> Outcome:
    reason = stale_reason(ROOT, mutant)
    if reason:
        return Outcome(mutant.name, "stale", detail=reason)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        copy = Path(tmp)
        copy_checkout(ROOT, checkout_files(ROOT), copy)  # the checkout as it is now
        apply_edits(copy, mutant)
        first = [path for path in mutant.first if (copy / path).exists()]
        phases = [("first", first, [])] if first else []
        if not args.first_only:
            phases.append(("rest", ["tests"], first))
        for phase, paths, ignore in phases:
            left = args.timeout - (time.monotonic() - started)
            code, output = run_pytest(copy, paths, ignore, env, left)
            seconds = time.monotonic() - started
            if code is None:
                return Outcome(mutant.name, "timeout", phase, seconds=seconds,
                               detail=f"still passing after {args.timeout:.0f} s")
            if code in (1, 2, 3):  # failures, an interrupted run (collection errors), internal
                return Outcome(mutant.name, "caught", phase, first_failure(output), seconds)
            if code not in (0, 5):
                return Outcome(mutant.name, "broken", phase, seconds=seconds,
                               detail=f"pytest exited {code}: {first_failure(output)}")
        return Outcome(mutant.name, "missed", seconds=time.monotonic() - started,
                       detail="first paths only" if args.first_only else "")


def pytest_env(cache_dir: Path) -> dict[str, str]:
    """The suite's environment: its own kernel caches (a mutated kernel's build never lands in
    the user's), no bytecode written, no kernel mode inherited."""
    env = dict(os.environ)
    env.pop("SCALEDOPTIM_KERNELS", None)
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    env["SCALEDOPTIM_CACHE_DIR"] = str(cache_dir)
    env["CUPY_CACHE_DIR"] = str(cache_dir / "cupy")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_imports_the_copy(files: list[str], env: dict[str, str]) -> None:
    """Refuses to run when a copy's tests would import another checkout's scaledoptim."""
    with tempfile.TemporaryDirectory(prefix="mutant-check-") as tmp:
        copy_checkout(ROOT, [f for f in files if f.startswith("scaledoptim/")], Path(tmp))
        found = subprocess.run(
            [sys.executable, "-c", "import scaledoptim; print(scaledoptim.__file__)"],
            cwd=tmp, env=env, capture_output=True, text=True, check=True,
        ).stdout.strip()
        if not found.startswith(tmp):
            sys.exit(f"a copy of the checkout imports {found}, not its own scaledoptim")


def line(outcome: Outcome) -> str:
    where = f"{outcome.phase:5}" if outcome.phase else "     "
    what = outcome.test or outcome.detail
    return f"{outcome.status:8} {outcome.name:40} {where} {outcome.seconds:6.0f}s  {what}"


def compare(outcomes: list[Outcome], previous_path: Path) -> list[str]:
    """Names a previous report caught that this run did not (stale ones included)."""
    previous = json.loads(previous_path.read_text())
    caught_before = {o["name"] for o in previous["mutants"] if o["status"] == "caught"}
    now = {o.name: o.status for o in outcomes}
    return sorted(name for name in caught_before if name in now and now[name] != "caught")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="names", action="append", default=[],
                        help="run the mutants whose name contains this (repeatable)")
    parser.add_argument("--list", action="store_true", help="say which apply; run nothing")
    parser.add_argument("--first-only", action="store_true",
                        help="run only each mutant's own test paths")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds per mutant, both phases together (default 1800)")
    parser.add_argument("--cache-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / f"scaledoptim-mutants-{os.getuid()}",
                        help="kernel caches of the runs (kept between runs: builds are reused)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--compare", type=Path,
                        help="a previous --json report: fail if a mutant it caught is not caught")
    args = parser.parse_args(argv)
    mutants = [m for m in CATALOG if not args.names or any(k in m.name for k in args.names)]
    if args.list:
        for mutant in mutants:
            reason = stale_reason(ROOT, mutant)
            print(f"{'stale' if reason else 'applies':8} {mutant.name:40} "
                  f"{reason or mutant.description}")
        return 0
    env = pytest_env(args.cache_dir)
    check_imports_the_copy(checkout_files(ROOT), env)
    print(f"{len(mutants)} mutants of {ROOT} (timeout {args.timeout:.0f} s each; "
          f"load average {os.getloadavg()[0]:.1f})", flush=True)
    outcomes = []
    for mutant in mutants:
        outcome = run_mutant(mutant, env, args)
        outcomes.append(outcome)
        print(line(outcome), flush=True)
    counts = {s: sum(o.status == s for o in outcomes)
              for s in ("caught", "missed", "stale", "timeout", "broken")}
    print("summary: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
          + f" of {len(outcomes)}; load average {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(
            {"mutants": [dataclasses.asdict(o) for o in outcomes]}, indent=1) + "\n")
    status = 0 if counts["caught"] == len(outcomes) else 1
    if args.compare:
        lost = compare(outcomes, args.compare)
        print("caught before, not now: " + (", ".join(lost) if lost else "none"))
        status = 1 if lost else status
    return status


if __name__ == "__main__":
    sys.exit(main())
