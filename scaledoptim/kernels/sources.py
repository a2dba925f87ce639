"""Where the CUDA sources live, the text every compiler of a kernel is given, and how the sources
are fingerprinted for caches.

Note [list enums]
~~~~~~~~~~~~~~~~~
A kernel's list layout is declared once, by the names of its ``MultiTensorKernel.lists``: the
per-tensor and per-chunk indices follow from them (kernels/spec.py), and so does the C++ enum its
source indexes the table with, ``enum AdamList { kAdamParams, ..., kAdamSteps, kAdamLists };``
(``MultiTensorKernel.list_enum``), which no ``.cu`` file writes by hand. :func:`kernel_source`
puts the enums in front of the file, and every compile of a kernel (NVRTC through CuPy, the
NVRTC checks and the doctor's, the emulator's g++) starts from that text, so a cache keyed on it
(CuPy's, the emulator's) rebuilds when a list is renamed, added or moved.

A file may define several kernels (lamb.cu), and compiling one compiles the whole file: the text
of each holds the enums of every kernel defined on its file so far (the registry,
``registered_kernels``), the kernel's own where two share an enum name (a test's variant of a
kernel, with other lists, on the same file).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from .spec import MultiTensorKernel, registered_kernels

__all__ = ["CUDA_SOURCE_DIR", "kernel_source", "sources_fingerprint"]

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


def kernel_source(kernel: MultiTensorKernel) -> str:
    """The text every compiler of ``kernel`` is given (See Note [list enums]): a line
    fingerprinting every header the source may include, the list enums, then the file, whose
    lines keep their numbers and name in compiler messages.

    The fingerprint is there because CuPy's on-disk cache keys on the program text only and would
    otherwise keep a module built from old headers.
    """
    source = kernel.source.resolve()
    on_file = [k for k in registered_kernels() if k.source.resolve() == source]
    enums = {k.list_enum_name: k.list_enum for k in on_file}
    enums[kernel.list_enum_name] = kernel.list_enum  # its own where a variant shares the name
    text = kernel.source.read_text()
    # A source written before the enums were generated would fail to compile on a redefinition,
    # a message that names neither the cause nor the fix.
    written = [name for name in enums if re.search(rf"\benum\s+(class\s+)?{name}\b", text)]
    if written:
        raise ValueError(
            f"{kernel.source} defines the list enum {written[0]} itself; it is generated from "
            f"the kernel's lists ({enums[written[0]]}): delete the enum from the source"
        )
    fingerprint = sources_fingerprint(CUDA_SOURCE_DIR, source.parent)
    return (
        f"// scaledoptim sources {fingerprint}\n"
        + "".join(f"{enum}\n" for enum in enums.values())
        + f'#line 1 "{kernel.source.name}"\n'
        + text
    )
