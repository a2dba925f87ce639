"""Stochastic rounding to bf16 in torch ops: the counter-based hash of ``so_sr_noise`` in
``cuda/dtypes.cuh`` in the same integer arithmetic (Note [stochastic rounding]), so both backends
round to the same bits."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .batches import Pieces, batches, storage_flat
from .skip import PackedSteps

__all__ = ["SR_CHUNK", "StochasticRounding", "initial_seed", "stochastic_round_"]

_MASK32 = 0xFFFFFFFF
_ALL = slice(None)


def initial_seed(index: int) -> Tensor:
    """The stochastic-rounding seed of the ``index``-th param of an optimizer: a fixed mix of
    the index, so runs are reproducible without drawing from (and shifting) torch's global
    generator."""
    return torch.tensor(
        _to_int32(_fmix32_int((index * 0x9E3779B9 + 0x7F4A7C15) & _MASK32)), dtype=torch.int32
    )


def stochastic_round_(
    params: list[Tensor],
    values: list[Tensor],
    seeds: list[Tensor],
    steps: list[Tensor],
    *,
    on_host: bool = False,
) -> None:
    r"""``params[i] = round_stochastic(values[i])`` for bf16 params, on device, as the kernels do.

    ``steps[i]`` is the taken-step count including this step; a value exactly representable in
    bf16 (e.g. an unchanged param of a skipped step) is stored unchanged whatever the noise.

    The hash and the rounding run in int32, the same bits as the kernels' ``unsigned``
    arithmetic (Note [stochastic rounding in int32]), the keys of all tensors at once, over
    chunks of at most :data:`SR_CHUNK` elements (a run of small tensors concatenated, or a
    slice of a large one) in buffers allocated once per call. So the transient memory is a few
    chunks whatever the params' size (not a transient of 66 B per param, as whole-tensor int64
    keys were), and small tensors cost no op each.
    It syncs with no device: only where the caller says the tensors are on the host,
    ``on_host``, does it read one (whether a chunk holds a NaN) or make one from Python values
    (a run's sizes).
    """
    if not params:
        return
    size = sum(v.numel() for v in values)
    StochasticRounding(seeds, steps, size, on_host=on_host).round_(params, values)


class StochasticRounding:
    r"""One step's stochastic rounding of bf16 params, by runs of tensors or pieces of them:
    the keys of every tensor hashed once, and the chunk buffers allocated once, for
    :meth:`round_` to round any run of them; :meth:`rekey` readies it for another step of the
    same params, with the same buffers.

    Args:
        seeds, steps: every param's seed and taken-step count including this step, as
            :func:`stochastic_round_` takes them.
        size: the most elements one :meth:`round_` rounds (its buffers hold
            ``min(size, SR_CHUNK)``).
        on_host: as :func:`stochastic_round_`'s.
        pieces: the params cut into pieces (:class:`~scaledoptim.torch_ops.Pieces`): each
            piece then rounds with its tensor's key and its elements' indices in that tensor,
            so the same bits as the whole tensor's rounding; ``None``: whole tensors.
    """

    def __init__(
        self,
        seeds: list[Tensor],
        steps: list[Tensor],
        size: int,
        *,
        on_host: bool = False,
        pieces: Pieces | None = None,
    ) -> None:
        if pieces is not None and pieces.limit % SR_CHUNK:
            raise ValueError(
                f"pieces of {pieces.limit} elements do not start where chunks of {SR_CHUNK} do "
                "(Note [stochastic rounding in int32]); cut them at a multiple of SR_CHUNK"
            )
        self.pieces = pieces
        cut = pieces is not None and pieces.owner_index is not None
        self.starts = pieces.starts if pieces is not None and cut else None
        self.buffers = _SrBuffers(min(SR_CHUNK, size), seeds[0].device, on_host)
        self.rekey(seeds, steps, on_host=on_host)

    def rekey(self, seeds: list[Tensor], steps: list[Tensor], *, on_host: bool = False) -> None:
        """The keys of another step (``seeds``, ``steps`` and ``on_host`` as the constructor
        takes them), for the same params or pieces."""
        keys = _sr_key(
            torch.stack(seeds).view(torch.int32).to(torch.int64) & _MASK32,
            (steps.flat if isinstance(steps, PackedSteps) else torch.stack(steps)).to(torch.int64)
            & _MASK32,
        )
        pieces = self.pieces
        if pieces is not None and pieces.owner_index is not None:
            keys = keys[pieces.owner_index]
        self.keys = keys
        starts = 0 if pieces is None or pieces.start_index is None else pieces.start_index
        self.small_keys = _chunk_key(keys, starts)
        self.buffers.on_host = on_host

    def round_(
        self,
        params: list[Tensor],
        values: list[Tensor],
        run: slice = _ALL,
        flat: Tensor | None = None,
    ) -> None:
        """``params[i] = round_stochastic(values[i])``, where ``params`` and ``values`` are the
        tensors (or pieces) ``run`` of those the keys were made for; ``flat``: a 1-D float32
        tensor that holds the ``values``, dense, one after the other (then they need no
        concatenating)."""
        keys, small_keys = self.keys[run], self.small_keys[run]
        first, at = run.start or 0, 0
        for chunk_run in batches(values, SR_CHUNK):
            i = chunk_run.start
            size = sum(v.numel() for v in values[chunk_run])
            if values[i].numel() > SR_CHUNK:  # alone in its run
                start = 0 if self.starts is None else self.starts[first + i]
                _round_large_(params[i], values[i], keys[i], self.buffers, start)
            else:
                bits = None if flat is None else flat[at : at + size]
                run_keys = small_keys[chunk_run]
                _round_run_(params[chunk_run], values[chunk_run], run_keys, self.buffers, bits)
            at += size


# Note [stochastic rounding in int32]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The kernels round x (float32 bits b, as unsigned) to the bf16 pattern (b + noise) >> 16, with
# noise = fmix32(index ^ key) >> 16, or to the quiet NaN (b >> 16) | 0x40 where x is a NaN
# (cuda/dtypes.cuh). torch has no uint32 arithmetic, so the torch form runs it in int32, whose
# add, xor and multiplication give the same 32 bits as uint32's; a right shift is arithmetic,
# masked where it must be logical. It leaves out every step that cannot change the result:
# * fmix32's last step, h ^= h >> 16, changes only the low 16 bits, which the noise drops.
# * Its first step, f(h) = h ^ (h >> 16) on h = c ^ i, is linear over xor: f(c ^ i) =
#   f(c) ^ f(i). A tensor of at most SR_CHUNK elements has indices i < SR_CHUNK (c = key); a
#   chunk of a larger one starts at a multiple of SR_CHUNK, a power of two, so its element i
#   has the index start ^ i (c = key ^ start). So does a piece of a tensor cut by `Pieces` (its
#   start a multiple of the batch, itself a multiple of SR_CHUNK), and a piece of at most
#   SR_CHUNK elements is one such chunk. `_chunk_key` mixes c once per tensor, piece or chunk;
#   f(i) is a constant buffer (`_SrBuffers.mixed`: i itself below 2**16).
# * For a non-NaN x, b + noise (noise in [0, 2**16)) does not overflow int32: b <= 0x7F800000
#   (+inf), or, for a negative x, -2**31 <= b <= -2**23 (-inf), so the sum stays negative. Its
#   arithmetic >> 16 is then the uint32 (b + noise) >> 16 less 2**16 when negative: the bf16
#   pattern as a sign-extended int16, which a copy into an int16 tensor stores as it is (no
#   masking to 16 bits and back). (Reading the top int16 of each int32 in memory through a
#   strided view would spare the shift, but a strided copy is a scalar loop: 3.1 ns an element
#   on this CPU, where the shift and the converting copy take 0.6 together.)
# * A NaN's b + noise can carry out of the mantissa (into inf's pattern, or past it into the
#   sign), so it is replaced before the shift by b | 0x400000, which shifts to (b >> 16) | 0x40.


class _SrBuffers:
    """The chunk buffers of one :func:`stochastic_round_` call, the constants of its hash, and
    whether its caller says its tensors are on the host (``on_host``, Note [host skip]): there
    reading one, or making one from Python values, costs no sync (Note [host skip]).

    The constants are 0-dim int32 tensors: an op converts a Python int to a tensor of its
    operand's dtype each time, about 1.5 us, a third of the cost of an op over a chunk on a
    CPU.
    """

    def __init__(self, size: int, device: torch.device, on_host: bool) -> None:
        self.index = torch.arange(size, dtype=torch.int32, device=device)
        #: Each index's first step of fmix32, f(i) (Note [stochastic rounding in int32]).
        self.mixed = self.index ^ (self.index >> 16) if size > _UNMIXED else self.index
        self.values = torch.empty(size, dtype=torch.float32, device=device)
        self.h = torch.empty(size, dtype=torch.int32, device=device)
        self.scratch = torch.empty(size, dtype=torch.int32, device=device)
        self.patterns = torch.empty(size, dtype=torch.int16, device=device)
        self.c1, self.c2, self.shift13, self.low19, self.shift16, self.low16 = (
            torch.full((), value, dtype=torch.int32, device=device)  # no copy to the device
            for value in (_C1, _C2, 13, 0x7FFFF, 16, 0xFFFF)
        )
        self.on_host = on_host


def _flat(t: Tensor) -> Tensor:
    """:func:`storage_flat`, by a cheaper view for a contiguous tensor, and none for a 1-D one
    (a view costs about 1 us: 2 ms a step over 2000 tensors)."""
    if not t.is_contiguous():
        return storage_flat(t)
    return t if t.dim() == 1 else t.view(-1)


def _round_run_(
    params: list[Tensor],
    values: list[Tensor],
    keys: Tensor,
    buffers: _SrBuffers,
    flat: Tensor | None = None,
) -> None:
    """A run of tensors of at most :data:`SR_CHUNK` elements in all, as one chunk (``keys``:
    theirs, by :func:`_chunk_key`; ``flat``: the values one after the other, or ``None``)."""
    flats = [_flat(v) for v in values]
    sizes = [f.numel() for f in flats]
    total = sum(sizes)
    if not total:
        return
    h = buffers.h[:total]
    _index_xor_keys(h, sizes, keys, buffers)
    if len(flats) == 1:  # nothing to concatenate: rounded from the value into the param
        rounded = _round_bits_(h, flats[0].view(torch.int32), buffers)
        _flat(params[0]).view(torch.int16).copy_(rounded)
        return
    if flat is None:
        flat = torch.cat(flats, out=buffers.values[:total])
    rounded = _round_bits_(h, flat.view(torch.int32), buffers)
    # One dtype view for the run, none per param: a bf16 copy is a copy of the bits.
    patterns = buffers.patterns[:total].copy_(rounded).view(torch.bfloat16)
    torch._foreach_copy_([_flat(p) for p in params], list(patterns.split(sizes)))


def _index_xor_keys(h: Tensor, sizes: list[int], keys: Tensor, buffers: _SrBuffers) -> None:
    """``h`` = the first step of fmix32 (Note [stochastic rounding in int32]) of each element's
    index in its tensor (of ``sizes``), xor its tensor's key."""
    mixed = buffers.mixed
    if all(n == sizes[0] for n in sizes):  # equal sizes (layers of a model): broadcast
        rows = h.view(len(sizes), -1)
        torch.bitwise_xor(mixed[: sizes[0]].view(1, -1), keys.view(-1, 1), out=rows)
    elif buffers.on_host and len(sizes) * _PER_TENSOR_FROM <= h.numel():  # an op per tensor
        at = 0
        for n, key in zip(sizes, keys.unbind()):
            torch.bitwise_xor(mixed[:n], key, out=h[at : at + n])
            at += n
    elif buffers.on_host:  # many small tensors: from the sizes as a tensor, no op per tensor
        total = h.numel()
        counts = torch.tensor(sizes, device=h.device)
        starts = (torch.cumsum(counts, 0) - counts).to(torch.int32)
        index = buffers.index[:total]
        torch.sub(index, torch.repeat_interleave(starts, counts, output_size=total), out=h)
        if max(sizes) > _UNMIXED:  # indices past 2**16: mixed
            h ^= torch.bitwise_right_shift(h, buffers.shift16, out=buffers.scratch[:total])
        h ^= torch.repeat_interleave(keys, counts, output_size=total)
    else:  # copying the sizes to the device would sync: views of device tensors, concatenated
        torch.cat([mixed[:n] for n in sizes], out=h)
        pieces = [key.expand(n) for key, n in zip(keys.unbind(), sizes)]
        h ^= torch.cat(pieces, out=buffers.scratch[: h.numel()])


def _round_large_(
    param: Tensor, value: Tensor, key: Tensor, buffers: _SrBuffers, start: int = 0
) -> None:
    """One tensor of more than :data:`SR_CHUNK` elements, a chunk at a time (``key``: its
    own, unmixed, uint32 in int64), or a piece of one that starts at its element ``start`` (a
    multiple of :data:`SR_CHUNK`, Note [stochastic rounding in int32])."""
    bits = _flat(value).view(torch.int32).split(SR_CHUNK)
    out = _flat(param).view(torch.int16).split(SR_CHUNK)
    end = start + value.numel()
    starts = torch.arange(start, end, SR_CHUNK, dtype=torch.int64, device=key.device)
    chunk_keys = _chunk_key(key, starts)
    for chunk_bits, chunk_out, chunk_key in zip(bits, out, chunk_keys.unbind()):
        m = chunk_bits.numel()
        h = torch.bitwise_xor(buffers.mixed[:m], chunk_key, out=buffers.h[:m])
        chunk_out.copy_(_round_bits_(h, chunk_bits, buffers))


def _round_bits_(h: Tensor, bits: Tensor, buffers: _SrBuffers) -> Tensor:
    """The bf16 patterns, as int16 values in ``h``'s int32, of the float32 ``bits`` (int32)
    rounded with the noise of ``h`` (int32, index ^ mixed key; overwritten):
    ``bfloat16_bits_from_float_sr`` of cuda/dtypes.cuh (Note [stochastic rounding in int32]).
    A copy into an int16 tensor stores them as they are."""
    _noise_(h, buffers)
    h += bits
    _quiet_nans_(h, bits, buffers.on_host)
    h >>= buffers.shift16  # See Note [stochastic rounding in int32]: not a strided view
    return h


def _noise_(h: Tensor, buffers: _SrBuffers) -> None:
    """``so_sr_noise`` in place on int32 ``h`` = index ^ mixed key: the steps of fmix32 that
    reach its top 16 bits, which it keeps (multiplications wrap as uint32's do)."""
    scratch = buffers.scratch[: h.numel()]
    h *= buffers.c1
    torch.bitwise_right_shift(h, buffers.shift13, out=scratch)
    scratch &= buffers.low19  # a logical shift
    h ^= scratch
    h *= buffers.c2
    h >>= buffers.shift16
    h &= buffers.low16  # a logical shift


def _quiet_nans_(h: Tensor, bits: Tensor, on_host: bool) -> None:
    """``h = bits | 0x400000`` where ``bits`` is a NaN: the quiet NaN once shifted."""
    # On the host a sum (one pass) tells whether there is a NaN (or an inf - inf: a harmless
    # false alarm), sparing the three passes of the where; on a device reading it would sync.
    if on_host and not math.isnan(bits.view(torch.float32).sum()):
        return
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    torch.where(nan, bits | 0x400000, h, out=h)


def _mul32(x: Tensor, constant: int) -> Tensor:
    """``x * constant mod 2**32`` for int64 tensors holding uint32, without int64 overflow."""
    lo, hi = constant & 0xFFFF, constant >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _xorshift16(h: Tensor) -> Tensor:
    """``h ^ (h >> 16)`` for int64 tensors holding uint32: fmix32's first and last step."""
    return h ^ (h >> 16)


def _fmix32(h: Tensor) -> Tensor:
    h = _mul32(_xorshift16(h), 0x85EBCA6B)
    h = h ^ (h >> 13)
    return _xorshift16(_mul32(h, 0xC2B2AE35))


def _chunk_key(key: Tensor, start: Tensor | int) -> Tensor:
    """The int32 key of the chunk of a tensor of ``key`` (uint32 in int64) that starts at
    element ``start``, with fmix32's first step done (Note [stochastic rounding in int32]): the
    noise of the chunk's ``i``-th element hashes ``i ^`` it."""
    return _as_int32(_xorshift16(key ^ (start & _MASK32)))  # the index's low 32 bits


def _as_int32(u: Tensor) -> Tensor:
    """Int64 tensors holding uint32 as the int32 of the same bits."""
    return torch.where(u >= 1 << 31, u - (1 << 32), u).to(torch.int32)


def _sr_key(seed: Tensor, step: Tensor) -> Tensor:
    return _fmix32(seed ^ _fmix32(step))


def _fmix32_int(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def _to_int32(u: int) -> int:
    return u - (1 << 32) if u >= 1 << 31 else u


#: fmix32's multipliers as int32 (two's complement of the uint32 constants).
_C1, _C2 = _to_int32(0x85EBCA6B), _to_int32(0xC2B2AE35)
#: Elements per chunk of :func:`stochastic_round_` (its buffers are this long): a power of two
#: (Note [stochastic rounding in int32]), as large as a batch of the working copies (a piece of
#: theirs is one chunk: 12 ops, where chunks of 2**16 took 48 and 1.3x the time).
SR_CHUNK = 1 << 18
#: The mean tensor size of a run of unequal sizes from which `_index_xor_keys` takes an op per
#: tensor (about 11 us each on a CPU) rather than two `repeat_interleave` over the run (4 ns an
#: element): they cost the same at about 2600.
_PER_TENSOR_FROM = 4096
#: Indices below it are their own first step of fmix32 (Note [stochastic rounding in int32]).
_UNMIXED = 1 << 16
