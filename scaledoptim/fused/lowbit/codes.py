"""The non-linear 8-bit codes of low-bit optimizer states: small floating-point formats whose
largest value is about 2, normalized per block by a float32 scale (Note [block-wise codes]).

Note [block-wise codes]
~~~~~~~~~~~~~~~~~~~~~~~
A low-bit state stores each element as one byte, a *code*, plus one float32 *scale* per block of
``block_size`` consecutive elements (in storage order): the element's value is
``code.values[byte] * scale``. The scale is the block's largest magnitude over the code's largest
value (``absmax / code.max_value``), so the block's largest element keeps its value to an ulp and
the others keep their value relative to it.

A code here is a minifloat: ``exponent_bits`` bits of exponent and ``mantissa_bits`` bits of
mantissa, ``value = 2 ** (e - (2 ** exponent_bits - 1)) * (1 + m / 2 ** mantissa_bits)``, so the
largest exponent is 0 and every value is exact in float32. Its spacing is relative, as the
moments' errors should be (Adam's update divides one moment by the square root of the other:
what matters is each element's relative error, over a range of magnitudes that a linear code
would flush to zero; Dettmers et al., arXiv 2110.02861, show linear 8-bit codes fail there). Two
codes:

* ``SIGNED`` (first moments, momentum): a sign bit and 7 bits of magnitude, 4 of exponent and 3
  of mantissa: relative spacing 1/8, values from ``2**-15`` to 1.875 of the scale. Magnitude 0
  is zero, so the zeros a state starts with, and momentum that died out, are exact.
* ``UNSIGNED`` (second moments): 8 bits of magnitude, 4 of exponent and 4 of mantissa:
  relative spacing 1/16, values from ``2**-15`` to 1.9375 of the scale, and no zero. A second
  moment rounded down to zero would turn an element's update into ``m / eps`` (the "zero-point"
  failure of 8-bit Adam); the smallest value instead bounds it. A block whose scale is 0 (a new
  state) still reads as zeros. (Measured on a 300-step MLP regression with Adam, against fp32
  states: 4 bits of exponent and 4 of mantissa end 0.6-1.4% above them with nearest rounding,
  5 and 3 1.5-1.8%: the second moment's precision matters more than its range; with dithered
  rounding, below, both are within 0.06%.)

Encoding rounds to the nearest code, ties away from zero, with integer arithmetic on the float32
bits (the same in ``cuda/blockwise_quant.cuh`` and here, so both backends give the same bytes):
adding half of the last kept mantissa bit carries into the exponent where it should, and the
result is clamped to the code's range: values above the largest magnitude (from the scale's
rounding) take it; below the smallest, the unsigned code's smallest value, and in the signed
code, whose magnitude 0 stands for zero, a magnitude below ``1.0625 * 2**-15`` is zero.

Note [dithered rounding]
~~~~~~~~~~~~~~~~~~~~~~~~
Rounded to the nearest code at every step, a second moment stops following its average: Adam's
``v = beta2 * v + (1 - beta2) * g**2`` moves by 0.1% of ``v`` a step, less than half of the
code's relative spacing, so the rounding undoes it and ``v`` sticks where it is while the
gradients change (measured: a 300-step MLP regression ends 0.6-1.4% above fp32 states with
nearest rounding, within 0.06% with this). So the optimizers' states are rounded with a dither:
noise uniform over one step of the code, added before truncating, rounds up with the probability
of the fraction: unbiased, and the increments survive on average. The noise is no random draw
but a Weyl sequence of the element's index in its tensor (storage order) and the step number
(the count including this step), ``index * DITHER_INDEX + step * DITHER_STEP`` modulo ``2**32``
(its top bits, as int32, shifted right arithmetically), computed the same in int32 here and in
unsigned arithmetic in ``cuda/blockwise_quant.cuh``: the same bytes on both backends, across a
resume, and under CUDA-graph replay. Each element sees an evenly spread sequence of offsets over
the steps (the golden-ratio multipliers), and neighbours different ones.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

__all__ = ["DITHER_INDEX", "DITHER_STEP", "SIGNED", "UNSIGNED", "Code", "as_int32"]

#: The multipliers of Note [dithered rounding] (2**32 over the golden ratio, and over its
#: square), odd.
DITHER_INDEX = 0x9E3779B9
DITHER_STEP = 0x61C88647

_FLOAT_MANTISSA_BITS = 23
_FLOAT_EXPONENT_BIAS = 127
_INT32_MIN = -(1 << 31)


@dataclasses.dataclass(frozen=True)
class Code:
    """An 8-bit minifloat code of normalized values (Note [block-wise codes]).

    Attributes:
        signed: a sign bit (bit 7) and 7 bits of magnitude, whose magnitude 0 is zero; else 8
            bits of magnitude and no zero.
        exponent_bits: bits of the magnitude's exponent.
        mantissa_bits: bits of the magnitude's mantissa (the rest of the 7 or 8 bits).
    """

    signed: bool
    exponent_bits: int
    mantissa_bits: int

    def __post_init__(self) -> None:
        if self.exponent_bits + self.mantissa_bits != self.magnitude_bits:
            raise ValueError(
                f"A {'signed' if self.signed else 'unsigned'} 8-bit code has "
                f"{self.magnitude_bits} bits of magnitude, got {self.exponent_bits} of "
                f"exponent and {self.mantissa_bits} of mantissa"
            )

    @property
    def magnitude_bits(self) -> int:
        return 7 if self.signed else 8

    @property
    def max_value(self) -> float:
        """The largest magnitude: ``2 - 2 ** -mantissa_bits``."""
        return 2.0 - 2.0**-self.mantissa_bits

    @property
    def _shift(self) -> int:
        return _FLOAT_MANTISSA_BITS - self.mantissa_bits

    @property
    def _exponent_offset(self) -> int:
        """The float32 exponent field of magnitude index 0."""
        return _FLOAT_EXPONENT_BIAS - (2**self.exponent_bits - 1)

    @functools.cached_property
    def _values_cpu(self) -> Tensor:
        magnitude = torch.arange(2**self.magnitude_bits, dtype=torch.int32)
        bits = (magnitude + (self._exponent_offset << self.mantissa_bits)) << self._shift
        values = bits.view(torch.float32)
        if not self.signed:
            return values
        values = values.clone()
        values[0] = 0.0
        return torch.cat([values, -values])  # bit 7: the sign (-0.0 for code 128)

    def values(self, device: torch.device | str = "cpu") -> Tensor:
        """The 256 values, indexed by code (float32 on ``device``)."""
        return _values_on(self, torch.device(device))

    def encode(self, normalized: Tensor, dither: Tensor | None = None) -> Tensor:
        """The code of each float32 element of ``normalized`` (values divided by their block's
        scale), as int32 in ``[0, 256)`` (Note [block-wise codes]): the nearest one, or with
        ``dither`` (int32 noise shaped like ``normalized``, Note [dithered rounding]) the one
        below or above it, unbiased."""
        bits = normalized.view(torch.int32)
        magnitude = bits & 0x7FFFFFFF  # (the unsigned code keeps magnitudes too)
        offset = self._offset
        if dither is None:
            index = magnitude + offset
        else:
            index = dither >> (32 - self._shift)  # uniform in [-half, half) of a kept bit
            index += magnitude
            index += offset
        index >>= self._shift
        index.clamp_(0, 2**self.magnitude_bits - 1)
        if self.signed:
            index |= (bits >> 31) & 0x80
        return index

    def decode(self, codes: Tensor) -> Tensor:
        """The normalized value of each code (float32, on the codes' device)."""
        return self.values(codes.device)[codes.int()]

    # The in-place forms below are what a step runs (Note [low-bit batches] in form.py): the
    # same bytes and values as encode() and decode(), by integer arithmetic on the float32 bits
    # (as cuda/blockwise_quant.cuh computes them), each op in place on preallocated buffers.

    def rounding_terms_(self, dither: Tensor, out: Tensor) -> Tensor:
        """``out`` (int32, shaped like ``dither``) set to what :meth:`encode_` adds to each
        normalized magnitude's float32 bits: the top bits of ``dither`` (one step of the code,
        centred on 0) and the offset of :meth:`encode`; returns ``out``. Codes sharing a
        dither share it."""
        torch.bitwise_right_shift(dither, 32 - self._shift, out=out)
        return out.add_(self._offset)

    def encode_(self, normalized: Tensor, terms: Tensor, out: Tensor, scratch: Tensor) -> Tensor:
        """:meth:`encode` of ``normalized`` (float32, flat; overwritten) dithered by ``terms``
        (:meth:`rounding_terms_`), written into ``out`` (uint8, flat); ``scratch``: an int32
        buffer of the same size. Returns ``out``."""
        bits = normalized.view(torch.int32)
        if self.signed:  # the sign bit, as 0 or INT32_MIN
            sign = torch.bitwise_and(bits, _INT32_MIN, out=scratch)
        bits.bitwise_and_(0x7FFFFFFF)
        bits.add_(terms)
        bits.bitwise_right_shift_(self._shift)
        bits.clamp_(0, 2**self.magnitude_bits - 1)
        if self.signed:  # INT32_MIN >> 24 is -128, whose low byte is the code's bit 7
            bits.bitwise_or_(sign.bitwise_right_shift_(24))
        return out.copy_(bits)  # (int32 to uint8 keeps the low byte)

    def decode_(self, codes: Tensor, out: Tensor, scratch: Tensor) -> Tensor:
        """:meth:`decode` of ``codes`` (uint8, flat) into ``out`` (float32, flat); ``scratch``:
        an int32 buffer of the same size. Returns ``out``."""
        bits = out.view(torch.int32)
        if not self.signed:
            bits.copy_(codes)
            bits.add_(self._exponent_offset << self.mantissa_bits)
            bits.bitwise_left_shift_(self._shift)
            return out
        bits.copy_(codes.view(torch.int8))  # sign-extended: bit 31 is the code's bit 7
        sign = torch.bitwise_and(bits, _INT32_MIN, out=scratch)
        bits.bitwise_and_(0x7F)
        bits.add_(self._exponent_offset << self.mantissa_bits)
        bits.bitwise_left_shift_(self._shift)
        torch.threshold_(out, self._smallest, 0.0)  # magnitude 0 is zero
        bits.bitwise_or_(sign)
        return out

    @property
    def _offset(self) -> int:
        """Half of the last kept mantissa bit, less the exponent offset, in float32 bit units."""
        return (1 << (self._shift - 1)) - (self._exponent_offset << _FLOAT_MANTISSA_BITS)

    @property
    def _smallest(self) -> float:
        """Magnitude index 0's value: ``2 ** -(2 ** exponent_bits - 1)``."""
        return 2.0 ** -(2**self.exponent_bits - 1)


@functools.cache
def _values_on(code: Code, device: torch.device) -> Tensor:
    return code._values_cpu.to(device)


#: The code of signed states (first moments, momentum): 4 bits of exponent, 3 of mantissa.
SIGNED = Code(signed=True, exponent_bits=4, mantissa_bits=3)
#: The code of non-negative states (second moments): 4 bits of exponent, 4 of mantissa.
UNSIGNED = Code(signed=False, exponent_bits=4, mantissa_bits=4)


def as_int32(value: int) -> int:
    """``value`` modulo ``2**32`` as a signed int32 (torch's int32 ops take no larger scalar)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value
