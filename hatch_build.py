"""Build hook: ships the top-level cuda/ kernel sources inside the wheel as scaledoptim/cuda/.

The kernels stay at the repository top (cuda/), where the C++ tools and docs expect them; a
symlink into the package silently vanished from clones without symlink support, leaving wheels
with no kernels. So the wheel gets each source mapped explicitly, and a wheel or sdist that would
ship without them is a build error instead of a FileNotFoundError at the first kernel launch.
Editable installs map nothing: scaledoptim.kernels.sources reads the checkout's cuda/ directly.
"""

from __future__ import annotations

import tarfile
import zipfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

KERNEL_DIR = "cuda"
PACKAGED_KERNEL_DIR = "scaledoptim/cuda"
KERNEL_SUFFIXES = (".cu", ".cuh", ".h")
REQUIRED_HEADER = "common.cuh"


class KernelSourcesMissing(RuntimeError):
    """The build would produce a package without the CUDA kernel sources."""


def kernel_sources(root: Path) -> list[str]:
    """Names of the kernel sources and headers in ``root/cuda``.

    Raises:
        KernelSourcesMissing: when cuda/ holds no ``*.cu`` kernel or no ``common.cuh``.
    """
    directory = root / KERNEL_DIR
    names = sorted(
        p.name for p in directory.glob("*") if p.suffix in KERNEL_SUFFIXES and p.is_file()
    )
    if REQUIRED_HEADER not in names or not any(name.endswith(".cu") for name in names):
        raise KernelSourcesMissing(
            f"scaledoptim build: no CUDA kernel sources to ship: {directory} must hold the "
            f"*.cu kernels and {REQUIRED_HEADER} (found: {names or 'nothing'}). The package "
            "would fail at its first kernel launch. Restore them (`git checkout -- cuda`) or "
            "build from a complete clone or sdist."
        )
    return names


class KernelSourcesHook(BuildHookInterface):
    """Maps cuda/ into the wheel and checks that the built wheel or sdist carries it."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        self._names = kernel_sources(Path(self.root))
        if self.target_name == "wheel" and version != "editable":
            for name in self._names:
                source = str(Path(self.root) / KERNEL_DIR / name)
                build_data["force_include"][source] = f"{PACKAGED_KERNEL_DIR}/{name}"

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        if self.target_name == "wheel" and version != "editable":
            with zipfile.ZipFile(artifact_path) as wheel:
                shipped = set(wheel.namelist())
            expected = [f"{PACKAGED_KERNEL_DIR}/{name}" for name in self._names]
        elif self.target_name == "sdist":
            with tarfile.open(artifact_path) as sdist:
                # Members are "<name>-<version>/<path>"; drop the top folder.
                shipped = {m.name.partition("/")[2] for m in sdist.getmembers()}
            expected = [f"{KERNEL_DIR}/{name}" for name in self._names]
        else:
            return
        missing = [name for name in expected if name not in shipped]
        if missing:
            raise KernelSourcesMissing(
                f"scaledoptim build: {artifact_path} lacks the kernel sources {missing}; check "
                "the file selection in pyproject.toml's [tool.hatch.build] tables."
            )
