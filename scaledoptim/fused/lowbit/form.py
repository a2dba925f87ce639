"""The torch form of an update over low-bit states: a batch of whole blocks at a time, each state
decoded into a float32 buffer, the optimizer's own float32 torch form run over the batch, and
the states encoded back (Note [low-bit batches])."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ...torch_ops import Pieces
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
# state's codes and scales are gathered into one buffer, each piece starting at a block
# boundary there and its last block padded with zeros (which never move a block's scale), and
# decoded into one float32 buffer; the optimizer's own torch form (the float32 update, written
# once) runs over the pieces of the params and grads and views of that buffer; then each block's
# new scale is its largest magnitude, the buffer is encoded with the dither of Note [dithered
# rounding] (from each element's index in its tensor and its tensor's step), and the codes and
# scales go back. The kernels compute the same values in registers (cuda/blockwise_quant.cuh).

#: Elements per batch of the low-bit torch form (its float32 buffers: 1 MB each). Measured on a
#: CPU (4M params, one thread): 2**16 cost 1.3x the step time of 2**18 (Python per batch), 2**20
#: 1.8x (out of cache); benchmarks/lowbit_states.py.
LOWBIT_BATCH = 1 << 18


@dataclass(frozen=True)
class LowBitLists:
    """One low-bit state of a group: its codes and scales, per param, and its code."""

    codes: list[Tensor]
    scales: list[Tensor]
    code: Code


class _Run:
    """One batch's layout: per piece, its first block in the buffer and its block count; the
    padding after partial last blocks; and, per block, the dither's term of its elements' index
    (Note [dithered rounding]) and the piece it belongs to."""

    def __init__(self, pieces: Pieces, run: slice, block_size: int, device: torch.device) -> None:
        self.owners = pieces.owners[run]
        sizes, starts = pieces.sizes[run], pieces.starts[run]
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
        self.sizes = sizes
        # Made on the device from Python ints by ops (a copy from the host would sync a GPU).
        self.index_term = torch.cat(
            [
                torch.full((blocks,), constant, dtype=torch.int32, device=device)
                for blocks, constant in zip(self.blocks, constants)
            ]
        )
        self.block_piece = (
            None
            if len(sizes) == 1
            else torch.cat(
                [
                    torch.full((blocks,), i, dtype=torch.int64, device=device)
                    for i, blocks in enumerate(self.blocks)
                ]
            )
        )

    def views(self, buffer: Tensor, like: Sequence[Tensor], block_size: int) -> list[Tensor]:
        """Per piece, the view of ``buffer`` (flat) that holds it, with its shape and strides."""
        base = buffer.storage_offset()
        return [
            buffer.as_strided(piece.shape, piece.stride(), base + at * block_size)
            for piece, at in zip(like, self.offsets)
        ]

    def scale_slices(self, scales: list[Tensor]) -> list[Tensor]:
        """Per piece, its blocks' scales in its tensor's ``scales``."""
        return [
            scales[owner][first : first + blocks]
            for owner, first, blocks in zip(self.owners, self.first_blocks, self.blocks)
        ]


class _Buffers:
    """The float32, code and scale buffers of the largest batch, and the dither's index terms
    of a batch's positions (``DITHER_INDEX`` times the position, modulo ``2**32``)."""

    def __init__(self, blocks: int, block_size: int, states: int, device: torch.device) -> None:
        size = blocks * block_size
        self.values = [
            torch.empty(size, dtype=torch.float32, device=device) for _ in range(states)
        ]
        self.codes = torch.empty(size, dtype=torch.uint8, device=device)
        self.scales = torch.empty(blocks, dtype=torch.float32, device=device)
        positions = torch.arange(size, dtype=torch.int64, device=device)
        self.positions = (positions * DITHER_INDEX & 0xFFFFFFFF).to(torch.int32)
        self.dither = torch.empty(size, dtype=torch.int32, device=device)


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
    device = params[0].device
    limit = max(1, LOWBIT_BATCH // block_size) * block_size
    pieces = Pieces(params, limit)
    param_pieces, grad_pieces = pieces.cut(params), pieces.cut(grads)
    kept = [state for state in states if state is not None]
    code_pieces = [pieces.cut(state.codes) for state in kept]
    runs = [_Run(pieces, run, block_size, device) for run in pieces.runs]
    buffers = _Buffers(max(run.total for run in runs), block_size, len(kept), device)
    for run_slice, run in zip(pieces.runs, runs):
        batch_steps = [steps[owner] for owner in run.owners]
        dither = _dither(run, batch_steps, buffers, block_size)
        values = []
        for state, codes, buffer in zip(kept, code_pieces, buffers.values):
            flat = buffer[: run.total * block_size]
            _gather(run, codes[run_slice], state.scales, buffers, block_size)
            decode_blocks_(
                buffers.codes[: flat.numel()].view(run.total, block_size),
                buffers.scales[: run.total],
                state.code,
                flat.view(run.total, block_size),
            )
            for padding in run.padding:
                flat[padding].zero_()
            values.append(run.views(flat, param_pieces[run_slice], block_size))
        filled = iter(values)
        batch_states = [[] if state is None else next(filled) for state in states]
        form([param_pieces[run_slice], grad_pieces[run_slice], *batch_states, batch_steps])
        for state, codes, buffer in zip(kept, code_pieces, buffers.values):
            flat = buffer[: run.total * block_size].view(run.total, block_size)
            scales = buffers.scales[: run.total]
            encoded = encode_blocks_(flat, state.code, scales, dither)
            torch._foreach_copy_(
                codes[run_slice], run.views(encoded.view(-1), param_pieces[run_slice], block_size)
            )
            torch._foreach_copy_(run.scale_slices(state.scales), _split(scales, run.blocks))


def _gather(
    run: _Run, codes: list[Tensor], scales: list[Tensor], buffers: _Buffers, block_size: int
) -> None:
    """The batch's codes and scales into the buffers (padding codes are left as they are)."""
    flat_codes = buffers.codes[: run.total * block_size]
    torch._foreach_copy_(run.views(flat_codes, codes, block_size), codes)
    torch._foreach_copy_(_split(buffers.scales[: run.total], run.blocks), run.scale_slices(scales))


def _split(flat: Tensor, sizes: list[int]) -> list[Tensor]:
    return list(flat.split(sizes)) if len(sizes) > 1 else [flat]


def _dither(run: _Run, steps: list[Tensor], buffers: _Buffers, block_size: int) -> Tensor:
    """The batch's dither (Note [dithered rounding]), ``(blocks, block_size)`` int32."""
    if run.block_piece is None:
        step = steps[0].to(torch.int32)
    else:
        step = torch.stack(steps).to(torch.int32)[run.block_piece]
    per_block = step * as_int32(DITHER_STEP) + run.index_term
    size = run.total * block_size
    dither = buffers.dither[:size].view(run.total, block_size)
    torch.add(
        buffers.positions[:size].view(run.total, block_size), per_block.view(-1, 1), out=dither
    )
    return dither
