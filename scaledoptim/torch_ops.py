"""Torch-op helpers every layer shares; this module imports only torch.

* :func:`unscale_in_place_` and :func:`unscale_dense_`: ``g *= inv_scale`` with the inf/nan
  check of the unscaled values, on device.
* :func:`advance_steps_`: step counters advanced unless the step is skipped, on device (one op
  for :class:`PackedSteps`, Note [packed counters]).
* :func:`copy_unless_skipped_`: a copy gated on ``found_inf``, on device.
* :func:`skip_on_host` and :func:`decide_skips_on_device`: a CPU step's skip decided on the host
  (Note [host skip]).
* :func:`elementwise_batches`, :func:`batches`, :func:`split_large` and :func:`scalars`: the
  batches and 0-dim hyper-parameters of the in-place CPU forms.
* :func:`stochastic_round_` and :func:`initial_seed`: the counter-based hash of stochastic
  rounding, the same integer arithmetic as ``so_sr_noise`` in ``cuda/dtypes.cuh`` (Note
  [stochastic rounding]), so both backends round to the same bits.
* :func:`capturing` and :func:`refuse_during_capture`: CUDA-graph capture guards.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "BATCH",
    "PackedSteps",
    "advance_steps_",
    "batches",
    "capturing",
    "copy_unless_skipped_",
    "decide_skips_on_device",
    "elementwise_batches",
    "initial_seed",
    "refuse_during_capture",
    "scalars",
    "skip_on_host",
    "split_large",
    "stochastic_round_",
    "storage_flat",
    "unscale_dense_",
    "unscale_in_place_",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_MASK32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------- the skip on device
def unscale_in_place_(grads: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """``g *= inv_scale`` for every grad, setting ``found_inf`` on inf/nan in what the update
    will read: the unscaled values (torch's op, grouped by dtype as it requires).

    torch's op checks the grads before multiplying, so they are checked again after: at a scale
    below 1 a finite scaled value can unscale to inf (9.5e32 at 2**-20 in float32, far less in
    fp16), and that is an overflow. A sparse grad is unscaled through its values, as
    ``torch.amp.GradScaler`` does; a 16-bit one is checked again coalesced, since values at one
    index sum when it is applied. A complex grad is unscaled as its real view.
    """
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    sparse_16bit: list[Tensor] = []
    for grad in grads:
        if grad.is_sparse:
            if grad.dtype in _LOW_PRECISION and not grad.is_coalesced():
                sparse_16bit.append(grad)
            grad = grad._values()
        if grad.is_complex():
            grad = torch.view_as_real(grad)
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same_dtype in by_dtype.values():
        unscale_dense_(same_dtype, found_inf, inv_scale)
    for grad in sparse_16bit:
        _check_non_finite_([grad.coalesce()._values()], found_inf)


def unscale_dense_(tensors: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """``t *= inv_scale`` for dense real ``tensors`` of one dtype, setting ``found_inf`` on
    inf/nan before or after the multiply (see :func:`unscale_in_place_`)."""
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)
    _check_non_finite_(tensors, found_inf)


def _check_non_finite_(tensors: list[Tensor], found_inf: Tensor) -> None:
    """Sets ``found_inf`` on inf/nan in ``tensors`` (of one dtype), changing none of them."""
    one = torch.ones((), dtype=torch.float32, device=found_inf.device)
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, one)


class PackedSteps(list[Tensor]):
    """A list of step counters that are the elements of one 1-D tensor, :attr:`flat`, in order
    (Note [packed counters]).

    Note [packed counters]
    ~~~~~~~~~~~~~~~~~~~~~~
    Every param of a fused optimizer has a 0-dim float32 ``state["step"]`` (torch's state name;
    the kernels read it, a skipped first step must not count). Advanced with a foreach op over
    2000 0-dim CPU tensors, they cost 3 ms a step, as much as torch's whole fused SGD step over
    2000x1k params (issue 22, item 3): torch's CPU foreach ops loop over the tensors. So the
    full plan (``fused/plan.py``) makes a CPU group's counters views of one tensor, ``flat[i]``,
    and hands the update a ``PackedSteps``, which :func:`advance_steps_` advances with one
    ``add_`` of ``flat``. A list sliced or copied from it is a plain list and takes the foreach
    op: only the plan builds one, and the step cache replans when any state value moves (a
    counter replaced or loaded is new storage), so a ``PackedSteps`` is always exactly
    ``flat.unbind()``. The counters stay separate 0-dim tensors to everyone else (state_dict,
    the kernels' tables, torch.optim's implementations).
    """

    def __init__(self, flat: Tensor) -> None:
        super().__init__(flat.unbind())
        self.flat = flat


def advance_steps_(steps: list[Tensor], found_inf: Tensor | None) -> None:
    """Adds 1 to every step counter, or nothing when ``found_inf`` is set (on device)."""
    if not steps:
        return
    if isinstance(steps, PackedSteps):
        steps.flat.add_(1 if found_inf is None else 1 - found_inf)
    elif found_inf is None:
        torch._foreach_add_(steps, 1)
    else:
        # `alpha=` matches only the Tensor overload: without it Python's argument parser takes
        # the 0-dim tensor as the Scalar overload's number, an .item() (a sync on a GPU).
        torch._foreach_add_(steps, 1 - found_inf, alpha=1)


def copy_unless_skipped_(
    dst: Sequence[Tensor], src: Sequence[Tensor], found_inf: Tensor | None
) -> None:
    """``dst[i] = src[i]``, or nothing when ``found_inf`` is set (on device, no host read)."""
    if found_inf is None:
        torch._foreach_copy_(list(dst), list(src))
        return
    skip = found_inf > 0
    for d, s in zip(dst, src):
        d.copy_(torch.where(skip, d, s))


# Note [host skip]
# ~~~~~~~~~~~~~~~~
# The sync-free contract (found_inf stays on device, a skipped step is a no-op decided there)
# exists for CUDA streams: a host read waits for the GPU. A CPU tensor's value is already there,
# so on a CPU the torch forms read found_inf and skip on the host, and update in place with
# foreach ops (issue 22, item 1); the sync-free form (a `torch.where` + copy per list, every
# intermediate a new full-size tensor) stays for every other device, and for a step autograd
# records (a differentiable step). `decide_skips_on_device()` makes the CPU take the sync-free
# form too, so the suite and the doctor can check it without a GPU (`no_host_reads` uses it),
# and so stochastic rounding's, which on a CPU only reads whether a chunk holds a NaN and makes
# a run's sizes a tensor.
_skips_on_device_only = [False]


def skip_on_host(found_inf: Tensor | None, device: torch.device) -> bool | None:
    """Whether a step on ``device`` is skipped, read on the host where that is free (a CPU,
    outside autograd), else ``None``: decide on device (Note [host skip]). Reads ``found_inf``
    on the host on a CPU only."""
    if not _host_reads_free(device) or torch.is_grad_enabled():
        return None
    return found_inf is not None and bool(found_inf.item())


def _host_reads_free(device: torch.device) -> bool:
    """Whether a torch form may read a tensor on ``device`` on the host: on a CPU, unless
    :func:`decide_skips_on_device` says otherwise (Note [host skip])."""
    return device.type == "cpu" and not _skips_on_device_only[0]


_NUMEL = Tensor.numel
_DTYPE = operator.attrgetter("dtype")

#: Elements per batch of tensors of the in-place CPU forms: their temporaries are this large
#: (1 MB in float32; fresh 4 MB ones are page-faulted in at each allocation: 1.6x the step).
BATCH = 1 << 18


def batches(tensors: Sequence[Tensor], limit: int = BATCH) -> list[slice]:
    """Consecutive runs of ``tensors`` of at most ``limit`` elements (a larger tensor alone)."""
    runs, start, total = [], 0, 0
    for i, size in enumerate(map(_NUMEL, tensors)):  # (map: ~1 ms a step less at 2000 tensors)
        if total and total + size > limit:
            runs.append(slice(start, i))
            start, total = i, 0
        total += size
    runs.append(slice(start, len(tensors)))
    return runs


def scalars(like: Sequence[Tensor], *values: float) -> list[Any]:
    """``values`` as 0-dim tensors of the dtype and device of the tensors ``like`` (Python
    floats when they mix dtypes). torch's CPU foreach ops loop over the tensors and wrap a
    Python scalar into a double tensor and convert it for each (~4 us a tensor: 9 ms a step
    over 2000 tensors); a 0-dim tensor of their dtype is used as it is, with the same value
    (the scalar rounded once to the dtype either way)."""
    dtype = like[0].dtype if like else None
    if dtype is None or not all(map(dtype.__eq__, map(_DTYPE, like))):
        return list(values)
    return [torch.tensor(value, dtype=dtype, device=like[0].device) for value in values]


def split_large(lists: list[list[Tensor]], limit: int = BATCH) -> list[list[Tensor]]:
    """Lists of same-layout tensors (a param, its grad, its state), with each tensor of more
    than ``limit`` elements replaced by views of its storage in pieces of ``limit``: for an
    elementwise update, so that :func:`batches` bounds its temporaries for one large tensor too.
    An empty list (a state the update does not keep) stays empty."""
    if not lists[0] or max(map(_NUMEL, lists[0])) <= limit:
        return lists
    kept = [i for i, column in enumerate(lists) if column]
    out: list[list[Tensor]] = [[] for _ in lists]
    for row in zip(*(lists[i] for i in kept)):
        pieces = (
            [[t] for t in row]
            if row[0].numel() <= limit
            else [list(storage_flat(t).split(limit)) for t in row]
        )
        for i, piece in zip(kept, pieces):
            out[i] += piece
    return out


def elementwise_batches(lists: list[list[Tensor]]) -> Iterator[list[list[Tensor]]]:
    """The lists of an elementwise update (:func:`split_large`'s) in :func:`batches` of about
    ``BATCH`` elements: each batch's slice of every list (an empty list stays empty)."""
    lists = split_large(lists)
    for run in batches(lists[0]):
        yield [column[run] for column in lists]


@contextlib.contextmanager
def decide_skips_on_device() -> Iterator[None]:
    """Inside the block the torch forms take their sync-free forms on a CPU too (Note [host
    skip])."""
    saved = _skips_on_device_only[0]
    _skips_on_device_only[0] = True
    try:
        yield
    finally:
        _skips_on_device_only[0] = saved


# ------------------------------------------------------------------------- stochastic rounding
def initial_seed(index: int) -> Tensor:
    """The stochastic-rounding seed of the ``index``-th param of an optimizer: a fixed mix of
    the index, so runs are reproducible without drawing from (and shifting) torch's global
    generator."""
    return torch.tensor(
        _to_int32(_fmix32_int((index * 0x9E3779B9 + 0x7F4A7C15) & _MASK32)), dtype=torch.int32
    )


def stochastic_round_(
    params: list[Tensor], values: list[Tensor], seeds: list[Tensor], steps: list[Tensor]
) -> None:
    r"""``params[i] = round_stochastic(values[i])`` for bf16 params, on device, as the kernels do.

    ``steps[i]`` is the taken-step count including this step; a value exactly representable in
    bf16 (e.g. an unchanged param of a skipped step) is stored unchanged whatever the noise.

    The hash and the rounding run in int32, the same bits as the kernels' ``unsigned``
    arithmetic (Note [stochastic rounding in int32]), the keys of all tensors at once, over
    chunks of at most :data:`SR_CHUNK` elements (a run of small tensors concatenated, or a
    slice of a large one) in buffers allocated once per call. So the transient memory is a few
    chunks whatever the params' size, and small tensors cost no op each (issue 22, item 2).
    It syncs with no device: only where the tensors are on the host (Note [host skip]) does it
    read one (whether a chunk holds a NaN) or make one from Python values (a run's sizes).
    """
    if not params:
        return
    keys = _sr_key(
        torch.stack(seeds).view(torch.int32).to(torch.int64) & _MASK32,
        (steps.flat if isinstance(steps, PackedSteps) else torch.stack(steps)).to(torch.int64)
        & _MASK32,
    )
    small_keys = _chunk_key(keys, 0)
    buffers = _SrBuffers(min(SR_CHUNK, sum(v.numel() for v in values)), values[0].device)
    for run in batches(values, SR_CHUNK):
        if values[run.start].numel() > SR_CHUNK:  # alone in its run
            _round_large_(params[run.start], values[run.start], keys[run.start], buffers)
        else:
            _round_run_(params[run], values[run], small_keys[run], buffers)


# Note [stochastic rounding in int32]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The kernels round x (float32 bits b, as unsigned) to the bf16 pattern (b + noise) >> 16, with
# noise = fmix32(index ^ key) >> 16, or to the quiet NaN (b >> 16) | 0x40 where x is a NaN
# (cuda/dtypes.cuh). torch has no uint32 arithmetic, so the torch form runs it in int32, whose
# add, xor and multiplication give the same 32 bits as uint32's; a right shift is arithmetic,
# masked where it must be logical. It leaves out every step that cannot change the result:
# * fmix32's last step, h ^= h >> 16, changes only the low 16 bits, which the noise drops.
# * Its first step, h ^= h >> 16 on h = c ^ i, is done on c alone where i < 2**16:
#   (c ^ i) ^ ((c ^ i) >> 16) = (c ^ (c >> 16)) ^ i. A tensor of at most SR_CHUNK elements has
#   indices i < 2**16 (c = key); a chunk of a larger one starts at a multiple of SR_CHUNK, a
#   power of two of at most 2**16, so its element i has the index start ^ i (c = key ^ start).
#   `_chunk_key` mixes c once per tensor or chunk.
# * For a non-NaN x, b + noise (noise in [0, 2**16)) does not overflow int32: b <= 0x7F800000
#   (+inf), or, for a negative x, -2**31 <= b <= -2**23 (-inf), so the sum stays negative. Its
#   arithmetic >> 16 is then the uint32 (b + noise) >> 16 less 2**16 when negative: the bf16
#   pattern as a sign-extended int16, which a copy to int16 keeps as it is (no masking to 16
#   bits and back).
# * A NaN's b + noise can carry out of the mantissa (into inf's pattern, or past it into the
#   sign), so it is replaced before the shift by b | 0x400000, which shifts to (b >> 16) | 0x40.


class _SrBuffers:
    """The chunk buffers of one :func:`stochastic_round_` call, the constants of its hash, and
    whether its tensors are on the host (a CPU, outside :func:`decide_skips_on_device`): there
    reading one, or making one from Python values, costs no sync (Note [host skip]).

    The constants are 0-dim int32 tensors: an op converts a Python int to a tensor of its
    operand's dtype each time, about 1.5 us, a third of the cost of an op over a chunk on a
    CPU.
    """

    def __init__(self, size: int, device: torch.device) -> None:
        self.index = torch.arange(size, dtype=torch.int32, device=device)
        self.values = torch.empty(size, dtype=torch.float32, device=device)
        self.h = torch.empty(size, dtype=torch.int32, device=device)
        self.scratch = torch.empty(size, dtype=torch.int32, device=device)
        self.out = torch.empty(size, dtype=torch.int16, device=device)
        self.c1, self.c2, self.shift13, self.low19, self.shift16, self.low16 = (
            torch.full((), value, dtype=torch.int32, device=device)  # no copy to the device
            for value in (_C1, _C2, 13, 0x7FFFF, 16, 0xFFFF)
        )
        self.on_host = _host_reads_free(device)


def _flat(t: Tensor) -> Tensor:
    """:func:`storage_flat`, by a cheaper view for a contiguous tensor, and none for a 1-D one
    (a view costs about 1 us: 2 ms a step over 2000 tensors)."""
    if not t.is_contiguous():
        return storage_flat(t)
    return t if t.dim() == 1 else t.view(-1)


def _round_run_(
    params: list[Tensor], values: list[Tensor], keys: Tensor, buffers: _SrBuffers
) -> None:
    """A run of tensors of at most :data:`SR_CHUNK` elements in all, as one chunk (``keys``:
    theirs, by :func:`_chunk_key`)."""
    flats = [_flat(v) for v in values]
    sizes = [f.numel() for f in flats]
    total = sum(sizes)
    if not total:
        return
    h = buffers.h[:total]
    _index_xor_keys(h, sizes, keys, buffers)
    if len(flats) == 1:  # nothing to concatenate: rounded from the value into the param
        _round_bits_(h, flats[0].view(torch.int32), buffers)
        _flat(params[0]).view(torch.int16).copy_(h)
        return
    bits = torch.cat(flats, out=buffers.values[:total]).view(torch.int32)
    _round_bits_(h, bits, buffers)
    # One dtype view for the run, none per param: a bf16 copy is a copy of the bits.
    rounded = buffers.out[:total].copy_(h).view(torch.bfloat16)
    torch._foreach_copy_([_flat(p) for p in params], list(rounded.split(sizes)))


def _index_xor_keys(h: Tensor, sizes: list[int], keys: Tensor, buffers: _SrBuffers) -> None:
    """``h`` = each element's index in its tensor (of ``sizes``), xor its tensor's key."""
    index = buffers.index
    if all(n == sizes[0] for n in sizes):  # equal sizes (layers of a model): broadcast
        rows = h.view(len(sizes), -1)
        torch.bitwise_xor(index[: sizes[0]].view(1, -1), keys.view(-1, 1), out=rows)
    elif buffers.on_host:  # from the sizes as a tensor: no op per tensor
        total = h.numel()
        counts = torch.tensor(sizes, device=h.device)
        starts = (torch.cumsum(counts, 0) - counts).to(torch.int32)
        torch.sub(index[:total], torch.repeat_interleave(starts, counts, output_size=total), out=h)
        h ^= torch.repeat_interleave(keys, counts, output_size=total)
    else:  # copying the sizes to the device would sync: views of device tensors, concatenated
        torch.cat([index[:n] for n in sizes], out=h)
        pieces = [key.expand(n) for key, n in zip(keys.unbind(), sizes)]
        h ^= torch.cat(pieces, out=buffers.scratch[: h.numel()])


def _round_large_(param: Tensor, value: Tensor, key: Tensor, buffers: _SrBuffers) -> None:
    """One tensor of more than :data:`SR_CHUNK` elements, a chunk at a time (``key``: its
    own, unmixed, uint32 in int64)."""
    bits = _flat(value).view(torch.int32).split(SR_CHUNK)
    out = _flat(param).view(torch.int16).split(SR_CHUNK)
    starts = torch.arange(0, value.numel(), SR_CHUNK, dtype=torch.int64, device=key.device)
    chunk_keys = _chunk_key(key, starts)
    for chunk_bits, chunk_out, chunk_key in zip(bits, out, chunk_keys.unbind()):
        m = chunk_bits.numel()
        h = torch.bitwise_xor(buffers.index[:m], chunk_key, out=buffers.h[:m])
        _round_bits_(h, chunk_bits, buffers)
        chunk_out.copy_(h)


def _round_bits_(h: Tensor, bits: Tensor, buffers: _SrBuffers) -> None:
    """``h`` (int32, index ^ mixed key) becomes the bf16 patterns, as int16 values, of the
    float32 ``bits`` (int32) rounded with its noise: ``bfloat16_bits_from_float_sr`` of
    cuda/dtypes.cuh (Note [stochastic rounding in int32])."""
    _noise_(h, buffers)
    h += bits
    _quiet_nans_(h, bits, buffers.on_host)
    h >>= buffers.shift16


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


def storage_flat(t: Tensor) -> Tensor:
    """A dense tensor's elements in storage order, as the kernels walk them."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


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
#: of at most 2**16, so the indices of a chunk share their high 16 bits (Note [stochastic
#: rounding in int32]).
SR_CHUNK = 1 << 16


# --------------------------------------------------------------------------- CUDA-graph capture
def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def refuse_during_capture(what: str) -> None:
    """Raises if a CUDA graph is being captured: ``what`` would be recorded once and replayed
    wrong, or would sync."""
    if capturing():
        raise RuntimeError(
            f"{what} cannot happen inside CUDA graph capture. Take one eager step first (it "
            "creates the optimizer state and compiles the kernels), pass opt.scale (or a Python "
            "float) as the scale, then capture."
        )
