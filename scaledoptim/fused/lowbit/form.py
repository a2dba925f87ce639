"""The torch form of an update over low-bit states: a batch of whole blocks at a time, each state
decoded into a float32 buffer, the optimizer's own float32 torch form run over the batch, and
the states encoded back (Note [low-bit batches])."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ...torch_ops import Pieces, storage_flat
from ..update import TensorLists
from .blockwise import block_count, decode_blocks_, encode_blocks_
from .codes import DITHER_INDEX, DITHER_STEP, Code, as_int32

__all__ = ["LOWBIT_BATCH", "LowBitLists", "lowbit_form_"]

# Note [low-bit batches]
# ~~~~~~~~~~~~~~~~~~~~~~
# The low-bit states' torch form never holds a whole float32 copy of a state: the group's params
# are cut into pieces of at most LOWBIT_BATCH elements at block boundaries (``Pieces``: a larger
# tensor into views of its storage whose starts are multiples of the batch, itself a multiple
# of the block size) and grouped into batches of about LOWBIT_BATCH elements. Per batch, each
# state is decoded into one float32 buffer, each piece starting at a block boundary there and
# its last block padded with zeros (which never move a block's scale): from the state's own
# codes and scales when the batch is one piece of whole blocks, else from one buffer its codes
# and scales are gathered into. The optimizer's own torch form (the float32 update, written
# once) runs over the pieces of the params and grads and views of that buffer; then each block's
# new scale is its largest magnitude, the buffer is encoded with the dither of Note [dithered
# rounding] (from each element's index in its tensor and its tensor's step), and the codes and
# scales go back. The decode and the encode are integer arithmetic on the float32 bits, in
# place (Code.decode_, Code.encode_), on buffers made once per step; a batch's layout (its
# pieces' blocks and the dither's per-block terms) is made once per group layout. The kernels
# compute the same values in registers (cuda/blockwise_quant.cuh).

#: Elements per batch of the low-bit torch form (its float32 buffers: 1 MB each). Measured on a
#: CPU (4M params, one thread): benchmarks/lowbit_states.py.
LOWBIT_BATCH = 1 << 18


@dataclass(frozen=True)
class LowBitLists:
    """One low-bit state of a group: its codes and scales, per param, and its code."""

    codes: list[Tensor]
    scales: list[Tensor]
    code: Code


class _Layout:
    """One batch's layout: per piece, its first block in the buffer and its block count; the
    padding after partial last blocks; and, per block, the dither's term of its elements'
    index (Note [dithered rounding]) and the tensor it belongs to."""

    def __init__(
        self,
        sizes: Sequence[int],
        starts: Sequence[int],
        owners: Sequence[int],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.blocks = [block_count(size, block_size) for size in sizes]
        self.first_blocks = [start // block_size for start in starts]
        self.offsets: list[int] = []
        self.padding: list[slice] = []
        constants, at = [], 0
        for size, start, blocks in zip(sizes, starts, self.blocks):
            self.offsets.append(at)
            if size % block_size:
                self.padding.append(slice(at * block_size + size, (at + blocks) * block_size))
            # Element k of the buffer is element k - at * block_size + start of its tensor.
            constants.append(as_int32((start - at * block_size) * DITHER_INDEX))
            at += blocks
        self.total = at
        #: One piece of whole blocks: decoded from and encoded into its state directly.
        self.direct = len(sizes) == 1 and not self.padding
        self.index_constant = constants[0]
        # Per block, for a batch of several pieces (and tensors): made on the device from
        # Python ints by ops (a copy from the host would sync a GPU).
        self.index_term: Tensor | None = None
        self.block_owner: Tensor | None = None
        if len(sizes) > 1:
            self.index_term = torch.cat(
                [
                    torch.full((blocks,), constant, dtype=torch.int32, device=device)
                    for blocks, constant in zip(self.blocks, constants)
                ]
            )
            self.block_owner = torch.cat(
                [
                    torch.full((blocks,), owner, dtype=torch.int64, device=device)
                    for blocks, owner in zip(self.blocks, owners)
                ]
            )

    def views(self, buffer: Tensor, like: Sequence[Tensor], block_size: int) -> list[Tensor]:
        """Per piece, the view of ``buffer`` (flat) that holds it, with its shape and strides."""
        base = buffer.storage_offset()
        return [
            buffer.as_strided(piece.shape, piece.stride(), base + at * block_size)
            for piece, at in zip(like, self.offsets)
        ]

    def scale_slices(self, scales: list[Tensor], owners: Sequence[int]) -> list[Tensor]:
        """Per piece, its blocks' scales in its tensor's ``scales``."""
        return [
            scales[owner][first : first + blocks]
            for owner, first, blocks in zip(owners, self.first_blocks, self.blocks)
        ]


@functools.lru_cache(maxsize=32)
def _layouts(
    sizes: tuple[int, ...], block_size: int, limit: int, device: torch.device
) -> tuple[Pieces, list[_Layout], int]:
    """The pieces of params of ``sizes``, each batch's layout, and the most blocks of one."""
    pieces = Pieces([torch.empty(size, device="meta") for size in sizes], limit)
    layouts = [
        _Layout(pieces.sizes[run], pieces.starts[run], pieces.owners[run], block_size, device)
        for run in pieces.runs
    ]
    return pieces, layouts, max(layout.total for layout in layouts)


class _Buffers:
    """Per state, a float32 batch buffer and a code and a scale buffer for gathered batches;
    an int32 scratch buffer, the dither, and per code its rounding terms; and the dither's
    index terms of a batch's positions (:func:`_positions`)."""

    def __init__(
        self, blocks: int, block_size: int, codes: Sequence[Code], device: torch.device
    ) -> None:
        size, states = blocks * block_size, len(codes)
        self.values = torch.empty(states, size, dtype=torch.float32, device=device)
        self.codes = torch.empty(states, size, dtype=torch.uint8, device=device)
        self.scales = torch.empty(states, blocks, dtype=torch.float32, device=device)
        self.scratch = torch.empty(size, dtype=torch.int32, device=device)
        self.dither = torch.empty(size, dtype=torch.int32, device=device)
        # The last code's rounding terms overwrite the dither (computed last).
        distinct = list(dict.fromkeys(codes))
        self.terms = {
            code: torch.empty(size, dtype=torch.int32, device=device) for code in distinct[:-1]
        }
        self.terms[distinct[-1]] = self.dither
        self.positions = _positions(size, device)


@functools.lru_cache(maxsize=8)
def _positions(size: int, device: torch.device) -> Tensor:
    """The dither's index terms of a batch's positions: ``DITHER_INDEX`` times the position,
    modulo ``2**32``, as int32 (Note [dithered rounding])."""
    positions = torch.arange(size, dtype=torch.int64, device=device)
    return (positions * DITHER_INDEX & 0xFFFFFFFF).to(torch.int32)


def lowbit_form_(
    form: Callable[[TensorLists], None],
    lists: TensorLists,
    states: Sequence[LowBitLists | None],
    block_size: int,
) -> None:
    """``form`` over float32 states decoded from low-bit ones, the states then encoded back
    (Note [low-bit batches]).

    Args:
        form: the optimizer's float32 torch form in place, over ``[params, grads, *states,
            steps]`` (a state the options turn off as an empty list; a batch's steps one per
            piece, its tensor's counter).
        lists: ``[params, grads, ..., steps]``: float32 params (or working copies) and unscaled
            grads, dense, and the step counters already counting this step.
        states: per state of ``form``, its low-bit lists, or ``None`` for one turned off.
        block_size: elements per block.
    """
    params, grads, steps = lists[0], lists[1], lists[-1]
    if not params:
        return
    kept = [state for state in states if state is not None]
    if not kept:  # (e.g. SGD without momentum): the float32 form, on no state
        form([params, grads, *([] for _ in states), steps])
        return
    device = params[0].device
    limit = max(1, LOWBIT_BATCH // block_size) * block_size
    pieces, layouts, most = _layouts(tuple(p.numel() for p in params), block_size, limit, device)
    param_pieces, grad_pieces = pieces.cut(params), pieces.cut(grads)
    code_pieces = [pieces.cut(state.codes) for state in kept]
    buffers = _Buffers(most, block_size, [state.code for state in kept], device)
    # The dither's step term of each tensor (Note [dithered rounding]).
    step_terms = torch.stack(steps).to(torch.int32).mul_(as_int32(DITHER_STEP))
    for run, batch in zip(pieces.runs, layouts):
        owners = pieces.owners[run]
        size = batch.total * block_size
        values, codes, scales = _sources(batch, run, kept, code_pieces, owners, buffers, size)
        for state, flat, code_source, scale_source in zip(kept, values, codes, scales):
            decode_blocks_(
                code_source.view(batch.total, block_size),
                scale_source,
                state.code,
                flat.view(batch.total, block_size),
                buffers.scratch[:size],
            )
        if batch.padding:
            torch._foreach_zero_([flat[padding] for flat in values for padding in batch.padding])
        filled = iter([batch.views(flat, param_pieces[run], block_size) for flat in values])
        batch_states = [[] if state is None else next(filled) for state in states]
        form([param_pieces[run], grad_pieces[run], *batch_states, [steps[o] for o in owners]])
        dither = _dither(batch, step_terms, owners, buffers, size, block_size)
        for code, terms in buffers.terms.items():  # (the last in place: Buffers.terms)
            code.rounding_terms_(dither, terms[:size])
        for state, flat, code_source, scale_source in zip(kept, values, codes, scales):
            encode_blocks_(
                flat.view(batch.total, block_size),
                state.code,
                scale_source,
                code_source.view(batch.total, block_size),
                buffers.terms[state.code][:size].view(batch.total, block_size),
                buffers.scratch[:size],
            )
        if not batch.direct:
            _scatter(batch, run, kept, code_pieces, param_pieces, owners, buffers, size, block_size)


def _sources(
    batch: _Layout,
    run: slice,
    kept: list[LowBitLists],
    code_pieces: list[list[Tensor]],
    owners: list[int],
    buffers: _Buffers,
    size: int,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Per state, the batch's float32 buffer (flat), and the codes (flat) and scales it decodes
    from and encodes into: the state's own, or buffers the batch's codes and scales are gathered
    into (padding codes are left as they are)."""
    values = [buffers.values[i, :size] for i in range(len(kept))]
    if batch.direct:
        codes = [storage_flat(pieces[run][0]) for pieces in code_pieces]
        scales = [batch.scale_slices(state.scales, owners)[0] for state in kept]
        return values, codes, scales
    codes = [buffers.codes[i, :size] for i in range(len(kept))]
    scales = [buffers.scales[i, : batch.total] for i in range(len(kept))]
    block_size = size // batch.total
    torch._foreach_copy_(
        [view for flat, pieces in zip(codes, code_pieces)
         for view in batch.views(flat, pieces[run], block_size)],
        [piece for pieces in code_pieces for piece in pieces[run]],
    )
    torch._foreach_copy_(
        [part for flat in scales for part in _split(flat, batch.blocks)],
        [part for state in kept for part in batch.scale_slices(state.scales, owners)],
    )
    return values, codes, scales


def _scatter(
    batch: _Layout,
    run: slice,
    kept: list[LowBitLists],
    code_pieces: list[list[Tensor]],
    param_pieces: list[Tensor],
    owners: list[int],
    buffers: _Buffers,
    size: int,
    block_size: int,
) -> None:
    """The gathered batch's codes and scales back into their states."""
    torch._foreach_copy_(
        [piece for pieces in code_pieces for piece in pieces[run]],
        [view for i in range(len(kept))
         for view in batch.views(buffers.codes[i, :size], param_pieces[run], block_size)],
    )
    torch._foreach_copy_(
        [part for state in kept for part in batch.scale_slices(state.scales, owners)],
        [part for i in range(len(kept))
         for part in _split(buffers.scales[i, : batch.total], batch.blocks)],
    )


def _split(flat: Tensor, sizes: list[int]) -> list[Tensor]:
    return list(flat.split(sizes)) if len(sizes) > 1 else [flat]


def _dither(
    batch: _Layout,
    step_terms: Tensor,
    owners: list[int],
    buffers: _Buffers,
    size: int,
    block_size: int,
) -> Tensor:
    """The batch's dither (Note [dithered rounding]), flat int32."""
    dither = buffers.dither[:size]
    if batch.block_owner is None or batch.index_term is None:  # one piece: one term
        term = step_terms[owners[0]] + batch.index_constant
        return torch.add(buffers.positions[:size], term, out=dither)
    per_block = step_terms[batch.block_owner].add_(batch.index_term)
    torch.add(
        buffers.positions[:size].view(batch.total, block_size),
        per_block.view(-1, 1),
        out=dither.view(batch.total, block_size),
    )
    return dither
