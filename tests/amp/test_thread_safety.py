"""Editing policies while other threads run ops (Note [policy slots]).

The stress run is a subprocess, so a crash of the interpreter fails the test instead of
killing pytest.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import threading

import torch

from scaledoptim import amp

_ROOT = str(pathlib.Path(__file__).resolve().parents[2])

# Worker threads run mm (torch has a C++ Autocast kernel) and softmax (torch has none) in
# scaledoptim and plain torch regions; the main thread edits and resets both CYCLES times and
# checks, on its own thread, that the policy it just set is the one in force. After each edit
# and each reset it waits until every worker has finished a call since: the overlap is counted,
# not hoped for from a time budget (a busy machine slows the workers, not the assertions). The
# wait's timeout only ends a hung run.
_STRESS = r"""
import json, sys, threading, torch
from scaledoptim import amp

torch.set_num_threads(1)
CYCLES = int(sys.argv[1])
LOW = torch.bfloat16
DEFAULT, EDITED = (LOW, torch.float32), (torch.float32, LOW)
# What each worker may see, per op: either policy in a scaledoptim region, since the two
# ops are edited one after the other; always torch's default in a plain torch region.
EITHER = ({LOW, torch.float32},) * 2
TORCHS = ({LOW}, {torch.float32})
stop = threading.Event()
progress = threading.Condition()
errors, calls = [], [0, 0, 0, 0]

def dtypes():
    x = torch.randn(4, 4)
    return torch.mm(x, x).dtype, torch.softmax(x, -1).dtype

def worker(index, region, allowed):
    try:
        while not stop.is_set():
            with region("cpu", dtype=LOW):
                seen = dtypes()
            assert all(dtype in options for dtype, options in zip(seen, allowed)), seen
            with progress:
                calls[index] += 1
                progress.notify_all()
    except BaseException as error:
        errors.append(repr(error))
        with progress:
            calls[index] = -1  # wakes the main thread, which then stops
            progress.notify_all()

def every_worker_called_since(before):
    with progress:
        if not progress.wait_for(
            lambda: all(now > then or now < 0 for now, then in zip(calls, before)), timeout=120
        ):
            raise RuntimeError(f"a worker made no call in 120 s: {calls}")
        if min(calls) < 0:
            raise RuntimeError("a worker failed")
        return list(calls)

threads = [
    threading.Thread(target=worker, args=(i, region, allowed))
    for i, (region, allowed) in enumerate(
        [(amp.autocast, EITHER), (torch.autocast, TORCHS)] * 2
    )
]
for thread in threads:
    thread.start()
cycles = 0
try:
    seen = list(calls)
    for cycles in range(CYCLES):
        amp.set_policy("aten::mm", "fp32", "cpu")
        amp.set_policy("aten::softmax", "lower_precision_fp", "cpu")
        with amp.autocast("cpu", dtype=LOW):
            assert dtypes() == EDITED, dtypes()
        seen = every_worker_called_since(seen)
        if cycles % 2:
            amp.reset_policy()
        else:
            amp.reset_policy("aten::mm", "cpu")
            amp.set_policy("aten::softmax", None, "cpu")  # torch's default for softmax
        with amp.autocast("cpu", dtype=LOW):
            assert dtypes() == DEFAULT, dtypes()
        seen = every_worker_called_since(seen)
    cycles += 1
except BaseException as error:
    errors.append(repr(error))
finally:
    stop.set()
    for thread in threads:
        thread.join()
print(json.dumps({"cycles": cycles, "calls": calls, "errors": errors}))
"""
_CYCLES = 20


def test_editing_policies_while_threads_run_ops_is_safe():
    result = subprocess.run(
        [sys.executable, "-c", _STRESS, str(_CYCLES)],
        check=False, cwd=_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    report = json.loads(result.stdout)
    assert report["errors"] == []
    assert report["cycles"] == _CYCLES
    # Every worker ran ops under the edited and the reset policies in every cycle.
    assert min(report["calls"]) >= 2 * _CYCLES


def test_edits_take_effect_and_revert_for_every_thread():
    seen = {}

    def worker(name):
        with amp.autocast("cpu", dtype=torch.bfloat16):
            seen[name] = torch.exp(torch.randn(2)).dtype

    def run(name):
        thread = threading.Thread(target=worker, args=(name,))
        thread.start()
        thread.join()

    run("before")
    amp.set_policy("aten::exp", "lower_precision_fp", "cpu")
    run("edited")
    amp.reset_policy("aten::exp")
    run("reset")
    assert seen == {"before": torch.float32, "edited": torch.bfloat16, "reset": torch.float32}
