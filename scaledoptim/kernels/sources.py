"""Where the CUDA sources live and how their content is fingerprinted for caches."""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["CUDA_SOURCE_DIR", "sources_fingerprint"]

# A source checkout or editable install keeps the kernels at the repository top (cuda/); a wheel
# ships them inside the package (scaledoptim/cuda/, mapped there by hatch_build.py). A candidate
# counts only with common.cuh in it: for an installed package the first one is site-packages/cuda/,
# which belongs to other distributions (cuda-python) when it exists.
_CANDIDATES = (
    Path(__file__).resolve().parents[2] / "cuda",
    Path(__file__).resolve().parents[1] / "cuda",
)
CUDA_SOURCE_DIR: Path = next(
    (p for p in _CANDIDATES if (p / "common.cuh").is_file()), _CANDIDATES[0]
)

_SOURCE_SUFFIXES = (".cu", ".cuh", ".h")


def sources_fingerprint(*directories: Path) -> str:
    """sha256 over every kernel source and header in ``directories``.

    Kernels include each other's headers, so any change in these folders invalidates every
    compiled artifact keyed by it (NVRTC modules and emulator libraries).
    """
    digest = hashlib.sha256()
    for directory in sorted(set(directories)):
        for path in sorted(directory.iterdir()):
            if path.suffix in _SOURCE_SUFFIXES and path.is_file():
                digest.update(path.name.encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()
