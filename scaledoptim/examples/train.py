"""One training driver, five ways to step: fp32, torch.amp and scaledoptim with AdamW, and
fp32 and scaledoptim with LBFGS.

The variants differ only in how one batch becomes one optimizer step (the ``*_step`` builders);
the model, data, seed, timing, host-read counting and evaluation are shared, so a comparison
between them compares the mixed-precision machinery and nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import scaledoptim

from .data import Batch
from .hostreads import HostReads, host_side_counters
from .tasks import ALL_TASKS, SIZES, Task

LBFGS_MAX_ITER = 5  # LBFGS iterations per step(); each evaluates the closure once or more
# scaledoptim-lbfgs's first scale: far too large for fp16, so that the replay shows at once.
LBFGS_INIT_SCALE = 2.0**24


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines one training run."""

    task: str = "lm"
    variant: str = "scaledoptim"
    size: str = "cpu"
    steps: int | None = None  # None: the task's default length for this size
    lr: float | None = None  # None: the task's learning rate
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float16"
    growth_interval: int = 25  # short, so the scale grows into overflows within a short run
    # torch's intra-op threads while training on a CPU (None: torch's setting, left alone). The
    # small CPU models run fastest on one: more threads only add hand-offs, and on a busy
    # machine threads that wait for each other's cores multiply the run time (see compare.py).
    threads: int | None = 1


@dataclasses.dataclass
class Stepper:
    """How one variant turns a batch into a step, split at the start of the optimizer phase.

    ``optimizer_phase`` returns the loss, the scale the backward used (``None``: unscaled) and
    1.0 if the step was skipped, all as tensors, so that nothing is read on the host.
    """

    optimizer: torch.optim.Optimizer
    forward_backward: Callable[[Batch], None]
    optimizer_phase: Callable[[Batch], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]
    evaluations: int = 0  # closure evaluations (LBFGS only)
    replays: torch.Tensor | None = None  # overflowed evaluations, each replayed (scaled LBFGS)


@dataclasses.dataclass
class RunResult:
    """What a run measured. ``scales`` is empty for unscaled runs (fp32, bf16)."""

    config: RunConfig
    title: str
    losses: list[float]  # training loss of every step
    scales: list[float]  # the scale each step's (first) backward used
    skipped: list[bool]
    replays: list[int]  # per step, closure evaluations replayed after an overflow (LBFGS)
    evaluations: int  # closure evaluations in all (LBFGS), replays included, else 0
    evaluations_per_step: float  # the same, averaged over the timed steps
    final_loss: float  # fp32 loss on held-out data
    iteration_ms: list[float]  # per timed step: forward, backward and optimizer phase
    optimizer_ms: list[float]  # per timed step: the optimizer phase alone
    host_reads_per_step: float  # in the optimizer phase, averaged over the timed steps
    host_reads_by_module: dict[str, float]  # the same, split by the module that read
    unit: str
    items_per_batch: int
    parameters: int

    @property
    def label(self) -> str:
        return self.config.variant

    @property
    def median_iteration_ms(self) -> float:
        return statistics.median(self.iteration_ms)

    @property
    def median_optimizer_ms(self) -> float:
        return statistics.median(self.optimizer_ms)


def fp32_step(model: nn.Module, task: Task, config: RunConfig) -> Stepper:
    """The reference: fp32 throughout, torch.optim.AdamW as most loops create it."""
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr or task.lr)
    never_skipped = torch.zeros((), device=config.device)
    out: dict[str, torch.Tensor] = {}

    def forward_backward(batch: Batch) -> None:
        out["loss"] = task.loss(model, batch)
        opt.zero_grad()
        out["loss"].backward()

    def optimizer_phase(batch: Batch) -> tuple[torch.Tensor, None, torch.Tensor]:
        opt.step()
        return out["loss"].detach(), None, never_skipped

    return Stepper(opt, forward_backward, optimizer_phase)


def torch_amp_step(model: nn.Module, task: Task, config: RunConfig, fused: bool = False) -> Stepper:
    """torch.autocast + torch.amp.GradScaler + torch.optim.AdamW: the loop users have today.

    The optimizer is torch's default (not ``fused=True``), so ``GradScaler.step`` reads
    ``found_inf`` on the host once per step to decide whether to step. With ``fused=True``
    (the "torch.amp-fused" variant) it reads nothing: the fused step skips on device. That is
    the kernel scaledoptim's AdamW runs on a CPU, so the two train bit for bit alike there.
    """
    device_type, dtype = _autocast_args(config)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr or task.lr, fused=fused or None)
    scaler = torch.amp.GradScaler(
        device_type, growth_interval=config.growth_interval, enabled=dtype == torch.float16
    )
    never_skipped = torch.zeros((), device=config.device)
    out: dict[str, torch.Tensor] = {}
    used_scale: dict[str, torch.Tensor | None] = {}

    def forward_backward(batch: Batch) -> None:
        with torch.autocast(device_type, dtype=dtype):
            out["loss"] = task.loss(model, batch)
        opt.zero_grad()
        scaled = scaler.scale(out["loss"])  # creates the scale tensor on the first call
        # GradScaler has no sync-free accessor (get_scale() calls .item()): read its tensor.
        used_scale["used"] = scaler._scale.clone() if scaler._scale is not None else None
        scaled.backward()

    def optimizer_phase(batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        scaler.step(opt)
        scaler.update()
        used = used_scale["used"]
        if used is None or scaler._scale is None:
            return out["loss"].detach(), None, never_skipped
        return out["loss"].detach(), used, (scaler._scale < used).float()  # backs off iff skipped

    return Stepper(opt, forward_backward, optimizer_phase)


def scaledoptim_step(model: nn.Module, task: Task, config: RunConfig) -> Stepper:
    """scaledoptim.autocast + scaledoptim.AdamW: the scale lives in the optimizer, no sync."""
    device_type, dtype = _autocast_args(config)
    opt = scaledoptim.AdamW(model.parameters(), lr=config.lr or task.lr)
    opt.configure_scaling(growth_interval=config.growth_interval)
    S = opt.scale if dtype == torch.float16 else None  # bf16 needs no scaling: same loop, S=None
    out: dict[str, torch.Tensor] = {}
    used_scale: dict[str, torch.Tensor | None] = {}

    def forward_backward(batch: Batch) -> None:
        with scaledoptim.autocast(device_type, dtype=dtype):
            out["loss"] = task.loss(model, batch)
        opt.zero_grad()
        used_scale["used"] = None if S is None else S.clone()  # the step updates S in place
        scaledoptim.scale_outputs(out["loss"], S).backward()

    def optimizer_phase(batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=S)
        return out["loss"].detach(), used_scale["used"], found_inf

    return Stepper(opt, forward_backward, optimizer_phase)


def fp32_lbfgs_step(model: nn.Module, task: Task, config: RunConfig) -> Stepper:
    """The LBFGS reference: torch.optim.LBFGS in fp32."""
    opt = torch.optim.LBFGS(model.parameters(), **_lbfgs_args(task, config))
    never_skipped = torch.zeros((), device=config.device)

    def optimizer_phase(batch: Batch) -> tuple[torch.Tensor, None, torch.Tensor]:
        def closure() -> torch.Tensor:
            stepper.evaluations += 1
            opt.zero_grad()
            loss = task.loss(model, batch)
            loss.backward()
            return loss

        return opt.step(closure).detach(), None, never_skipped

    stepper = Stepper(opt, _no_forward_backward, optimizer_phase)
    return stepper


def scaledoptim_lbfgs_step(model: nn.Module, task: Task, config: RunConfig) -> Stepper:
    """scaledoptim.LBFGS in fp16 with closure replay, which GradScaler refuses.

    The scale starts at 2**24, far too large for fp16, so the first closure evaluations
    overflow and are replayed with a backed-off scale until their grads are finite; the scale
    then grows back every ``growth_interval`` evaluations and overflows again. The closure
    unscales its own grads, so it sees ``found_inf`` and can count replays on the device.
    """
    device_type, dtype = _autocast_args(config)
    opt = scaledoptim.LBFGS(model.parameters(), **_lbfgs_args(task, config))
    opt.configure_scaling(init_scale=LBFGS_INIT_SCALE, growth_interval=config.growth_interval)
    S = opt.scale

    def optimizer_phase(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def closure(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            stepper.evaluations += 1
            opt.zero_grad()
            with scaledoptim.autocast(device_type, dtype=dtype):
                loss = task.loss(model, batch)
            scaledoptim.scale_outputs(loss, scale).backward()
            found_inf, next_scale = opt.unscale(grads_scaled_by=scale)
            assert stepper.replays is not None  # set below, before the first step
            stepper.replays += found_inf  # an overflowed evaluation is replayed
            return loss, found_inf, next_scale

        used = S.clone()
        stepped = opt.step_after_unscale(closure, current_grad_scale=S)
        assert stepped is not None  # a closure's step returns (loss, found_inf, scale)
        loss = stepped[0]
        return loss.detach(), used, torch.zeros_like(used)  # replay means nothing is skipped

    stepper = Stepper(opt, _no_forward_backward, optimizer_phase, replays=torch.zeros_like(S))
    return stepper


VARIANTS: dict[str, Callable[[nn.Module, Task, RunConfig], Stepper]] = {
    "fp32": fp32_step,
    "torch.amp": torch_amp_step,
    "torch.amp-fused": functools.partial(torch_amp_step, fused=True),
    "scaledoptim": scaledoptim_step,
    "fp32-lbfgs": fp32_lbfgs_step,
    "scaledoptim-lbfgs": scaledoptim_lbfgs_step,
}


class Run:
    """One variant's model, optimizer, data stream and measurements, advanced a step at a time.

    Several runs advance in turn (see ``compare.run_interleaved``), so each builds everything
    from its own seed and shares nothing with the others.
    """

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.task = ALL_TASKS[config.task](SIZES[config.size], self.device)
        torch.manual_seed(config.seed)
        self.model = self.task.make_model()
        self.stepper = VARIANTS[config.variant](self.model, self.task, config)
        self.batches = self.task.batches(config.seed)
        self.steps = config.steps or self.task.default_steps
        self.warmup = max(2, self.steps // 10)  # first steps allocate state: not timed
        self.history: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        self.replays: list[torch.Tensor] = []
        self.iteration_ms: list[float] = []
        self.optimizer_ms: list[float] = []
        self.host_reads: list[HostReads] = []
        self.evaluations: list[int] = []  # per timed step

    def step(self) -> None:
        """Trains one step, timing it and counting the optimizer phase's host reads."""
        batch = next(self.batches)
        reads = HostReads()
        evaluations = self.stepper.evaluations
        _synchronize(self.device)
        started = time.perf_counter()
        self.stepper.forward_backward(batch)
        _synchronize(self.device)
        optimizer_started = time.perf_counter()
        with reads.counting(ignore=host_side_counters(self.stepper.optimizer)):
            self.history.append(self.stepper.optimizer_phase(batch))
            _synchronize(self.device)
        ended = time.perf_counter()
        if self.stepper.replays is not None:
            self.replays.append(self.stepper.replays.clone())
        if len(self.history) > self.warmup:
            self.iteration_ms.append(1e3 * (ended - started))
            self.optimizer_ms.append(1e3 * (ended - optimizer_started))
            self.host_reads.append(reads)
            self.evaluations.append(self.stepper.evaluations - evaluations)

    def result(self) -> RunResult:
        """Reads the measurements on the host (once, at the end) and evaluates the model."""
        losses, scales, skips = zip(*self.history)
        replays = torch.stack(self.replays).tolist() if self.replays else []
        return RunResult(
            config=self.config,
            title=self.task.title,
            losses=torch.stack(losses).tolist(),
            scales=[] if scales[0] is None else torch.stack(scales).tolist(),
            skipped=[bool(s) for s in torch.stack(skips).tolist()],
            replays=[int(b - a) for a, b in zip([0.0, *replays], replays)],
            evaluations=self.stepper.evaluations,
            evaluations_per_step=statistics.mean(self.evaluations),
            final_loss=self.task.eval_loss(self.model, self.config.seed),
            iteration_ms=self.iteration_ms,
            optimizer_ms=self.optimizer_ms,
            host_reads_per_step=statistics.mean(r.count for r in self.host_reads),
            host_reads_by_module={
                module: sum(r.by_module[module] for r in self.host_reads) / len(self.host_reads)
                for module in sorted({m for r in self.host_reads for m in r.by_module})
            },
            unit=self.task.unit,
            items_per_batch=self.task.items_per_batch,
            parameters=sum(p.numel() for p in self.model.parameters()),
        )


@contextlib.contextmanager
def cpu_threads(config: RunConfig) -> Iterator[None]:
    """Trains on ``config.threads`` intra-op threads inside the block when the device is a CPU,
    and restores torch's setting after; a GPU run, or ``threads=None``, leaves it alone."""
    if config.threads is None or torch.device(config.device).type != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _lbfgs_args(task: Task, config: RunConfig) -> dict[str, Any]:
    return {"lr": config.lr or task.lr, "max_iter": LBFGS_MAX_ITER, "history_size": 20,
            "line_search_fn": "strong_wolfe"}


def _no_forward_backward(batch: Batch) -> None:
    """LBFGS runs forward and backward inside its closure, in the optimizer phase."""


def _autocast_args(config: RunConfig) -> tuple[str, torch.dtype]:
    return torch.device(config.device).type, getattr(torch, config.dtype)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
