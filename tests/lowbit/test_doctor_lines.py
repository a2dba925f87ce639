"""The doctor's 8-bit lines: the parity of AdamW(state_bits=8) with its torch form (on the
emulator here), and its bandwidth line stating the bytes per param (run on a CPU here)."""

from __future__ import annotations

import torch

from scaledoptim.doctor import CHECKS, lowbit


def test_the_8_bit_parity_check_passes_on_the_emulated_kernels() -> None:
    outcome = lowbit.parity(torch.device("cpu"))
    assert outcome.passed, outcome.detail
    assert "kernels backend" in outcome.detail and "inf step skipped" in outcome.detail
    assert "parity:AdamW-8bit" in {check.name for check in CHECKS}


def test_the_8_bit_bandwidth_line_states_the_bytes_per_param() -> None:
    outcome = lowbit.bandwidth(torch.device("cpu"), n_params=1 << 14)
    assert "20.06 B/param (float32 states: 32)" in outcome.detail
    assert next(c for c in CHECKS if c.name == "lowbit-bandwidth").needs_gpu
