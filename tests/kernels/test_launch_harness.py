"""The kernel tests launch a row's update from the optimizer's own planning hooks
(tests/support/launches.py); this holds that harness to a step of the optimizer itself. The
update's numbers against references are the parity table's (tests/parity)."""

from __future__ import annotations

import pytest
import torch

from scaledoptim.testing.optim_db import rows
from tests.support.launches import row_update
from tests.support.tensors import assert_bytes_unchanged, boundary_params_and_grads, misaligned


@pytest.mark.parametrize("info", rows(fused=True), ids=str)
def test_the_launches_here_are_what_a_step_of_the_optimizer_launches(info, monkeypatch):
    """A step of the optimizer on the emulator writes the bytes the harness's launch writes."""
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "emulate")
    for config in info.configs:
        generator = torch.Generator().manual_seed(2)
        params, grads = boundary_params_and_grads(torch.bfloat16, torch.bfloat16, generator)
        # Copies aligned as the originals: a reduction (LAMB's norms) sums vector lanes in an
        # order that depends on the alignment.
        copies = [misaligned(p) if p.storage_offset() else p.clone() for p in params]
        ours = row_update(info, params, grads, config)
        ours.launch(torch.zeros(()), torch.tensor(0.5))
        opt = info.make(copies, config)
        for p, g in zip(copies, grads):
            p.grad = g.clone()
        _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=2.0)
        assert found_inf.item() == 0
        assert_bytes_unchanged(copies, ours.params)
        theirs = [opt.state[p] for p in copies]
        for state, expected in zip(theirs, ours.state_dicts()):
            assert_bytes_unchanged([state[key] for key in expected], list(expected.values()))
