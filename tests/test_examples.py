"""The README's main job at a small scale: scaledoptim trains as well as fp32 and torch.amp."""

from __future__ import annotations

import math

import pytest
from prerequisites import require_module

from scaledoptim.examples.compare import format_table, relative_gap, run_variants
from scaledoptim.examples.train import RunConfig, train

# growth_interval=5 makes the scale grow into fp16 overflows within 60 steps
TINY = RunConfig(task="lm", size="tiny", steps=60, growth_interval=5, progress=False)


@pytest.fixture(scope="module")
def compared():
    return {r.config.variant: r for r in run_variants(TINY, ["fp32", "torch.amp", "scaledoptim"])}


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
    assert compared["fp32"].scales == [] and not any(compared["fp32"].skipped)


def test_table_reports_every_variant_and_the_gaps(compared) -> None:
    table = format_table(list(compared.values()))
    for variant in compared:
        assert f"\n{variant} " in table
    assert "scaledoptim final loss vs fp32:" in table
    assert "tokens/s" in table and "peak RSS MB" in table


def test_lbfgs_replays_overflowing_closures_and_trains() -> None:
    result = train(RunConfig(task="lm", size="tiny", variant="scaledoptim-lbfgs", steps=4,
                             progress=False))  # fmt: skip
    assert result.scales[0] == 2.0**24 and result.scales[-1] < 2.0**24  # replayed, backed off
    assert not any(result.skipped)  # replay means no step is ever skipped
    assert math.isfinite(result.final_loss) and result.final_loss < result.losses[0]


def test_bfloat16_trains_without_a_scale() -> None:
    config = RunConfig(task="cnn", size="tiny", steps=5, dtype="bfloat16", progress=False)
    result = train(config)
    assert result.scales == [] and not any(result.skipped)


def test_plot_writes_a_png(compared, tmp_path) -> None:
    require_module("matplotlib", "the plot is written with the plot extra")
    from scaledoptim.examples.plot import write_plot

    path = tmp_path / "compare.png"
    write_plot({"lm": list(compared.values())}, path)
    assert path.read_bytes().startswith(b"\x89PNG")
