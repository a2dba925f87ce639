"""8-bit optimizer states against float32 states and the anchors, in one run: held-out loss of
the char-level transformer, optimizer-state bytes per param, and CPU step time.

Runs AdamW with float32 states (scaledoptim's), scaledoptim's ``state_bits=8``, torchao's
``AdamW8bit`` and bitsandbytes' ``AdamW8bit`` (each where it imports; the table says which did
not and why), from the same init on the same batches:

* quality: the example char transformer (``scaledoptim.examples``' language model; fp32
  training) for ``--steps`` steps, its held-out loss every ``--every`` steps;
* memory: the bytes of every optimizer-state tensor after training (the step counters aside),
  over the model's params; for torchao's states the codes and scales inside its tensor
  subclass;
* speed: ``--params`` fp32 params (1000 x 1000 matrices) and fixed grads on ``--threads``
  threads, one step per optimizer per round, interleaved over ``--rounds`` rounds (torchao's
  step compiled by its first call, which is timed apart); each optimizer's median.

It prints the load average at the start and the end, the table (markdown), and writes the loss
curves and the memory bars as PNGs beside the docs page (``--plots``, default
``docs/images``). With ``--batch-sizes 16 17 18`` it also times ours with the torch form's
batches of ``2**k`` elements (``LOWBIT_BATCH``, Note [low-bit batches]), interleaved with the
others, in a second table::

    python benchmarks/lowbit_states.py [--steps 300] [--params 4000000] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import scaledoptim
from scaledoptim.examples.tasks import SIZES, language_model
from scaledoptim.fused.lowbit import form as lowbit_form

OptimizerMaker = Callable[[list[torch.nn.Parameter]], Any]


def makers() -> tuple[dict[str, OptimizerMaker], dict[str, str]]:
    """The optimizers that import here (name -> maker), and why the others did not."""
    made: dict[str, OptimizerMaker] = {
        "float32 states (scaledoptim.AdamW)": lambda p: scaledoptim.AdamW(p, lr=LR),
        "ours: state_bits=8": lambda p: scaledoptim.AdamW(p, lr=LR, state_bits=8),
    }
    missing = {}
    try:
        from torchao.optim import AdamW8bit as TorchaoAdamW8bit

        made["torchao AdamW8bit"] = lambda p: TorchaoAdamW8bit(p, lr=LR, weight_decay=0.01)
    except Exception as error:  # an anchor that does not import is reported, not fatal
        missing["torchao AdamW8bit"] = f"{type(error).__name__}: {error}"
    try:
        import bitsandbytes

        made["bitsandbytes AdamW8bit"] = lambda p: bitsandbytes.optim.AdamW8bit(
            p, lr=LR, weight_decay=0.01
        )
    except Exception as error:
        missing["bitsandbytes AdamW8bit"] = f"{type(error).__name__}: {error}"
    return made, missing


LR = 2e-3


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every state tensor but step counters (torchao's subclass: its inner tensors)."""
    total = 0
    for state in opt.state.values():
        for key, value in state.items():
            if key == "step" or not isinstance(value, torch.Tensor):
                continue
            if hasattr(value, "__tensor_flatten__") and type(value) is not torch.Tensor:
                names, _ = value.__tensor_flatten__()
                total += sum(getattr(value, n).numel() * getattr(value, n).element_size()
                             for n in names)
            else:
                total += value.numel() * value.element_size()
    return total


def train(make: OptimizerMaker, steps: int, every: int) -> tuple[list[tuple[int, float]], float]:
    """Held-out losses every ``every`` steps of the char transformer, and state bytes/param."""
    size = dataclass_replace(SIZES["cpu"], context=64, width=128, depth=2, text_batch=16)
    task = language_model(size, torch.device("cpu"))
    torch.manual_seed(0)
    model = task.make_model()
    params = list(model.parameters())
    opt = make(params)
    batches = task.batches(0)
    curve = [(0, task.eval_loss(model, 0))]
    for step in range(1, steps + 1):
        opt.zero_grad()
        task.loss(model, next(batches)).backward()
        opt.step()
        if step % every == 0 or step == steps:
            curve.append((step, task.eval_loss(model, 0)))
    return curve, state_bytes(opt) / sum(p.numel() for p in params)


def dataclass_replace(value: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(value, **changes)


class BatchedSteps:
    """An optimizer whose steps run the low-bit torch form in batches of ``batch`` elements."""

    def __init__(self, opt: torch.optim.Optimizer, batch: int) -> None:
        self.opt, self.batch = opt, batch

    def step(self) -> None:
        saved = lowbit_form.LOWBIT_BATCH
        lowbit_form.LOWBIT_BATCH = self.batch
        try:
            self.opt.step()
        finally:
            lowbit_form.LOWBIT_BATCH = saved


def step_times(
    made: dict[str, OptimizerMaker], numel: int, rounds: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Each optimizer's median step time (s), interleaved, and its first step's time."""
    side = 1000
    count = max(1, numel // (side * side))
    optimizers, first = {}, {}
    for name, make in made.items():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(side, side) * 0.02) for _ in range(count)]
        for p in params:
            p.grad = torch.randn(side, side) * 1e-3
        opt = make(params)
        start = time.perf_counter()
        opt.step()  # creates the state (and compiles torchao's step)
        first[name] = time.perf_counter() - start
        optimizers[name] = opt
    times: dict[str, list[float]] = {name: [] for name in made}
    names = list(made)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            optimizers[name].step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, first


def plots(curves: dict[str, list[tuple[int, float]]], memory: dict[str, float], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, curve in curves.items():
        ax.plot([s for s, _ in curve], [loss for _, loss in curve], label=name, marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title("AdamW on the char transformer: float32 vs 8-bit states")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "lowbit_loss.png", dpi=110)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = list(memory)
    ax.barh(names, [memory[n] for n in names], color="tab:blue")
    for i, n in enumerate(names):
        ax.text(memory[n], i, f" {memory[n]:.2f}", va="center")
    ax.set_xlabel("optimizer-state bytes per param")
    ax.set_title("AdamW state memory (char transformer)")
    ax.set_xlim(0, max(memory.values()) * 1.25)
    fig.tight_layout()
    fig.savefig(out / "lowbit_memory.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--params", type=int, default=4_000_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plots", type=Path, default=Path(__file__).parents[1] / "docs" / "images")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[],
                        help="also time ours with the torch form's batches of 2**k elements")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {args.threads}, load {os.getloadavg()}")
    made, missing = makers()
    curves, memory = {}, {}
    for name, make in made.items():
        curves[name], memory[name] = train(make, args.steps, args.every)
        print(f"{name}: final held-out loss {curves[name][-1][1]:.4f}, "
              f"{memory[name]:.3f} B/param", flush=True)
    ours = made["ours: state_bits=8"]
    batched: dict[str, OptimizerMaker] = {
        f"ours, batches of 2^{k}": lambda p, k=k: BatchedSteps(ours(p), 1 << k)
        for k in args.batch_sizes
    }
    times, first = step_times({**made, **batched}, args.params, args.rounds)
    base_name = next(iter(made))
    base_loss, base_time = curves[base_name][-1][1], times[base_name]
    print(f"\nload at the end {os.getloadavg()}\n")
    print(f"| AdamW | held-out loss after {args.steps} steps | vs float32 | state B/param | "
          f"step, {args.params / 1e6:.0f}M params, {args.threads} thread (ms) | vs float32 "
          "step | first step (s) |")
    print("|---|---|---|---|---|---|---|")
    for name in made:
        loss = curves[name][-1][1]
        print(f"| {name} | {loss:.4f} | {100 * (loss / base_loss - 1):+.2f}% | "
              f"{memory[name]:.2f} | {1e3 * times[name]:.1f} | {times[name] / base_time:.2f}x | "
              f"{first[name]:.1f} |")
    for name, why in missing.items():
        print(f"| {name} | did not import: {why} | | | | | |")
    if batched:
        print("\n| ours (the same bytes) | step (ms) | vs float32 step |\n|---|---|---|")
        for name in batched:
            print(f"| {name} | {1e3 * times[name]:.1f} | {times[name] / base_time:.2f}x |")
    plots(curves, memory, args.plots)


if __name__ == "__main__":
    main()
