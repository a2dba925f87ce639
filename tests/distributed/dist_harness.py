"""Runs named scenarios on a gloo group of N local processes, one spawn for all of them.

Starting processes costs seconds on a small machine, so a world is spawned once per world size
and runs every scenario in order; each scenario's outcome (``None`` or the failure's traceback,
from whichever rank failed first) comes back for one pytest item per scenario.

Only a hang is bounded, never a slow run. On a busy machine (a load of 30 to 45 on 2 cores) a
world of 4 took 66 s, and the first emulated AdamW step of a process (a g++ build of its
kernels) 34 s, during which the other ranks wait at a collective: the old bounds (60 s a
collective, 240 s a world) made the verdict depend on the load. So the collective timeout is
long, and the world is ended only when no rank has finished a scenario for ``STALL_S``
(progress is counted, not hoped for from a time budget).
"""

from __future__ import annotations

import datetime
import os
import pathlib
import socket
import sys
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
STALL_S = 900.0

Scenario = Callable[[int, int, pathlib.Path], None]  # (rank, world_size, shared tmp dir)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_world(
    world_size: int, scenarios: dict[str, Scenario], tmp_dir: pathlib.Path
) -> dict[str, str | None]:
    """Runs every scenario on ``world_size`` gloo ranks; returns name -> traceback or None."""
    context = mp.spawn(
        _worker,
        args=(world_size, free_port(), scenarios, tmp_dir),
        nprocs=world_size,
        join=False,
    )
    finished, last_progress = 0, datetime.datetime.now()
    while not context.join(timeout=1.0):
        now_finished = len(list(tmp_dir.glob("*.rank*.done")))
        if now_finished != finished:
            finished, last_progress = now_finished, datetime.datetime.now()
        elif (datetime.datetime.now() - last_progress).total_seconds() > STALL_S:
            for process in context.processes:
                process.kill()
            raise TimeoutError(
                f"gloo world of {world_size}: no scenario finished on any rank in {STALL_S}s "
                f"({finished} done of {world_size * len(scenarios)}): hung"
            )
    outcomes = {}
    for name in scenarios:
        failures = sorted(tmp_dir.glob(f"{name}.rank*.failed"))
        outcomes[name] = failures[0].read_text() if failures else None
    return outcomes


def _worker(
    rank: int, world_size: int, port: int, scenarios: dict[str, Scenario], tmp_dir: pathlib.Path
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # 4 ranks on 2 cores: oversubscribing threads costs more than it gives
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        for name, scenario in scenarios.items():
            scenario_dir = tmp_dir / name
            scenario_dir.mkdir(exist_ok=True)
            try:
                scenario(rank, world_size, scenario_dir)
            except Exception:  # recorded for the pytest item; the next scenario still runs
                (tmp_dir / f"{name}.rank{rank}.failed").write_text(
                    f"rank {rank}:\n{traceback.format_exc()}"
                )
            (tmp_dir / f"{name}.rank{rank}.done").touch()  # progress, for the stall guard
            dist.barrier()  # a failed rank must not run ahead into the next scenario's collectives
    finally:
        dist.barrier()
        dist.destroy_process_group()
    # Every outcome is on disk: leave without the interpreter's finalization, where gloo's worker
    # threads can still be torn down joinable and abort the process ("terminate called without
    # an active exception", SIGABRT: pytorch/pytorch#179291), which made a passing world an error.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
