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
    values: Tensor,
    code: Code,
    scales: Tensor,
    out: Tensor,
    terms: Tensor,
    scratch: Tensor,
) -> Tensor:
    """The codes of ``values``, a float32 ``(blocks, block_size)`` tensor (overwritten), each
    block normalized by its largest magnitude and dithered by ``terms`` (int32, the shape of
    ``values``: :meth:`Code.rounding_terms_`), into ``out`` (uint8, the same shape); writes each
    block's scale into ``scales`` (``blocks`` float32). ``scratch``: an int32 buffer of
    ``values.numel()`` elements. Returns ``out``.

    A partial last block must be padded with zeros (a zero does not move a block's scale).
    """
    _normalize_(values, code, scales, scratch)
    return code.encode_(values.view(-1), terms.view(-1), out.view(-1), scratch)


def _normalize_(values: Tensor, code: Code, scales: Tensor, scratch: Tensor) -> None:
    """Each block of ``values`` over its scale (its largest magnitude over the code's largest
    value), in place; the scales into ``scales``."""
    if code.signed:
        magnitudes = torch.abs(values, out=scratch.view(torch.float32).view_as(values))
    else:  # the unsigned code keeps magnitudes only
        magnitudes = values.abs_()
    absmax = torch.amax(magnitudes, dim=1)
    torch.div(absmax, code.max_value, out=scales)
    # (the same two roundings as cuda/blockwise_quant.cuh: the scale, and the normalizer)
    normalizer = torch.reciprocal(scales.clamp_min(_TINY))
    values.mul_(normalizer.unsqueeze(1))


def decode_blocks_(
    codes: Tensor, scales: Tensor, code: Code, out: Tensor, scratch: Tensor
) -> Tensor:
    """``out``, a float32 ``(blocks, block_size)`` tensor, set to the values of ``codes`` (uint8,
    the same shape) in blocks of scale ``scales`` (``blocks`` float32); ``scratch``: an int32
    buffer of ``codes.numel()`` elements. Returns ``out``."""
    code.decode_(codes.view(-1), out.view(-1), scratch)
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
    scratch = torch.empty(blocks * block_size, dtype=torch.int32, device=values.device)
    _normalize_(padded.view(blocks, block_size), code, scales, scratch)
    codes = code.encode(padded)  # the nearest codes
    out = torch.empty_like(values, dtype=torch.uint8)
    storage_flat(out).copy_(codes[:numel])
    return out, scales


def dequantize_blockwise(codes: Tensor, scales: Tensor, code: Code, block_size: int) -> Tensor:
    """The float32 values of ``codes`` (uint8, dense) and ``scales`` (one per block of
    ``block_size`` elements in storage order), shaped and strided like ``codes``."""
    numel = codes.numel()
    blocks = block_count(numel, block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.uint8, device=codes.device)
    padded[:numel] = storage_flat(codes)
    values = torch.empty(blocks * block_size, dtype=torch.float32, device=codes.device)
    scratch = torch.empty(blocks * block_size, dtype=torch.int32, device=codes.device)
    decode_blocks_(
        padded.view(blocks, block_size), scales, code, values.view(blocks, block_size), scratch
    )
    out = torch.empty_like(codes, dtype=torch.float32)
    storage_flat(out).copy_(values[:numel])
    return out
