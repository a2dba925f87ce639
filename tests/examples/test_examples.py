"""The README's main job at a small scale: scaledoptim trains as well as fp32 and torch.amp,
without the host reads GradScaler makes, and LBFGS trains with closure replay."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re

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


def test_lbfgs_host_reads_are_lbfgs_own_plus_the_replays_and_the_table_says_whose(lbfgs) -> None:
    # torch's LBFGS reads the host itself (float(loss), its line search's comparisons): every
    # read of the fp32 run is LBFGS's. The replay adds the scale and found_inf per evaluation.
    reference, ours = lbfgs["fp32-lbfgs"], lbfgs["scaledoptim-lbfgs"]
    assert set(reference.host_reads_by_module) == {"torch.optim.lbfgs"}
    assert reference.host_reads_by_module["torch.optim.lbfgs"] > 10
    assert set(ours.host_reads_by_module) == {"torch.optim.lbfgs", "scaledoptim.protocol.replay"}
    replay = ours.host_reads_by_module["scaledoptim.protocol.replay"]
    assert 2 * ours.evaluations_per_step <= replay <= 3 * ours.evaluations_per_step
    assert sum(ours.host_reads_by_module.values()) == pytest.approx(ours.host_reads_per_step)
    note = " ".join(format_table(list(lbfgs.values())).split())
    assert "torch.optim.LBFGS reads the host itself" in note
    assert f"fp32-lbfgs {reference.host_reads_per_step:.1f} by LBFGS;" in note
    assert (f"scaledoptim-lbfgs {ours.host_reads_by_module['torch.optim.lbfgs']:.1f} by LBFGS + "
            f"{replay:.1f} by the replay ({replay / ours.evaluations_per_step:.1f}/evaluation)"
            ) in note


def test_scaledoptim_on_a_cpu_is_gradscaler_with_torch_fused_adamw_bit_for_bit() -> None:
    # Why scaledoptim and torch.amp end apart on the CNN: on a CPU scaledoptim's AdamW runs
    # torch's fused AdamW kernel (skipping on device), torch.amp's default AdamW is foreach,
    # which rounds differently; with AdamW(fused=True) GradScaler trains exactly as we do.
    for task in ("lm", "cnn"):
        config = RunConfig(task=task, size="tiny", steps=60, growth_interval=5)
        theirs, ours = run_interleaved(config, ["torch.amp-fused", "scaledoptim"])
        assert sum(ours.skipped) > 0 and ours.skipped == theirs.skipped
        assert ours.losses == theirs.losses and ours.scales == theirs.scales
        assert ours.final_loss == theirs.final_loss
        assert theirs.host_reads_per_step == 0.0  # the fused step skips on device


def test_cpu_runs_use_one_intra_op_thread_and_restore_torch_setting() -> None:
    import torch

    seen: list[int] = []  # torch's thread count inside each run
    config = RunConfig(task="cnn", size="tiny", steps=3)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_interleaved(config, ["scaledoptim"], progress=_Bar.factory(seen))
        assert seen == [1] and torch.get_num_threads() == 2
        (result,) = run_interleaved(dataclasses.replace(config, threads=None), ["scaledoptim"],
                                    progress=_Bar.factory(seen))
        assert seen == [1, 2]  # threads=None: torch's setting, left alone
        assert "on cpu (2 threads)" in format_table([result])
    finally:
        torch.set_num_threads(before)
    assert parse_args([]).threads == 1 and parse_args(["--threads", "0"]).threads == 0


class _Bar:
    """A progress bar that records torch's thread count when the run creates it."""

    @staticmethod
    def factory(seen: list[int]):
        import torch

        def make(total: int, name: str) -> _Bar:
            seen.append(torch.get_num_threads())
            return _Bar()

        return make

    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


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
    # scaledoptim is not on PyPI: the hint works from a checkout and where a wheel was installed
    assert any('pip install -e ".[plot]" in a checkout' in p for p in found)
    assert any('pip install "scaledoptim[plot]" where scaledoptim was installed from a wheel' in p
               for p in found)
    assert any('pip install -e ".[examples]"' in p for p in found)
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


def test_the_plot_shows_every_curve_and_says_what_each_panel_marks(compared, lbfgs) -> None:
    require_module("matplotlib", "the plot is written with the plot extra")
    import matplotlib.pyplot as plt

    from scaledoptim.examples.plot import make_figure

    figure = make_figure({"lm": list(compared.values()), "lbfgs": list(lbfgs.values())})
    try:
        # Rows of panels (loss, scale, host reads), a column per task.
        lm_loss, lbfgs_loss, lm_scale, lbfgs_scale = figure.axes[:4]
        for ax in (lm_loss, lbfgs_loss):
            # A log axis whose limits hold every curve whole, its first steps included: LBFGS's
            # loss falls by orders of magnitude after step 2, the transformer's starts high.
            assert ax.get_yscale() == "log"
            low, high = ax.get_ylim()
            for line in ax.get_lines():
                assert low <= min(line.get_ydata()) and max(line.get_ydata()) <= high
            legend = [text.get_text() for text in ax.get_legend().get_texts()]
            assert legend and not any("held-out" in label for label in legend), legend
            assert any("held-out loss" in text.get_text() for text in ax.texts)
        # Each scale panel names its own markers: skips on the AdamW runs, replays on LBFGS's.
        assert "skipped" in lm_scale.get_xlabel() and "replayed" not in lm_scale.get_xlabel()
        assert "replayed" in lbfgs_scale.get_xlabel() and "skipped" not in lbfgs_scale.get_xlabel()
        # LBFGS's 2^24 is explained above its panel, where it hides none of the replay counts.
        assert "2^24" in lbfgs_scale.get_title() and "2^24" not in lm_scale.get_title()
        assert not any("2^24" in text.get_text() for text in lbfgs_scale.texts)
        counts = [t for t in lbfgs_scale.texts if t.get_text().isdigit()]
        assert len(counts) == sum(1 for n in lbfgs["scaledoptim-lbfgs"].replays if n) > 0
    finally:
        plt.close(figure)


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


README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
# The README's claims about the main command on a CPU, each with what the demo must print for
# it: (task, pairs of variants whose "held-out loss vs" line is checked, the bound).
LOSS_CLAIMS = {
    "its held-out loss is within 0.2% of fp32 and of torch.amp": (
        "lm", [("scaledoptim", "fp32"), ("scaledoptim", "torch.amp")], 0.002),
    "the held-out losses of all three are within 2% of each other": (
        "cnn", [("scaledoptim", "fp32"), ("scaledoptim", "torch.amp"), ("torch.amp", "fp32")],
        0.02),
    "(`GradScaler` refuses closures); they end within 0.1% of each other": (
        "lbfgs", [("scaledoptim-lbfgs", "fp32-lbfgs")], 0.001),
}
OTHER_CLAIMS = (
    "on a CPU, small models for 150 steps on one intra-op thread",
    "1.0 for `GradScaler` with torch's default AdamW",
    "0.0 for scaledoptim",
    "the transformer: scaledoptim skips exactly the steps torch.amp skips (the demo prints both "
    "lists) and ends at the same scale",
    "the CNN: scaledoptim and torch.amp skip the same number of steps, the first at the same "
    "step, and end at the same scale; the later skips may fall on other steps",
    "the replay adds two reads per closure evaluation (the scale and `found_inf`",
    "`AdamW(fused=True)` bit for bit, skips included",
)


def _tables(printed: str) -> dict[str, dict]:
    """The demo's output, per task: its title line, its rows (fields split on spaces), the
    "held-out loss vs" gaps and the whole text."""
    tables = {}
    for block in printed.strip().split("\n\n"):
        lines = block.splitlines()
        rows = {
            fields[0]: fields
            for fields in (line.split() for line in lines[3:])
            if len(fields) >= 7 and re.fullmatch(r"\d+\.\d{4}", fields[1])
        }
        gaps = {
            (ours, theirs): float(percent) / 100
            for ours, theirs, percent in re.findall(
                r"^(\S+) held-out loss vs (\S+): ([\d.]+)% apart$", block, flags=re.MULTILINE
            )
        }
        skips = {
            variant: [] if steps == "none" else [int(step) for step in steps.split(", ")]
            for variant, steps in re.findall(
                r"^skipped steps of (\S+): (.*)$", block, flags=re.MULTILINE
            )
        }
        tables[lines[0].split()[0]] = {
            "title": lines[0], "rows": rows, "gaps": gaps, "skips": skips, "text": block
        }
    return tables


def test_the_readme_claims_hold_in_what_the_main_command_prints(capsys) -> None:
    # The README's main command on a CPU (the plot aside), and its claims checked against the
    # printed tables, not against the results' fields.
    text = README.read_text()
    command = text.split("<!-- main-command -->")[1].split("<!-- /main-command -->")[0]
    demo = "python -m scaledoptim.examples.demo --compare --lbfgs --plot compare.png"
    assert command.strip().strip("`").strip().endswith(demo), command
    main(["--compare", "--lbfgs", "--no-progress", "--device", "cpu"])
    tables = _tables(capsys.readouterr().out)
    readme = " ".join(text.split())
    for claim in (*LOSS_CLAIMS, *OTHER_CLAIMS):
        assert claim in readme, f"the README no longer says {claim!r}: update this test"
    for claim, (task, pairs, bound) in LOSS_CLAIMS.items():
        for pair in pairs:
            assert tables[task]["gaps"][pair] < bound, (claim, pair, tables[task]["text"])
    for task in ("lm", "cnn"):
        table = tables[task]
        assert "150 steps" in table["title"] and "on cpu (1 thread)" in table["title"]
        rows = table["rows"]
        assert float(rows["torch.amp"][4]) == 1.0 and float(rows["scaledoptim"][4]) == 0.0
        assert float(rows["fp32"][4]) == 0.0
        skipped, scale = rows["scaledoptim"][5:7]
        assert int(skipped) > 0 and [skipped, scale] == rows["torch.amp"][5:7], table["text"]
        ours, theirs = table["skips"]["scaledoptim"], table["skips"]["torch.amp"]
        assert len(ours) == int(skipped) and len(theirs) == int(rows["torch.amp"][5])
        if task == "lm":  # "skips exactly the steps torch.amp skips"
            assert ours == theirs, table["text"]
        else:  # "the same number of steps, the first at the same step"
            assert len(ours) == len(theirs) and ours[0] == theirs[0], table["text"]
        assert "fp32" not in table["skips"]  # an unscaled run skips nothing and lists nothing
    lbfgs = tables["lbfgs"]
    assert int(lbfgs["rows"]["scaledoptim-lbfgs"][6]) > 0  # replays happened
    per_evaluation = re.search(r"by the replay \(([\d.]+)/evaluation\)", lbfgs["text"])
    assert 2.0 <= float(per_evaluation.group(1)) <= 2.5, lbfgs["text"]
    assert "GradScaler.step(LBFGS, closure) raises RuntimeError" in lbfgs["text"]


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
