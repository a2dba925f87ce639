"""``python -m scaledoptim.doctor``: every check passes on this machine (GPU checks skipped without
a GPU), and a check whose subject is broken fails, names itself, and makes the exit status 1."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from scaledoptim.doctor import CHECKS, compile_check, gpu_report, host_cost
from scaledoptim.doctor.cli import main
from scaledoptim.kernels import KernelCompileError, builtin_kernels
from scaledoptim.kernels.nvrtc import supported_archs
from tests.support.cubin import cubin

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENVIRONMENT_KEYS = {
    "scaledoptim", "python", "platform", "torch", "torch_cuda", "cupy", "nvrtc", "device",
    "compute_capability", "SCALEDOPTIM_KERNELS", "fused_step_backend",
}
HAS_CUPY = importlib.util.find_spec("cupy") is not None
CHECK_TIMES = (
    "bandwidth", "clip-bandwidth", "step-time", "clip-step-time", "lowbit-bandwidth"
)


def _doctor(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    """The doctor in a fresh interpreter (``code`` runs instead, e.g. to break something first)."""
    env = {k: v for k, v in os.environ.items() if k != "SCALEDOPTIM_KERNELS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = ["-c", code, *args] if code else ["-m", "scaledoptim.doctor", *args]
    return subprocess.run(
        [sys.executable, *command],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _expected_status(name: str) -> str:
    check = next(c for c in CHECKS if c.name == name)
    if check.needs_gpu and not torch.cuda.is_available():
        return "skip"
    if name == "nvrtc-compile" and not HAS_CUPY:
        return "skip"  # and it names the fix: asserted below
    return "pass"


def test_every_check_passes_and_the_json_says_so(tmp_path: pathlib.Path) -> None:
    # Every check but NVRTC's in a fresh interpreter: its compiles (a minute of CPU) are the
    # session's cubins, which the next test hands it in process.
    names = [c.name for c in CHECKS if c.name != "nvrtc-compile"]
    report = tmp_path / "doctor.json"
    run = _doctor("--only", ",".join(names), "--json", str(report))
    document = json.loads(report.read_text())
    assert ENVIRONMENT_KEYS <= set(document["environment"])
    assert [c["name"] for c in document["checks"]] == names
    for check in document["checks"]:
        assert check["status"] == _expected_status(check["name"]), check
        assert check["detail"] and check["name"] in run.stdout
    assert document["passed"] is True
    assert run.returncode == 0, run.stdout + run.stderr
    for key in ENVIRONMENT_KEYS:
        assert key in run.stdout
    if not torch.cuda.is_available():  # our kernels run on the emulator: it says so
        details = {c["name"]: c["detail"] for c in document["checks"]}
        assert details["parity:AdamW"].startswith("CPU emulator, ")
        assert "torch backend + CPU emulator" in details["no-host-sync"]


@pytest.mark.skipif(not HAS_CUPY, reason="the skip without CuPy is tested below")
def test_the_compile_check_compiles_every_kernel_for_both_ends_of_the_arch_range(
    monkeypatch,
) -> None:
    # The session's cubins (tests/support/cubin.py: test_nvrtc.py compiles the same kernels for
    # the same archs), so the check's own compile calls, archs and detail are what is tested.
    compiled: list[tuple[str, int]] = []

    def session_cubin(kernel, arch):
        compiled.append((kernel.name, arch))
        return cubin(kernel, arch)

    monkeypatch.setattr(compile_check.nvrtc, "compile_for_arch", session_cubin)
    outcome = compile_check.run(torch.device("cpu"))
    assert outcome.passed and not outcome.skipped, outcome.detail
    ends = sorted({supported_archs()[0], supported_archs()[-1]})
    assert compiled == [(k.name, arch) for arch in ends for k in builtin_kernels()]
    assert ", ".join(f"sm_{arch}" for arch in ends) in outcome.detail
    assert all(k.source.name in outcome.detail for k in builtin_kernels())


@pytest.mark.skipif(not HAS_CUPY, reason="the skip without CuPy is tested below")
def test_a_kernel_that_does_not_compile_fails_the_check_naming_it_and_the_arch(
    monkeypatch,
) -> None:
    def broken(kernel, arch):
        raise KernelCompileError("error: expected a ';'")

    monkeypatch.setattr(compile_check.nvrtc, "compile_for_arch", broken)
    outcome = compile_check.run(torch.device("cpu"))
    first = builtin_kernels()[0].source.name
    assert not outcome.passed
    assert outcome.detail.startswith(f"{first} for sm_{supported_archs()[0]}: ")
    assert "expected a ';'" in outcome.detail


# A wrong update in AdamW (params nudged after every step) and a host read in every step.
_BREAK_ADAMW_AND_SYNC = textwrap.dedent(
    """
    import runpy, sys
    import torch
    import scaledoptim

    class WrongAdamW(scaledoptim.AdamW):
        def step(self, closure=None):
            loss = super().step(closure)
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p.mul_(1.01)
            return loss

    unscale_and_step = scaledoptim.Optimizer.unscale_and_step

    def reads_the_host(self, *args, **kwargs):
        self.scale.item()
        return unscale_and_step(self, *args, **kwargs)

    scaledoptim.AdamW = WrongAdamW
    scaledoptim.Optimizer.unscale_and_step = reads_the_host
    sys.argv[0] = "scaledoptim.doctor"
    runpy.run_module("scaledoptim.doctor", run_name="__main__")
    """
)


def test_a_broken_optimizer_fails_its_checks_and_the_exit_status(tmp_path: pathlib.Path) -> None:
    report = tmp_path / "doctor.json"
    run = _doctor(
        "--only", "parity:AdamW,parity:SGD,no-host-sync", "--json", str(report),
        code=_BREAK_ADAMW_AND_SYNC,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    results = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    assert set(results) == {"parity:AdamW", "parity:SGD", "no-host-sync"}
    assert results["parity:AdamW"]["status"] == "fail"
    assert "step 1, param[0]" in results["parity:AdamW"]["detail"]
    assert results["parity:SGD"]["status"] == "pass"
    assert results["no-host-sync"]["status"] == "fail"
    assert "Tensor.item() called" in results["no-host-sync"]["detail"]
    assert "FAILED: parity:AdamW, no-host-sync" in run.stdout


def test_an_unknown_check_name_is_refused_with_the_names_to_choose_from(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--only", "parity,bogus"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "unknown check name(s) ['bogus']" in error and "'no-host-sync'" in error


def test_the_gpu_report_runs_every_part_and_names_the_failed_one(tmp_path, monkeypatch) -> None:
    python = (sys.executable, "-c")
    parts = (
        gpu_report.Part("clean", (*python, "print('all good')")),
        gpu_report.Part("broken", (*python, "print('boom'); raise SystemExit(3)")),
        gpu_report.Part("absent", (*python, "print('never' + ' runs')"), ("no/such/folder",)),
    )
    monkeypatch.chdir(tmp_path)
    assert gpu_report.main(["report.md"], parts) == 1
    report = (tmp_path / "report.md").read_text()
    assert "**FAILED: broken, absent.**" in report
    assert "## clean: passed" in report and "all good" in report
    assert "## broken: FAILED (exit status 3)" in report and "boom" in report
    assert "['no/such/folder'] not found" in report and "never runs" not in report


def test_the_gpu_report_without_the_test_extra_names_it(tmp_path, monkeypatch, capsys) -> None:
    part = gpu_report.Part("tests", (sys.executable, "-c", "pass"), modules=("no_such_pytest",))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        gpu_report.main(["report.md"], (part,))
    assert exit_.value.code == 2 and not (tmp_path / "report.md").exists()
    error = capsys.readouterr().err
    assert "no_such_pytest is not installed" in error and '".[test,cuda12]"' in error
    assert {"pytest", "pytest_benchmark"} <= {m for p in gpu_report.PARTS for m in p.modules}


def test_the_gpu_reports_summary_repeats_the_step_time_lines(tmp_path, monkeypatch) -> None:
    lines = ("bandwidth  pass  1.0s  3141 GB/s", "step-time  fail  2.0s  0.52 ms vs 0.64 ms")
    printed = "; ".join(f"print({line!r})" for line in ("parity:SGD  pass", *lines))
    doctor = gpu_report.Part("doctor", (sys.executable, "-c", printed), highlights=CHECK_TIMES)
    monkeypatch.chdir(tmp_path)
    assert gpu_report.main(["report.md"], (doctor,)) == 0
    summary = (tmp_path / "report.md").read_text().split("## doctor")[0]
    assert "```text\n" + "\n".join(lines) + "\n```" in summary
    assert "parity:SGD" not in summary
    (real_doctor,) = [part for part in gpu_report.PARTS if part.title == "doctor"]
    assert real_doctor.highlights == (*CHECK_TIMES, "parity:AdamW-8bit")
    assert set(CHECK_TIMES) <= {check.name for check in CHECKS if check.needs_gpu}


def test_the_gpu_report_runs_what_the_readme_promises() -> None:
    commands = [" ".join(part.argv[1:]) for part in gpu_report.PARTS]
    assert any(c.endswith("pytest -p no:cacheprovider -rA tests/gpu") for c in commands)
    assert any(c.endswith("benchmarks/test_bench_cuda_kernels.py") for c in commands)
    assert "-m scaledoptim.doctor" in commands
    for part in gpu_report.PARTS:
        assert all((ROOT / path).exists() for path in part.needs)
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- gpu-command -->")[1].split("<!-- /gpu-command -->")[0]
    assert "python -m scaledoptim.doctor.gpu_report gpu-report.md" in block


def test_without_cupy_the_kernel_checks_are_skipped_naming_the_fallback_and_the_install(
    monkeypatch,
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises, find_spec finds nothing
    on_cpu = compile_check.run(torch.device("cpu"))
    assert on_cpu.skipped and "a CPU needs no CuPy" in on_cpu.detail
    # On a GPU without CuPy the fused optimizers fall back to torch's fused ops: the doctor says
    # so, and the checks that time our kernel path do not apply (neither touches the device).
    on_gpu = compile_check.run(torch.device("cuda", 0))
    assert on_gpu.skipped and "run torch's fused ops on cuda:0 instead" in on_gpu.detail
    assert host_cost.run(torch.device("cuda", 0)).skipped
    for outcome in (on_cpu, on_gpu):
        assert 'pip install -e ".[cuda12]" in a checkout' in outcome.detail
        assert 'pip install "scaledoptim[cuda12]" where scaledoptim was installed from a wheel' in (
            outcome.detail
        )


# The README's main-command venv (the examples extra) has no CuPy: import cupy fails there.
_WITHOUT_CUPY = textwrap.dedent(
    """
    import runpy, sys
    sys.modules["cupy"] = None  # import cupy raises ImportError, find_spec finds nothing
    sys.argv[0] = "scaledoptim.doctor"
    runpy.run_module("scaledoptim.doctor", run_name="__main__")
    """
)


def test_without_cupy_a_cpu_machine_passes_and_the_compile_check_says_how_to_enable_it(
    tmp_path: pathlib.Path,
) -> None:
    report = tmp_path / "doctor.json"
    run = _doctor("--device", "cpu", "--json", str(report), code=_WITHOUT_CUPY)
    assert run.returncode == 0, run.stdout + run.stderr
    document = json.loads(report.read_text())
    assert document["passed"] is True
    assert document["environment"]["cupy"].startswith("not installed")
    results = {c["name"]: c for c in document["checks"]}
    nvrtc = results["nvrtc-compile"]
    assert nvrtc["status"] == "skip", nvrtc
    assert "CuPy is not installed" in nvrtc["detail"] and "needs no CuPy" in nvrtc["detail"]
    assert 'pip install -e ".[cuda12]"' in nvrtc["detail"]  # from a checkout
    assert 'pip install "scaledoptim[cuda12]"' in nvrtc["detail"]  # where a wheel was installed
    assert all(c["status"] == "pass" for n, c in results.items() if n != "nvrtc-compile" and
               not next(k for k in CHECKS if k.name == n).needs_gpu)
    assert "0 failed" in run.stdout


def test_the_gpu_report_takes_a_dtensor_step_on_the_gpu() -> None:
    """Its GPU tests part collects the one-device DTensor step on CUDA (the issue's "the GPU
    report includes a DTensor step on one device"); the CPU twin runs in the suite."""
    (gpu_tests,) = [part for part in gpu_report.PARTS if part.title == "GPU tests"]
    argv = [*gpu_tests.argv, "--collect-only", "-q", "-m", "gpu"]
    collected = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    step = "test_gpu_dtensor_step.py::test_a_dtensor_step_on_one_device_follows_torch[cuda]"
    assert step in collected
