"""Torch-op helpers every layer shares; this module imports only torch.

* :func:`unscale_in_place_`: ``g *= inv_scale`` with the inf/nan check, on device.
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
    "unscale_in_place_",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_MASK32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------- the skip on device
def unscale_in_place_(grads: Sequence[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """``g *= inv_scale`` for every grad, setting ``found_inf`` on inf/nan (torch's op, grouped
    by dtype as it requires).

    torch checks the grads before multiplying, so 16-bit grads are checked again after: at a
    scale below 1 an unscaled fp16 value can exceed the dtype's range, and that is an overflow.
    A sparse grad is unscaled through its values, as ``torch.amp.GradScaler`` does; a 16-bit one
    is checked again coalesced, since values at one index sum when it is applied. A complex grad
    is unscaled as its real view.
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
    for dtype, same_dtype in by_dtype.items():
        torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found_inf, inv_scale)
        if dtype in _LOW_PRECISION:
            _check_non_finite_(same_dtype, found_inf)
    for grad in sparse_16bit:
        _check_non_finite_([grad.coalesce()._values()], found_inf)


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
    else:
        torch._foreach_add_(steps, 1 if found_inf is None else 1 - found_inf)


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
# form too, so the suite and the doctor can check it without a GPU (`no_host_reads` uses it).
_skips_on_device_only = [False]


def skip_on_host(found_inf: Tensor | None, device: torch.device) -> bool | None:
    """Whether a step on ``device`` is skipped, read on the host where that is free (a CPU,
    outside autograd), else ``None``: decide on device (Note [host skip]). Reads ``found_inf``
    on the host on a CPU only."""
    if device.type != "cpu" or _skips_on_device_only[0] or torch.is_grad_enabled():
        return None
    return found_inf is not None and bool(found_inf.item())


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
    """Inside the block the torch forms skip on device on a CPU too (Note [host skip])."""
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

    The hash runs in int32 (wrapping like the kernels' ``unsigned``; right shifts masked to be
    logical), the keys of all tensors at once, over chunks of at most :data:`SR_CHUNK`
    elements (a run of small tensors concatenated, or a slice of a large one) in buffers
    allocated once per call. So the transient memory is a few chunks whatever the params' size,
    and small tensors cost no op each (issue 22, item 2).
    """
    if not params:
        return
    device = values[0].device
    keys = _sr_key(
        torch.stack(seeds).view(torch.int32).to(torch.int64) & _MASK32,
        (steps.flat if isinstance(steps, PackedSteps) else torch.stack(steps)).to(torch.int64)
        & _MASK32,
    )
    keys = torch.where(keys >= 1 << 31, keys - (1 << 32), keys).to(torch.int32)
    size = min(SR_CHUNK, sum(v.numel() for v in values))
    buffers = _SrBuffers(size, device)
    for run in batches(values, SR_CHUNK):
        if run.stop - run.start == 1 and values[run.start].numel() > SR_CHUNK:
            _round_large_(params[run.start], values[run.start], keys[run.start], buffers)
            continue
        flats = [_flat(v) for v in values[run]]
        sizes = [f.numel() for f in flats]
        total = sum(sizes)
        if not total:
            continue
        bits = torch.cat(flats, out=buffers.values[:total]).view(torch.int32)
        h = buffers.h[:total]
        # Each element's index in its own tensor, xor its tensor's key.
        if all(n == sizes[0] for n in sizes):  # equal sizes (layers of a model): broadcast
            index = buffers.index[: sizes[0]]
            torch.bitwise_xor(index.view(1, -1), keys[run].view(-1, 1), out=h.view(len(sizes), -1))
        else:
            counts = torch.tensor(sizes, device=device)
            starts = torch.cumsum(counts, 0) - counts
            h.copy_(buffers.index[:total])
            h -= torch.repeat_interleave(starts.to(torch.int32), counts, output_size=total)
            h ^= torch.repeat_interleave(keys[run], counts, output_size=total)
        rounded = _round_bits(h, bits, buffers)
        outs = [_flat(p).view(torch.int16) for p in params[run]]
        torch._foreach_copy_(outs, list(rounded.split(sizes)))


class _SrBuffers:
    """The chunk buffers of one :func:`stochastic_round_` call."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.index = torch.arange(size, dtype=torch.int32, device=device)
        self.values = torch.empty(size, dtype=torch.float32, device=device)
        self.h = torch.empty(size, dtype=torch.int32, device=device)
        self.scratch = torch.empty(size, dtype=torch.int32, device=device)
        self.out = torch.empty(size, dtype=torch.int16, device=device)


def _flat(t: Tensor) -> Tensor:
    """:func:`storage_flat`, by a cheaper view for a contiguous tensor."""
    return t.view(-1) if t.is_contiguous() else storage_flat(t)


def _round_large_(param: Tensor, value: Tensor, key: Tensor, buffers: _SrBuffers) -> None:
    """One tensor of more than :data:`SR_CHUNK` elements, a chunk at a time."""
    flat_bits = storage_flat(value).view(torch.int32)
    out = storage_flat(param).view(torch.int16)
    n = flat_bits.numel()
    for start in range(0, n, SR_CHUNK):
        m = min(SR_CHUNK, n - start)
        h = torch.add(buffers.index[:m], _to_int32(start & _MASK32), out=buffers.h[:m])
        h ^= key  # the index's low 32 bits, xor the key
        out[start : start + m].copy_(_round_bits(h, flat_bits[start : start + m], buffers))


def _round_bits(h: Tensor, bits: Tensor, buffers: _SrBuffers) -> Tensor:
    """The bf16 patterns (int16, in ``buffers.out``) of the float32 ``bits`` (int32) rounded
    with the noise of ``h`` (int32, index ^ key; overwritten), as
    ``bfloat16_bits_from_float_sr`` in cuda/dtypes.cuh."""
    scratch = buffers.scratch[: h.numel()]
    _fmix32_int32_(h, scratch)
    h >>= 16
    h &= 0xFFFF  # the noise: 16 uniform bits
    h += bits
    h >>= 16
    h &= 0xFFFF  # (bits + noise) >> 16, the bf16 pattern
    if bits.view(torch.float32).sum().isnan():  # a NaN (or inf - inf): quiet NaNs keep theirs
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        h.copy_(torch.where(nan, ((bits >> 16) & 0xFFFF) | 0x40, h))
    torch.bitwise_and(h, 0x8000, out=scratch)
    scratch <<= 1
    h -= scratch  # into int16's range: the same 16 bits
    return buffers.out[: h.numel()].copy_(h)


def _fmix32_int32_(h: Tensor, scratch: Tensor) -> None:
    """:func:`_fmix32` in place on int32 ``h`` (multiplications wrap as uint32's do)."""
    for shift, multiplier in ((16, _C1), (13, _C2), (16, None)):
        torch.bitwise_right_shift(h, shift, out=scratch)
        scratch &= (1 << (32 - shift)) - 1
        h ^= scratch
        if multiplier is not None:
            h *= multiplier


def storage_flat(t: Tensor) -> Tensor:
    """A dense tensor's elements in storage order, as the kernels walk them."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _mul32(x: Tensor, constant: int) -> Tensor:
    """``x * constant mod 2**32`` for int64 tensors holding uint32, without int64 overflow."""
    lo, hi = constant & 0xFFFF, constant >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _fmix32(h: Tensor) -> Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


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
#: Elements per chunk of :func:`stochastic_round_`: its two int32 buffers are this long.
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
