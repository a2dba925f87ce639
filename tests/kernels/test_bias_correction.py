"""LAMB's bias corrections ``1 - beta**step`` on our kernels are as accurate as Adam's: computed
as ``-expm1(step * log(beta))`` with ``log(beta)`` from the host in double. ``1 - powf(beta,
step)`` in fp32 cancels (1000x for beta2 = 0.999 at step 1): its update was ~1e-5 off the float64
reference, 2 ulp of an fp16 param on the GPU tests' sizes."""

from __future__ import annotations

import torch

from scaledoptim.testing.optim_db import Tolerance, row
from tests.support.launches import check_parity

# lr 1 and no trust ratio: a param moves by its whole update, which the bias corrections scale.
TIGHT = Tolerance(param_rtol=1e-6, param_atol=1e-6, state_rtol=1e-6, state_atol=1e-7)


def test_lambs_update_holds_the_float64_reference_to_1e_6() -> None:
    info = row("LAMB")
    config = next(c for c in info.configs if c.name == "no-trust-ratio")
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=generator) for n in (1, 37, 200)]
    grads = [torch.randn(p.shape, generator=generator) for p in params]
    check_parity(info, config, params, grads, inv_scale=0.5, n_steps=3, tolerance=TIGHT, lr=1.0)
