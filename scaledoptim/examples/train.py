"""One training driver, four ways to step: fp32, torch.amp, scaledoptim, scaledoptim LBFGS.

The variants differ only in how one batch becomes one optimizer step (the ``*_step`` builders);
the model, data, seed, progress bar, timing and evaluation are shared, so a comparison between
them compares the mixed-precision machinery and nothing else.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

import scaledoptim

from .data import Batch
from .tasks import SIZES, TASKS, Task

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - exercised only without the extra
    sys.exit("the examples show a progress bar: pip install tqdm (or scaledoptim[examples])")

# loss, the scale this step's backward used (None: unscaled), 1.0 if the step was skipped
StepResult = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor]
Step = Callable[[Batch], StepResult]

REFRESH_EVERY = 25  # the progress bar reads loss and scale on the host this often, no more


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines one training run; plain data, so it can cross processes."""

    task: str = "lm"
    variant: str = "scaledoptim"
    size: str = "cpu"
    steps: int | None = None  # None: the task's default length for this variant
    lr: float | None = None  # None: the task's AdamW learning rate
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float16"
    growth_interval: int = 25  # short, so the scale grows into overflows within a short run
    progress: bool = True


@dataclasses.dataclass
class RunResult:
    """What a run measured. ``scales`` is empty for unscaled runs (fp32, bf16)."""

    config: RunConfig
    losses: list[float]
    scales: list[float]
    skipped: list[bool]
    final_loss: float
    items_per_second: float
    unit: str
    peak_memory_mb: float
    parameters: int


def fp32_step(model: nn.Module, task: Task, config: RunConfig) -> Step:
    """The reference: fp32 throughout, torch's fused AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr or task.lr, fused=True)
    never_skipped = torch.zeros((), device=config.device)

    def step(batch: Batch) -> StepResult:
        loss = task.loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach(), None, never_skipped

    return step


def torch_amp_step(model: nn.Module, task: Task, config: RunConfig) -> Step:
    """torch.autocast + torch.amp.GradScaler + torch's fused AdamW: the loop users have today."""
    device_type, dtype = _autocast_args(config)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr or task.lr, fused=True)
    scaler = torch.amp.GradScaler(
        device_type, growth_interval=config.growth_interval, enabled=dtype == torch.float16
    )
    never_skipped = torch.zeros((), device=config.device)

    def step(batch: Batch) -> StepResult:
        with torch.autocast(device_type, dtype=dtype):
            loss = task.loss(model, batch)
        opt.zero_grad()
        scaler.scale(loss).backward()
        if not scaler.is_enabled():
            opt.step()
            return loss.detach(), None, never_skipped
        # GradScaler has no sync-free accessor (get_scale() calls .item()): read its tensor.
        used = scaler._scale.clone()
        scaler.step(opt)
        scaler.update()
        return loss.detach(), used, (scaler._scale < used).float()  # it backs off iff it skipped

    return step


def scaledoptim_step(model: nn.Module, task: Task, config: RunConfig) -> Step:
    """scaledoptim.autocast + scaledoptim.AdamW: the scale lives in the optimizer, no sync."""
    device_type, dtype = _autocast_args(config)
    opt = scaledoptim.AdamW(model.parameters(), lr=config.lr or task.lr)
    opt.configure_scaling(growth_interval=config.growth_interval)
    S = opt.scale if dtype == torch.float16 else None  # bf16 needs no scaling: same loop, S=None

    def step(batch: Batch) -> StepResult:
        with scaledoptim.autocast(device_type, dtype=dtype):
            loss = task.loss(model, batch)
        opt.zero_grad()
        used = None if S is None else S.clone()  # S is updated in place by the step
        scaledoptim.scale_outputs(loss, S).backward()
        _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=S)
        return loss.detach(), used, found_inf

    return step


def scaledoptim_lbfgs_step(model: nn.Module, task: Task, config: RunConfig) -> Step:
    """scaledoptim.LBFGS with closure replay, which GradScaler cannot do.

    The scale starts at 2**24, far too large for fp16, so the first closure evaluations
    overflow and are replayed with a backed-off scale until their grads are finite.
    """
    device_type, dtype = _autocast_args(config)
    # lr=1 is LBFGS's natural step; the strong-Wolfe line search shortens it where needed.
    opt = scaledoptim.LBFGS(
        model.parameters(), lr=1.0, max_iter=4, history_size=10, line_search_fn="strong_wolfe"
    )
    opt.configure_scaling(init_scale=2.0**24, growth_interval=config.growth_interval)
    S = opt.scale

    def step(batch: Batch) -> StepResult:
        def closure(S: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            with scaledoptim.autocast(device_type, dtype=dtype):
                loss = task.loss(model, batch)
            scaledoptim.scale_outputs(loss, S).backward()
            return loss

        used = S.clone()
        loss, found_inf, _ = opt.unscale_and_step(closure, grads_scaled_by=S)
        return loss.detach(), used, found_inf

    return step


VARIANTS: dict[str, Callable[[nn.Module, Task, RunConfig], Step]] = {
    "fp32": fp32_step,
    "torch.amp": torch_amp_step,
    "scaledoptim": scaledoptim_step,
    "scaledoptim-lbfgs": scaledoptim_lbfgs_step,
}
# An LBFGS step evaluates the closure several times; fewer steps keep its run time comparable.
EVALUATIONS_PER_STEP = {"scaledoptim-lbfgs": 8}


def train(config: RunConfig) -> RunResult:
    """Trains ``config.task`` with ``config.variant`` from ``config.seed`` and measures it."""
    device = torch.device(config.device)
    task = TASKS[config.task](SIZES[config.size], device)
    torch.manual_seed(config.seed)
    model = task.make_model()
    step = VARIANTS[config.variant](model, task, config)
    batches = task.batches(config.seed)
    steps = config.steps or task.default_steps // EVALUATIONS_PER_STEP.get(config.variant, 1)
    warmup = max(1, steps // 20)  # first steps allocate state and warm caches: not timed
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    history: list[StepResult] = []
    skipped = torch.zeros((), device=device)
    bar = tqdm(
        range(steps), desc=f"{task.name} {config.variant}", disable=not config.progress
    )
    for i in bar:
        if i == warmup:
            _synchronize(device)
            started = time.perf_counter()
        history.append(step(next(batches)))
        skipped += history[-1][2]
        if i % REFRESH_EVERY == 0 or i == steps - 1:
            loss, scale, _ = history[-1]
            bar.set_postfix(
                loss=f"{loss.item():.3f}",
                scale="-" if scale is None else f"{scale.item():.0f}",
                skipped=int(skipped.item()),
            )
    _synchronize(device)
    elapsed = time.perf_counter() - started

    losses, scales, skips = zip(*history)
    return RunResult(
        config=config,
        losses=torch.stack(losses).tolist(),
        scales=[] if scales[0] is None else torch.stack(scales).tolist(),
        skipped=[bool(s) for s in torch.stack(skips).tolist()],
        final_loss=task.eval_loss(model, config.seed),
        items_per_second=(steps - warmup) * task.items_per_batch / elapsed,
        unit=task.unit,
        peak_memory_mb=_peak_memory_mb(device),
        parameters=sum(p.numel() for p in model.parameters()),
    )


def _autocast_args(config: RunConfig) -> tuple[str, torch.dtype]:
    return torch.device(config.device).type, getattr(torch, config.dtype)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak bytes allocated by tensors. CPU: the whole process's peak RSS (Linux: KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
