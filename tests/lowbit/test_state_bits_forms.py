"""The two forms of an 8-bit step: torch's ops against an independent reference written from
the definitions (decode, the float32 step, dithered encode: Note [block-wise codes], Note
[dithered rounding]), and our kernels (through the emulator) against torch's ops, at block sizes
below, at and above the chunk size, odd ones, and thread counts that split blocks unevenly
(Note [low-bit blocks in a chunk])."""

from __future__ import annotations

import os

import pytest
import torch

import scaledoptim
from scaledoptim.fused.lowbit import SIGNED, UNSIGNED, dequantize_blockwise
from scaledoptim.fused.lowbit import form as lowbit_form
from scaledoptim.kernels import launch_config
from tests.support.lowbit import requantize

SHAPES = [(3, 37), (200,), (5,), (64, 3)]


def _params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in SHAPES
    ]


def _grads(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=generator) * 2.0 ** (-step) for shape in SHAPES]


def _run(opt: scaledoptim.FusedOptimizer, params: list[torch.nn.Parameter], steps: int) -> None:
    for step in range(steps):
        for param, grad in zip(params, _grads(step)):
            param.grad = grad.to(param.dtype)
        opt.step()


@pytest.mark.parametrize("block_size", [16, 100])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("batch", [None, 32], ids=["one-batch", "cut"])
def test_the_torch_form_is_decode_step_encode(
    monkeypatch, block_size: int, amsgrad: bool, batch: int | None
) -> None:
    """Step by step: each state decoded, torch.optim.AdamW's fused step on float32 states, each
    state encoded again with the dither of its step; the same bytes, the same params. In one
    batch, and in batches of at most 32 elements (or a block), which cut the params into pieces
    (Note [low-bit batches]): whole blocks decoded and encoded in place, partial ones, pieces
    gathered from several params."""
    if batch is not None:
        monkeypatch.setattr(lowbit_form, "LOWBIT_BATCH", batch)
    params = _params()
    opt = scaledoptim.AdamW(params, lr=0.01, state_bits=8, block_size=block_size, amsgrad=amsgrad)
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    codes = {"exp_avg": SIGNED, "exp_avg_sq": UNSIGNED, "max_exp_avg_sq": UNSIGNED}
    for step in range(1, 5):
        expected_params = [p.detach().clone() for p in params]
        reference = torch.optim.AdamW(expected_params, lr=0.01, amsgrad=amsgrad, fused=True)
        for param, expected, grad in zip(params, expected_params, _grads(step)):
            param.grad, expected.grad = grad, grad.clone()
            state = opt.state.get(param, {})
            reference.state[expected] = {
                "step": torch.tensor(float(step - 1)),
                **{
                    key: dequantize_blockwise(
                        state[f"{key}_codes"], state[f"{key}_scales"], codes[key], block_size
                    )
                    if state
                    else torch.zeros_like(param)
                    for key in keys
                },
            }
        opt.step()
        reference.step()
        for param, expected in zip(params, expected_params):
            assert torch.equal(param, expected)
            for key in keys:
                want_codes, want_scales = requantize(
                    reference.state[expected][key], codes[key], block_size, step
                )
                assert torch.equal(opt.state[param][f"{key}_codes"], want_codes)
                assert torch.equal(opt.state[param][f"{key}_scales"], want_scales)


@pytest.mark.parametrize(
    ("block_size", "chunk_size", "threads"),
    [(16, 64, 32), (100, 64, 24), (256, 128, 32), (7, 64, 5), (40, 160, 32)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_kernels_compute_the_torch_form(
    monkeypatch, block_size: int, chunk_size: int, threads: int, dtype: torch.dtype
) -> None:
    """The same codes; scales and params to the float32 rounding of the two Adam updates
    (torch's fused op and cuda/adam.cu differ in the last bits)."""
    monkeypatch.setattr(launch_config, "chunk_size", chunk_size)
    monkeypatch.setattr(launch_config, "emulator_threads_per_block", threads)
    runs = []
    for mode in (None, "emulate"):
        if mode is None:
            monkeypatch.delenv("SCALEDOPTIM_KERNELS", raising=False)
        else:
            monkeypatch.setenv("SCALEDOPTIM_KERNELS", mode)
        params = _params(dtype)
        opt = scaledoptim.Adam(
            params, lr=0.01, state_bits=8, block_size=block_size, amsgrad=True, weight_decay=0.1
        )
        _run(opt, params, 4)
        runs.append((params, opt))
    (torch_params, torch_opt), (kernel_params, kernel_opt) = runs
    assert os.environ.get("SCALEDOPTIM_KERNELS") == "emulate"
    for torch_param, kernel_param in zip(torch_params, kernel_params):
        torch.testing.assert_close(kernel_param, torch_param, rtol=1e-5, atol=1e-6)
        for key, value in torch_opt.state[torch_param].items():
            got = kernel_opt.state[kernel_param][key]
            if key.endswith("_codes"):
                flips = (got.int() - value.int()).abs()
                assert flips.max() <= 1 and flips.float().mean() < 0.01, key
            else:
                torch.testing.assert_close(got, value, rtol=1e-5, atol=0)
