"""The no-closure ``unscale_and_step`` of every fused row of optim_db (its default config), and of
every optimizer with 8-bit states (``state_bits=8``), on a real GPU: captured in a CUDA graph it
replays bit for bit as eager steps do (codes and block scales included; an inf grad makes the
replay a skip), and it never syncs with the host. Skipped without a CUDA device: on a CPU the
emulator runs the same kernels (tests/lowbit: no host read, skips bit-identical)."""

from __future__ import annotations

import pytest
import torch

import scaledoptim
from scaledoptim.doctor.graphs import replay_against_eager
from scaledoptim.testing.optim_db import rows
from tests.support.gpu import CUDA_KERNEL_MARKS

pytestmark = list(CUDA_KERNEL_MARKS)
# (elements, dtype): one element, a multi-chunk odd size, and a 16-bit param in the same group.
PARAMS = ((1, torch.float32), (3 * 65536 + 7, torch.float32), (4099, torch.bfloat16))


#: How each optimizer under test is made: the fused rows, then those with 8-bit states.
MAKERS = [
    *(pytest.param(info.make, id=str(info)) for info in rows(fused=True)),
    pytest.param(lambda ps: scaledoptim.AdamW(ps, lr=1e-3, state_bits=8), id="AdamW-8bit"),
    pytest.param(lambda ps: scaledoptim.Adam(ps, lr=1e-3, state_bits=8), id="Adam-8bit"),
    pytest.param(lambda ps: scaledoptim.Lion(ps, lr=1e-4, state_bits=8), id="Lion-8bit"),
    pytest.param(
        lambda ps: scaledoptim.SGD(ps, lr=1e-3, momentum=0.9, state_bits=8), id="SGD-8bit"
    ),
    pytest.param(lambda ps: scaledoptim.RMSprop(ps, lr=1e-3, state_bits=8), id="RMSprop-8bit"),
]


def _params() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(n, device="cuda").to(dtype) for n, dtype in PARAMS]


@pytest.mark.parametrize("make", MAKERS)
def test_a_captured_step_replays_bit_for_bit_and_skips_on_inf(make) -> None:
    seen = replay_against_eager(make, _params(), replays=4)  # raises on a mismatch
    assert seen.replays_matched == 4
    assert seen.found_inf_after_inf == 1.0  # the tensor returned by the capturing call
    assert seen.scale_after_inf == seen.scale_before_inf / 2 == 2.0**15


@pytest.mark.parametrize("make", MAKERS)
def test_unscale_and_step_does_not_sync_under_sync_debug_mode_error(make) -> None:
    params = [torch.nn.Parameter(p) for p in _params()]
    opt = make(params)
    found = []
    for step in range(4):
        for p in params:
            p.grad = (torch.randn(p.shape, device="cuda") * opt.scale).to(p.dtype)
        if step == 2:
            params[1].grad[5] = float("nan")
        if step == 0:  # state, kernel compilation and tables outside the watch
            opt.unscale_and_step(grads_scaled_by=opt.scale)
            continue
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        found.append(found_inf.item())
    assert found == [0.0, 1.0, 0.0]
    assert opt.scale.item() == 2.0**15
