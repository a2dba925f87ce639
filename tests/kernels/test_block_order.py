"""The emulator runs a launch's blocks in a shuffled order drawn from
``launch_config.emulator_block_order_seed``, so a result that depends on block order shows on a
CPU as it would on a GPU; LAMB's sums do not depend on it (Note [deterministic sums] in
cuda/block_sums.cuh)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from torch import Tensor

from scaledoptim import kernels
from scaledoptim.kernels import LaunchConfig, launch_config
from scaledoptim.optim.lamb import LAMB_GRAD_NORM_KERNEL
from scaledoptim.testing.optim_db import row
from tests.support.launches import row_update
from tests.support.tensors import CHUNK


class BlockOrderArgs(ctypes.Structure):
    _fields_ = [("ran", ctypes.c_void_p), ("count", ctypes.c_void_p)]


BLOCK_ORDER = kernels.MultiTensorKernel(
    Path(__file__).parent / "data" / "block_order.cu", "block_order_kernel", ("x",), BlockOrderArgs
)


def block_order(n_blocks: int) -> list[int]:
    """The blocks of one launch of ``n_blocks`` blocks, in the order they ran."""
    ran = torch.full((n_blocks,), -1.0)
    count = torch.zeros((), dtype=torch.int32)
    kernels.launch(
        BLOCK_ORDER,
        [[torch.zeros(n_blocks * CHUNK)]],
        BlockOrderArgs(ran.data_ptr(), count.data_ptr()),
    )
    return [int(b) for b in ran.tolist()]


def test_blocks_run_once_each_in_the_order_the_seed_draws(monkeypatch):
    orders = {}
    for seed in (0, 1, 2**64 - 1):
        monkeypatch.setattr(launch_config, "emulator_block_order_seed", seed)
        order = block_order(40)
        assert sorted(order) == list(range(40))
        assert block_order(40) == order  # reproducible
        orders[seed] = tuple(order)
    assert orders[0] != tuple(range(40))  # the default seed shuffles too
    assert len(set(orders.values())) == 3


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_an_out_of_range_seed_is_refused(seed):
    with pytest.raises(ValueError, match=f"Invalid emulator_block_order_seed: {seed}; use an"):
        LaunchConfig(emulator_block_order_seed=seed).validate()


#: Tensors of many chunks (their norms add many partials), one of a single partial chunk, and a
#: bfloat16 param and grad (a second instantiation: the global grad norm spans launches).
SIZES_AND_DTYPES = (
    (9 * CHUNK + 5, torch.float32),
    (3 * CHUNK, torch.float32),
    (13, torch.float32),
    (6 * CHUNK + 1, torch.bfloat16),
)


def lamb_steps(seed: int) -> list[Tensor]:
    """Every tensor of a LAMB update (params, state, partial sums, counters) after three steps
    with blocks in the order ``seed`` draws; values spread over six decades, so that adding
    them in another order changes low bits."""
    launch_config.emulator_block_order_seed = seed
    generator = torch.Generator().manual_seed(0)

    def spread(n: int, dtype: torch.dtype) -> Tensor:
        decades = torch.randint(-3, 3, (n,), generator=generator).double()
        return (torch.randn(n, generator=generator, dtype=torch.float64) * 10**decades).to(dtype)

    params = [spread(n, dtype) for n, dtype in SIZES_AND_DTYPES]
    grads = [spread(n, dtype) for n, dtype in SIZES_AND_DTYPES]
    update = row_update(row("LAMB"), params, grads, max_grad_norm=1.0, weight_decay=0.01)
    for _ in range(3):
        update.launch(torch.zeros(()), torch.tensor(0.5))
    return update.tensors


def test_lamb_has_the_same_bits_whatever_order_blocks_run_in(monkeypatch):
    monkeypatch.setattr(launch_config, "emulator_block_order_seed", 0)
    expected = lamb_steps(0)
    for seed in (1, 2, 3):
        actual = lamb_steps(seed)
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert torch.equal(a.reshape(-1).view(torch.uint8), e.reshape(-1).view(torch.uint8)), (
                seed,
                i,
            )


def test_a_per_chunk_list_of_the_wrong_length_is_refused():
    grads = [torch.zeros(3 * CHUNK + 1)]
    with pytest.raises(ValueError, match=r"grad_sq_partials\[0\] has 3 elements, expected 4"):
        kernels.prepare_launch(LAMB_GRAD_NORM_KERNEL, [grads, [torch.zeros(3)]])
