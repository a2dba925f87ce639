"""Block-wise quantization with torch ops: float32 values to one code per element and one
float32 scale per block, and back (Note [block-wise codes] in codes.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...torch_ops import storage_flat
from .codes import Code

__all__ = [
    "block_count",
    "decode_blocks_",
    "dequantize_blockwise",
    "encode_blocks_",
    "quantize_blockwise",
]

# The smallest normal float32: a block's scale is divided by at least this, so a block of zeros
# encodes as zeros (its scale is 0) and never divides by zero.
_TINY = torch.finfo(torch.float32).tiny


def block_count(numel: int, block_size: int) -> int:
    """The blocks (and scales) of a state of ``numel`` elements: the last one may be partial."""
    return -(-numel // block_size)


def encode_blocks_(
    values: Tensor, code: Code, scales: Tensor, dither: Tensor | None = None
) -> Tensor:
    """The codes of ``values``, a float32 ``(blocks, block_size)`` tensor, each block normalized
    by its largest magnitude; writes each block's scale into ``scales`` (``blocks`` float32) and
    overwrites ``values`` with the normalized values. Returns the codes as int32 in ``[0, 256)``
    shaped like ``values``: the nearest, or dithered by ``dither`` (:meth:`Code.encode`).

    A partial last block must be padded with zeros (a zero does not move a block's scale).
    """
    absmax = values.abs().amax(dim=1)
    torch.div(absmax, code.max_value, out=scales)
    # (the same two roundings as cuda/blockwise_quant.cuh: the scale, and the normalizer)
    normalizer = torch.reciprocal(scales.clamp_min(_TINY))
    values.mul_(normalizer.unsqueeze(1))
    return code.encode(values, dither)


def decode_blocks_(codes: Tensor, scales: Tensor, code: Code, out: Tensor) -> Tensor:
    """``out``, a float32 ``(blocks, block_size)`` tensor, set to the values of ``codes`` (uint8,
    the same shape) in blocks of scale ``scales`` (``blocks`` float32); returns ``out``."""
    torch.index_select(code.values(codes.device), 0, codes.view(-1).int(), out=out.view(-1))
    return out.mul_(scales.unsqueeze(1))


def quantize_blockwise(
    values: Tensor, code: Code, block_size: int
) -> tuple[Tensor, Tensor]:
    """``values`` (a dense floating tensor) as codes and scales: uint8 codes with its shape and
    strides, and ``block_count(numel, block_size)`` float32 scales of its blocks of
    ``block_size`` elements in storage order."""
    numel = values.numel()
    blocks = block_count(numel, block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.float32, device=values.device)
    padded[:numel] = storage_flat(values)
    scales = torch.empty(blocks, dtype=torch.float32, device=values.device)
    codes = encode_blocks_(padded.view(blocks, block_size), code, scales)
    out = torch.empty_like(values, dtype=torch.uint8)
    storage_flat(out).copy_(codes.view(-1)[:numel])
    return out, scales


def dequantize_blockwise(codes: Tensor, scales: Tensor, code: Code, block_size: int) -> Tensor:
    """The float32 values of ``codes`` (uint8, dense) and ``scales`` (one per block of
    ``block_size`` elements in storage order), shaped and strided like ``codes``."""
    numel = codes.numel()
    blocks = block_count(numel, block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.uint8, device=codes.device)
    padded[:numel] = storage_flat(codes)
    values = torch.empty(blocks * block_size, dtype=torch.float32, device=codes.device)
    decode_blocks_(padded.view(blocks, block_size), scales, code, values.view(blocks, block_size))
    out = torch.empty_like(codes, dtype=torch.float32)
    storage_flat(out).copy_(values[:numel])
    return out
