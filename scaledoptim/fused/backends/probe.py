"""Whether our CUDA kernels run on a device: a missing piece of the install falls back to torch's
ops with one warning; a probe launch that fails is an error.

Note [kernel probe]
~~~~~~~~~~~~~~~~~~~
An *expected absence* is what an install may lack, read before anything launches
(``kernels.cuda_backend.unmet_requirement``): CuPy not installed, NVRTC that cannot be loaded,
a device arch the installed NVRTC does not list (the cuda13 extra on a V100), a driver older than
CuPy's CUDA. Each names its fix; the fused optimizers run torch's ops on that device, with one
warning, and the answer is kept for the process (an install does not change under it).

Anything else is a bug or a broken install that a fallback would hide: the probe compiles and
launches the inf/nan check on the device and reads its result, and when that raises or computes
the wrong value, :class:`KernelProbeError` says why and names ``SCALEDOPTIM_KERNELS=torch`` as
the way to train meanwhile. A failure is not kept: the next step probes again. (CuPy 14 once
made every launch raise ``AttributeError``, and a sticky, silent fallback hid it for a release.)
"""

from __future__ import annotations

import torch

from ...kernels import non_finite_check_

__all__ = ["KernelProbeError", "probe_kernels"]


class KernelProbeError(RuntimeError):
    """The kernels failed their probe launch on a device whose install has what they need."""


def probe_kernels(device: torch.device) -> None:
    """Compiles and launches the inf/nan check on ``device`` and reads its result (one host
    sync, at a device's first step).

    Raises:
        KernelProbeError: naming the cause, when the launch raises or computes a wrong result.
    """
    try:
        values = torch.tensor([0.0, float("nan")], device=device)
        found_inf = torch.zeros((), device=device)
        non_finite_check_([values], found_inf)
        seen = found_inf.item()
    except Exception as error:
        raise KernelProbeError(_message(device, f"{type(error).__name__}: {error}")) from error
    if seen != 1.0:
        raise KernelProbeError(
            _message(device, f"the probe computed found_inf={seen} where a NaN makes it 1.0")
        )


def _message(device: torch.device, cause: str) -> str:
    return (
        f"scaledoptim's CUDA kernels failed their probe launch on {device} ({cause}), though "
        "CuPy, NVRTC and the driver are there. It is a bug or a broken install: please report "
        "it with the output of `python -m scaledoptim.doctor`. To train meanwhile on torch's "
        "fused ops (sync-free too), set SCALEDOPTIM_KERNELS=torch."
    )
