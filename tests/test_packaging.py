"""The packages built from a clone without symlink support (Windows' default) work: the wheel
carries the CUDA kernels; the sdist carries the whole repository, tests included; a build
without kernels fails loudly. (That a wheel installed with torch into a fresh venv runs outside
the checkout is .ci/wheel_smoke.sh's, the last step of the README's test command: the doctor's
kernel self-test on the emulator and a demo.)

Builds from a clone of the repository's HEAD (CI runs on a fresh clone, so HEAD is what CI
tests); build isolation fetches hatchling from the package index."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.metadata import Metadata
from prerequisites import missing

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip's copy of the same parser
    from pip._vendor import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
KERNEL_SUFFIXES = (".cu", ".cuh", ".h")

# Without PYTHONPATH, nothing outside the venv under test can shadow the installed package.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run(*command: str | Path, cwd: Path | None = None, env: dict | None = None) -> str:
    """Runs ``command``; returns stdout and stderr together, failing the test on a non-zero exit."""
    result = subprocess.run(
        [str(part) for part in command],
        check=False,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env or ENV,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(map(str, command))} failed:\n{output}"
    return output


def git_files(checkout: Path, *paths: str) -> set[str]:
    return set(run("git", "-C", checkout, "ls-files", "-z", *paths).strip("\0").split("\0"))


def clone_without_symlinks(destination: Path) -> Path:
    """A clone of HEAD made as on Windows: git writes each symlink as a small text file."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        missing("needs git and a git checkout of the repository")
    run("git", "-c", "core.symlinks=false", "clone", "--quiet", REPO, destination)
    return destination


def build_wheel(source: Path, out: Path) -> subprocess.CompletedProcess:
    """``pip wheel`` as a user would run it, with build isolation."""
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(source)],
        check=False,
        capture_output=True,
        text=True,
        env=ENV,
    )


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    return clone_without_symlinks(tmp_path_factory.mktemp("clone") / "scaledoptim")


@pytest.fixture(scope="module")
def wheel(clone, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    result = build_wheel(clone, out)
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = out.glob("scaledoptim-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with nothing installed."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    run(sys.executable, "-m", "venv", root)
    return root / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def test_the_repository_tracks_no_symlinks():
    symlinks = [
        line.split("\t", 1)[1]
        for line in run("git", "-C", REPO, "ls-files", "-s").splitlines()
        if line.startswith("120000 ")
    ]
    assert symlinks == [], f"symlinks break clones without symlink support: {symlinks}"


def test_wheel_carries_every_kernel_source_and_valid_metadata(clone, wheel):
    kernel_sources = {Path(p).name for p in git_files(clone, "cuda")} & {
        p.name for p in (clone / "cuda").iterdir() if p.suffix in KERNEL_SUFFIXES
    }
    assert "common.cuh" in kernel_sources and any(s.endswith(".cu") for s in kernel_sources)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Metadata.from_email(archive.read(metadata_name), validate=True)
    prefix = "scaledoptim/cuda/"
    packaged = {n.removeprefix(prefix) for n in names if n.startswith(prefix)}
    assert packaged == kernel_sources
    assert not any(n.startswith("cuda/") for n in names)  # only inside the package
    assert str(metadata.license_expression) == "BSD-3-Clause"
    assert metadata.license_files == ["LICENSE"]
    assert metadata_name.replace("METADATA", "licenses/LICENSE") in names


def test_sdist_carries_every_tracked_file_including_the_tests(clone, venv, tmp_path):
    build_requires = tomllib.loads((clone / "pyproject.toml").read_text())["build-system"]
    run(venv, "-m", "pip", "install", "--quiet", "--no-compile", *build_requires["requires"])
    backend = build_requires["build-backend"]
    script = f"import {backend} as b; print(b.build_sdist({str(tmp_path)!r}))"
    name = run(venv, "-I", "-c", script, cwd=clone).strip().splitlines()[-1]
    with tarfile.open(tmp_path / name) as archive:
        shipped = {m.name.partition("/")[2] for m in archive.getmembers() if m.isfile()}
    tracked = git_files(clone)
    assert shipped == tracked | {"PKG-INFO"}, (
        f"missing: {sorted(tracked - shipped)}, extra: {sorted(shipped - tracked - {'PKG-INFO'})}"
    )
    # Named, as the sdist promises all of the test suite or none of it.
    for test_file in ("tests/conftest.py", "tests/prerequisites.py", "tests/support/training.py"):
        assert test_file in shipped
    assert git_files(clone, "tests/kernels/data") <= shipped
    assert git_files(clone, "cuda") <= shipped


def test_a_build_without_kernels_fails_loudly(tmp_path):
    clone = clone_without_symlinks(tmp_path / "scaledoptim")
    for kernel in (clone / "cuda").glob("*.cu"):
        kernel.unlink()
    result = build_wheel(clone, tmp_path / "wheel")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "scaledoptim build: no CUDA kernel sources to ship" in output, output
    assert not list((tmp_path / "wheel").glob("*.whl"))
