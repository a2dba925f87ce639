"""The README's main job at a small scale: scaledoptim trains as well as fp32 and torch.amp,
without the host reads GradScaler makes, and LBFGS trains with closure replay."""

from __future__ import annotations

import math

import pytest
from prerequisites import require_module

from scaledoptim.examples.compare import (
    format_table,
    gradscaler_refusal,
    paired_difference,
    relative_gap,
    run_interleaved,
)
from scaledoptim.examples.demo import main, parse_args
from scaledoptim.examples.deps import problems
from scaledoptim.examples.hostreads import HostReads
from scaledoptim.examples.train import RunConfig

# growth_interval=5 makes the scale grow into fp16 overflows within 60 steps
TINY = RunConfig(task="lm", size="tiny", steps=60, growth_interval=5)


@pytest.fixture(scope="module")
def compared():
    results = run_interleaved(TINY, ["fp32", "torch.amp", "scaledoptim"])
    return {r.config.variant: r for r in results}


@pytest.fixture(scope="module")
def lbfgs():
    config = RunConfig(task="lbfgs", size="tiny", growth_interval=10)
    return {
        r.config.variant: r for r in run_interleaved(config, ["fp32-lbfgs", "scaledoptim-lbfgs"])
    }


def test_scaledoptim_final_loss_matches_fp32_and_torch_amp(compared) -> None:
    ours = compared["scaledoptim"]
    assert ours.final_loss < ours.losses[0] * 0.6  # it learned something
    assert relative_gap(ours, compared["fp32"]) < 0.02
    assert relative_gap(ours, compared["torch.amp"]) < 0.02


def test_skips_and_scales_follow_gradscaler(compared) -> None:
    ours, theirs = compared["scaledoptim"], compared["torch.amp"]
    assert sum(ours.skipped) > 0  # overflows happened, so scaling was exercised
    assert ours.skipped == theirs.skipped
    assert ours.scales == theirs.scales
    assert len(set(ours.scales)) > 2  # the scale moved: grew and backed off
    assert compared["fp32"].scales == [] and not any(compared["fp32"].skipped)


def test_host_reads_gradscaler_one_per_step_scaledoptim_none(compared) -> None:
    assert compared["torch.amp"].host_reads_per_step == 1.0  # found_inf, non-fused AdamW
    assert compared["scaledoptim"].host_reads_per_step == 0.0
    assert compared["fp32"].host_reads_per_step == 0.0


def test_host_reads_counts_each_read_once_and_restores_torch() -> None:
    import torch

    reads, t, host_counter = HostReads(), torch.ones(3), torch.zeros(())
    with reads.counting(ignore=frozenset({id(host_counter)})):
        t.sum().item(), bool(t[1] > 0), t.tolist(), float(t[2]), t.cpu(), host_counter.item()
    assert reads.count == 5
    t.sum().item()
    assert reads.count == 5 and "item" not in torch.Tensor.__dict__


def test_table_reports_every_variant_reads_and_timing_verdicts(compared) -> None:
    table = format_table(list(compared.values()))
    for variant in compared:
        assert f"\n{variant} " in table
    assert "scaledoptim held-out loss vs fp32:" in table
    assert "host reads/step" in table and "optim ms" in table
    assert "optimizer phase: scaledoptim" in table and "iteration: scaledoptim" in table


def test_timing_difference_inside_the_spread_is_called_noise() -> None:
    noisy = paired_difference([1.0, 3.0, 1.0, 3.0, 2.0], [2.0, 2.0, 2.0, 2.0, 2.0])
    assert noisy.within_noise and "within noise" in noisy.describe("x", "a", "b")
    clear = paired_difference([1.0, 1.1, 0.9, 1.0, 1.0], [2.0, 2.1, 1.9, 2.0, 2.0])
    assert not clear.within_noise and "faster than b" in clear.describe("x", "a", "b")


def test_lbfgs_replays_overflowing_closures_and_matches_fp32_lbfgs(lbfgs) -> None:
    ours, reference = lbfgs["scaledoptim-lbfgs"], lbfgs["fp32-lbfgs"]
    assert ours.scales[0] == 2.0**24 and sum(ours.replays) > 0  # replayed, backed off
    assert ours.replays[0] > 0 and not any(ours.skipped)  # replay means no step is skipped
    assert ours.evaluations > len(ours.losses) and reference.evaluations > len(reference.losses)
    assert math.isfinite(ours.final_loss) and ours.final_loss < ours.losses[0]
    assert relative_gap(ours, reference) < 0.05
    table = format_table(list(lbfgs.values()))
    assert "replays" in table and "scaledoptim-lbfgs held-out loss vs fp32-lbfgs" in table


def test_gradscaler_refuses_the_lbfgs_closure() -> None:
    assert "raises RuntimeError" in gradscaler_refusal("cpu")


def test_bfloat16_trains_without_a_scale() -> None:
    config = RunConfig(task="cnn", size="tiny", steps=5, dtype="bfloat16")
    (result,) = run_interleaved(config, ["scaledoptim"])
    assert result.scales == [] and not any(result.skipped)


def test_missing_extras_and_devices_are_reported_before_training(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("matplotlib", "tqdm") else real(name, *a),
    )
    args = parse_args(["--plot", "x.png", "--device", "cuda:0" if not _has_cuda() else "cpu"])
    found = problems(args)
    assert any("scaledoptim[plot]" in p for p in found)
    assert any("scaledoptim[examples]" in p for p in found)
    if not _has_cuda():
        assert any("no CUDA GPU" in p and "--device cpu" in p for p in found)
    with pytest.raises(SystemExit, match="scaledoptim\\[plot\\]"):
        main(["--plot", "x.png", "--no-progress"])


def test_plot_writes_a_png(compared, lbfgs, tmp_path) -> None:
    require_module("matplotlib", "the plot is written with the plot extra")
    from scaledoptim.examples.plot import write_plot

    path = tmp_path / "compare.png"
    write_plot({"lm": list(compared.values()), "lbfgs": list(lbfgs.values())}, path)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_hf_gpt2_trains_like_the_built_in_models() -> None:
    require_module("transformers", "the hf-gpt2 example runs with the examples-hf extra")
    config = RunConfig(task="hf-gpt2", size="tiny", steps=40, growth_interval=5)
    results = {
        r.config.variant: r for r in run_interleaved(config, ["fp32", "torch.amp", "scaledoptim"])
    }
    ours = results["scaledoptim"]
    assert ours.final_loss < ours.losses[0] * 0.8
    assert relative_gap(ours, results["torch.amp"]) < 0.02
    assert relative_gap(ours, results["fp32"]) < 0.05  # 40 steps: still early in training
    assert ours.skipped == results["torch.amp"].skipped and sum(ours.skipped) > 0
    assert "hf-gpt2 (transformers.GPT2LMHeadModel)" in format_table(list(results.values()))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
