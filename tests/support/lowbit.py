"""What the tests of 8-bit optimizer states share: a regression task to measure quality on, a
planted linear code, and an independent reference of a low-bit step."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

import scaledoptim
from scaledoptim.fused.lowbit import Code, dequantize_blockwise
from scaledoptim.fused.lowbit.codes import DITHER_INDEX, DITHER_STEP

__all__ = ["LOWBIT_ROWS", "LinearCode", "LowBitRow", "dither", "regression_loss", "requantize"]


def regression_loss(
    make_optimizer: Callable[[Iterable[Tensor]], torch.optim.Optimizer],
    steps: int = 300,
    seed: int = 0,
) -> float:
    """The held-out loss of an MLP (about 6k params, every weight several blocks of 256) fit to
    a fixed random teacher by ``steps`` unscale_and_step steps of the optimizer."""
    torch.manual_seed(seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
        torch.nn.Linear(64, 4),
    )
    opt = make_optimizer(model.parameters())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        test_x = torch.randn(512, 16, generator=generator)
        test_y = teacher(test_x)
    for _ in range(steps):
        x = torch.randn(64, 16, generator=generator)
        with torch.no_grad():
            y = teacher(x)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if isinstance(opt, scaledoptim.Optimizer):
            scaledoptim.scale_outputs(loss, opt.scale).backward()
            opt.unscale_and_step(grads_scaled_by=opt.scale)
        else:
            loss.backward()
            opt.step()
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(test_x), test_y).item()


class LinearCode(Code):
    """A linear 8-bit code (planted: what Note [block-wise codes] says fails): 255 evenly spaced
    values in ``[-1, 1]`` (signed, with zero) or 256 in ``[0, 1]``, nearest rounding."""

    def __init__(self, signed: bool) -> None:
        super().__init__(signed, 4, 3 if signed else 4)

    @property
    def max_value(self) -> float:
        return 1.0

    def values(self, device: torch.device | str = "cpu") -> Tensor:
        index = torch.arange(256, dtype=torch.float32, device=device)
        return (index - 127).clamp(-127, 127) / 127 if self.signed else index / 255

    def encode(self, normalized: Tensor, dither: Tensor | None = None) -> Tensor:
        if self.signed:
            return (normalized.clamp(-1, 1) * 127).round().int() + 127
        return (normalized.clamp(0, 1) * 255).round().int()

    def rounding_terms_(self, dither: Tensor, out: Tensor) -> Tensor:
        return out  # no dither

    def encode_(self, normalized: Tensor, terms: Tensor, out: Tensor, scratch: Tensor) -> Tensor:
        return out.copy_(self.encode(normalized))

    def decode_(self, codes: Tensor, out: Tensor, scratch: Tensor) -> Tensor:
        return out.copy_(self.decode(codes))


def dither(numel: int, step: int) -> Tensor:
    """The int32 noise of a tensor's elements at ``step``, computed here in int64 from its
    definition (See Note [dithered rounding])."""
    index = torch.arange(numel, dtype=torch.int64)
    bits = (index * DITHER_INDEX + step * DITHER_STEP) & 0xFFFFFFFF
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)


def requantize(
    values: Tensor, code: Code, block_size: int, step: int
) -> tuple[Tensor, Tensor]:
    """``values`` (float32, contiguous) as codes and scales, dithered at ``step``: the encoding
    the optimizers' low-bit states get, written out independently of their batches."""
    numel = values.numel()
    blocks = -(-numel // block_size)
    padded = torch.zeros(blocks * block_size)
    padded[:numel] = values.flatten()
    rows = padded.view(blocks, block_size)
    scales = rows.abs().amax(1) / code.max_value
    normalized = rows * torch.reciprocal(scales.clamp_min(torch.finfo(torch.float32).tiny))[:, None]
    noise = torch.zeros(blocks * block_size, dtype=torch.int32)
    noise[:numel] = dither(numel, step)
    codes = code.encode(normalized, noise.view(blocks, block_size)).flatten()[:numel]
    return codes.to(torch.uint8).view(values.shape), scales


def decode(codes: Tensor, scales: Tensor, code: Code, block_size: int) -> Tensor:
    return dequantize_blockwise(codes, scales, code, block_size)


class LowBitRow:
    """An optimizer with 8-bit states, as the tests of ``tests/lowbit/`` make it: ``make(params,
    state_bits, **options)`` with the row's hyper-parameters, and the names of its states."""

    def __init__(
        self,
        name: str,
        cls: type[scaledoptim.FusedOptimizer],
        states: tuple[str, ...],
        **options: object,
    ) -> None:
        self.name, self.cls, self.states, self.options = name, cls, states, options

    def make(
        self, params: Iterable[Tensor], state_bits: int = 8, **options: object
    ) -> scaledoptim.FusedOptimizer:
        return self.cls(params, state_bits=state_bits, **{**self.options, **options})

    def __repr__(self) -> str:
        return self.name


#: Every optimizer with 8-bit states, with options that turn every state on.
LOWBIT_ROWS = [
    LowBitRow("AdamW", scaledoptim.AdamW, ("exp_avg", "exp_avg_sq"), lr=3e-3),
    LowBitRow(
        "Adam-amsgrad", scaledoptim.Adam, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
        lr=3e-3, amsgrad=True, weight_decay=1e-2,
    ),
    LowBitRow("Lion", scaledoptim.Lion, ("exp_avg",), lr=3e-4, weight_decay=0.1),
    LowBitRow(
        "SGD-momentum", scaledoptim.SGD, ("momentum_buffer",), lr=0.05, momentum=0.9,
        dampening=0.1,
    ),
    LowBitRow(
        "RMSprop-momentum", scaledoptim.RMSprop, ("square_avg", "momentum_buffer"), lr=1e-3,
        momentum=0.9,
    ),
]
