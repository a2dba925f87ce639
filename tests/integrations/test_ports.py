"""Fused clipping through the GradScaler shape: four training scripts ported (issue 41, item 1).

``tests/integrations/ports/<project>/`` holds a reduction, written by hand for this test, of a
well-known script that trains with ``torch.amp.GradScaler`` and clips with ``clip_grad_norm_``:
nanoGPT, minGPT-ddp (pytorch/examples), timm's ``train.py`` and open_clip's training loop. The
lines that matter to the port (the imports, the optimizer, the scaler, the clip and the step) are
shaped as in the project. ``ports/<project>.diff`` is the port to ``scaledoptim.GradScaler`` with
``scaler.step(opt, max_grad_norm=c)``, as docs/migration.md shows it. Each test applies the diff
to a copy, runs both scripts with the same overflows forced, and compares what they did: the
same skipped iterations and scales, the same grad norm, the params within the rounding
docs/recipes/clipping.md names.

The GradScaler runs use torch's fused AdamW (``FusedAdamW``), so that the runs differ by the
clip's rounding alone.

*Changed lines* of a diff: in every run of removed and added lines, the larger of the two counts
(a replaced line counts once; an added or a removed line counts one).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import math
import pathlib
import re
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import scaledoptim

PORTS = pathlib.Path(__file__).parent / "ports"
MIGRATION = pathlib.Path(__file__).resolve().parents[2] / "docs" / "migration.md"
OVERFLOWS = {3, 4, 9}  # iterations whose loss is multiplied by 1e38 before scaling
CLIP = 0.25  # each script's clip (nanoGPT's is given), small enough to bind
MAX_CHANGED_LINES = 8
#: project -> (the module whose main() trains, what main() is given)
PROJECTS = {
    "nanogpt": ("train", {"grad_clip": CLIP}),
    "mingpt_ddp": ("main", {}),
    "timm": ("train", {}),
    "open_clip": ("main", {}),
}


# ---------------------------------------------------------------------------- diffs
def _hunks(diff: str) -> Iterator[tuple[str, int, list[str]]]:
    """(file, first old line, the hunk's lines) of a unified diff."""
    path = None
    lines = diff.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("+++ b/"):
            path = line[len("+++ b/"):]
        elif line.startswith("@@"):
            start = int(re.match(r"@@ -(\d+)", line).group(1))
            body = []
            i += 1
            while i < len(lines) and lines[i][:1] in (" ", "+", "-") and not lines[i].startswith(
                ("--- a/", "+++ b/")
            ):
                body.append(lines[i])
                i += 1
            assert path is not None
            yield path, start, body
            continue
        i += 1


def changed_lines(diff: str) -> int:
    """The changed lines of ``diff`` (see the module docstring)."""
    total = 0
    for _, _, body in _hunks(diff):
        removed = added = 0
        for line in [*body, " "]:
            if line.startswith("-"):
                removed += 1
            elif line.startswith("+"):
                added += 1
            else:
                total += max(removed, added)
                removed = added = 0
    return total


def apply_diff(diff: str, directory: pathlib.Path) -> None:
    """Applies ``diff`` to the files under ``directory``, checking every context line."""
    offsets: dict[str, int] = {}
    for path, start, body in _hunks(diff):
        target = directory / path
        text = target.read_text().splitlines(keepends=True)
        at = start - 1 + offsets.get(path, 0)
        old = [line[1:] for line in body if line[0] in " -"]
        new = [line[1:] for line in body if line[0] in " +"]
        assert [line.rstrip("\n") for line in text[at : at + len(old)]] == old, (path, start)
        text[at : at + len(old)] = [line + "\n" for line in new]
        offsets[path] = offsets.get(path, 0) + len(new) - len(old)
        target.write_text("".join(text))


def _project(tmp_path: pathlib.Path, name: str, *diffs: str) -> pathlib.Path:
    directory = tmp_path / "-".join((name, *diffs))
    shutil.copytree(PORTS / name, directory, ignore=shutil.ignore_patterns("__pycache__"))
    for diff in diffs:
        apply_diff((PORTS / f"{diff}.diff").read_text(), directory)
    return directory


# ---------------------------------------------------------------------------- runs
class Record:
    """What one run did, iteration by iteration (an iteration ends with ``scaler.update()``)."""

    def __init__(self) -> None:
        self.optimizer: torch.optim.Optimizer | None = None
        self.norm: torch.Tensor | None = None
        self.norms: list[float] = []
        self.scales: list[float] = []
        self.params: list[torch.Tensor] = []

    @property
    def iteration(self) -> int:
        return len(self.scales)

    def skipped(self) -> set[int]:
        """The iterations after which the params were as before them."""
        return {
            i for i in range(1, len(self.params)) if torch.equal(self.params[i], self.params[i - 1])
        }


class FusedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` as the scripts' GradScaler runs get it: with torch's fused kernel
    (as nanoGPT asks for on CUDA), the kernel scaledoptim's AdamW runs on a CPU, so that the
    runs differ by the clip's rounding alone (torch's foreach AdamW rounds differently)."""

    def __init__(self, *args: Any, fused: bool | None = True, **kwargs: Any) -> None:
        super().__init__(*args, fused=fused, **kwargs)


@contextlib.contextmanager
def recording(
    monkeypatch: pytest.MonkeyPatch, overflows: set[int], fused_reference: bool = True
) -> Iterator[Record]:
    """Records every iteration of the GradScaler loops run inside it, and forces the overflows
    of the iterations ``overflows`` (the loss times 1e38, in ``scaler.scale``); with
    ``fused_reference``, ``torch.optim.AdamW`` is :class:`FusedAdamW`."""
    record = Record()
    clip = torch.nn.utils.clip_grad_norm_

    def clip_grad_norm_(*args: Any, **kwargs: Any) -> torch.Tensor:
        record.norm = clip(*args, **kwargs)
        return record.norm

    def scaling(original):
        def scale(self, outputs):
            if record.iteration in overflows:
                outputs = outputs * 1e38
            return original(self, outputs)

        return scale

    def stepping(original):
        def step(self, optimizer, *args, **kwargs):
            record.optimizer = optimizer
            result = original(self, optimizer, *args, **kwargs)
            if kwargs.get("max_grad_norm") is not None:
                record.norm = optimizer.grad_norm
            return result

        return step

    update = torch.amp.GradScaler.update

    def updating(self, *args, **kwargs):
        update(self, *args, **kwargs)
        record.scales.append(self.get_scale())
        record.norms.append(float("nan") if record.norm is None else float(record.norm))
        record.norm = None
        params = [p for g in record.optimizer.param_groups for p in g["params"]]
        record.params.append(torch.cat([p.detach().flatten() for p in params]).clone())

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_grad_norm_)
    if fused_reference:
        monkeypatch.setattr(torch.optim, "AdamW", FusedAdamW)
    for cls in (torch.amp.GradScaler, scaledoptim.GradScaler):
        monkeypatch.setattr(cls, "scale", scaling(cls.scale))
        monkeypatch.setattr(cls, "step", stepping(cls.step))
    monkeypatch.setattr(torch.amp.GradScaler, "update", updating)
    try:
        yield record
    finally:
        monkeypatch.undo()


def run(
    directory: pathlib.Path,
    module: str,
    monkeypatch: pytest.MonkeyPatch,
    overflows: set[int] = OVERFLOWS,
    fused_reference: bool = True,
    **kwargs: Any,
) -> tuple[Record, Any]:
    """Imports ``module`` of a project copy (its siblings by their bare names, as the project's
    scripts import each other) and records its ``main(**kwargs)``, forcing ``overflows``."""
    siblings = [path.stem for path in directory.glob("*.py")]
    for name in siblings:
        sys.modules.pop(name, None)
    sys.path.insert(0, str(directory))
    try:
        with recording(monkeypatch, overflows, fused_reference) as record:
            result = importlib.import_module(module).main(**kwargs)
    finally:
        sys.path.remove(str(directory))
        for name in siblings:
            sys.modules.pop(name, None)
    return record, result


@pytest.fixture
def world_of_one(tmp_path) -> Iterator[None]:
    """A gloo process group of one rank, for minGPT-ddp's DDP and DistributedSampler."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _assert_same_run(ours: Record, theirs: Record) -> None:
    """The port against GradScaler + ``clip_grad_norm_``: the same skipped iterations (those
    whose grads overflowed: a norm of inf or nan, the params as before) and scales, the same
    norms, the params within what the clip's rounding accumulates over the run (of the order of
    torch's foreach AdamW against its fused one: docs/recipes/clipping.md)."""
    assert ours.scales == theirs.scales
    overflowed = {i for i, norm in enumerate(theirs.norms) if not math.isfinite(norm)}
    assert {i for i, norm in enumerate(ours.norms) if not math.isfinite(norm)} == overflowed
    assert OVERFLOWS <= overflowed  # (and any overflow of the fp16 forward itself)
    assert ours.skipped() == theirs.skipped() == overflowed - {0}
    for i, (a, b) in enumerate(zip(ours.norms, theirs.norms, strict=True)):
        if i not in overflowed:
            # The first clean iteration sees the same params and grads: the same norm.
            assert a == b if i == min(set(range(len(ours.norms))) - overflowed) else (
                a == pytest.approx(b, rel=1e-4)
            ), i
    clipped = [i for i, n in enumerate(theirs.norms) if CLIP < n < math.inf]
    assert len(clipped) >= len(theirs.norms) // 2  # the clip bound on most iterations
    torch.testing.assert_close(ours.params[-1], theirs.params[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(PROJECTS))
def test_the_port_is_at_most_8_changed_lines(name) -> None:
    assert changed_lines((PORTS / f"{name}.diff").read_text()) <= MAX_CHANGED_LINES


def test_the_migration_page_shows_each_port_as_it_is_tested() -> None:
    shown = re.findall(r"```diff\n(.*?)```", MIGRATION.read_text(), flags=re.S)
    for name in PROJECTS:
        assert (PORTS / f"{name}.diff").read_text() in shown, name


@pytest.mark.parametrize("name", ["nanogpt", "timm", "open_clip"])
def test_the_port_follows_gradscaler_and_clip_grad_norm(name, tmp_path, monkeypatch) -> None:
    module, kwargs = PROJECTS[name]
    theirs, _ = run(_project(tmp_path, name), module, monkeypatch, **kwargs)
    ours, result = run(_project(tmp_path, name, name), module, monkeypatch, **kwargs)
    _assert_same_run(ours, theirs)
    optimizer = result[1]
    assert isinstance(optimizer, scaledoptim.AdamW)
    assert optimizer.scale.item() == ours.scales[-1]  # the scaler's scale lives in it


@pytest.mark.usefixtures("world_of_one")
def test_the_mingpt_ddp_port_clips_what_upstream_meant_to(tmp_path, monkeypatch) -> None:
    """minGPT-ddp clips right after ``scaler.scale(loss).backward()``: the *scaled* grads, so its
    clip bounds the unscaled norm by ``grad_norm_clip / S``. The port clips the unscaled grads,
    as upstream with ``scaler.unscale_`` before the clip does (docs/migration.md warns)."""
    upstream, _ = run(_project(tmp_path, "mingpt_ddp"), "main", monkeypatch)
    meant, _ = run(_project(tmp_path, "mingpt_ddp", "mingpt_ddp_unscale"), "main", monkeypatch)
    ours, _ = run(_project(tmp_path, "mingpt_ddp", "mingpt_ddp"), "main", monkeypatch)
    _assert_same_run(ours, meant)
    # Upstream's clip_grad_norm_ saw the scaled grads: S times the norm, and clipped them all.
    assert upstream.norms[0] == pytest.approx(2.0**16 * meant.norms[0], rel=1e-6)
    drift = (upstream.params[-1] - meant.params[-1]).abs().max()
    assert drift > 100 * (ours.params[-1] - meant.params[-1]).abs().max()


def test_a_timm_checkpoint_resumes_across_the_port(tmp_path, monkeypatch) -> None:
    """The port's checkpoint entry is GradScaler's: timm's stock loss scaler resumes it (with
    timm's AdamW, torch's foreach one: a torch AdamW(fused=True) + GradScaler cannot load the
    state of an optimizer saved with fused=None, torch's own foreach AdamW's included)."""
    ported = _project(tmp_path, "timm", "timm")
    ours, (_, _, _, checkpoint) = run(ported, "train", monkeypatch, epochs=2)
    stock, (model, optimizer, _, _) = run(
        _project(tmp_path, "timm"), "train", monkeypatch, set(), False, epochs=3,
        resume=checkpoint,
    )
    assert stock.scales[0] == ours.scales[-1] < 2.0**16  # (no growth in 2000 iterations)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_open_clip_resume_of_the_port_continues_as_the_run(tmp_path, monkeypatch) -> None:
    """open_clip's checkpoint code is unchanged by the port: its ``"scaler"`` entry and the
    optimizer's state resume the run exactly."""
    ported = _project(tmp_path, "open_clip", "open_clip")
    whole, (model, _, _, _) = run(ported, "main", monkeypatch, epochs=3)
    _, (_, _, _, checkpoint) = run(ported, "main", monkeypatch, epochs=2)
    resumed, (resumed_model, _, _, _) = run(
        ported, "main", monkeypatch, set(), epochs=3, resume=checkpoint
    )
    assert resumed.scales == whole.scales[-len(resumed.scales):]
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
