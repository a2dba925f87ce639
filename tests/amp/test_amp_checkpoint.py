"""Activation checkpointing recomputes the forward under the policies the forward ran with.

torch.utils.checkpoint restores torch.autocast's state for the recomputation, not
scaledoptim's: ``scaledoptim.amp.checkpoint`` carries the region over, and torch's checkpoint
called inside a scaledoptim region is refused (naming the fix) rather than letting backward
differentiate a different function.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

from scaledoptim import amp

LOW = st.sampled_from([torch.bfloat16, torch.float16])
# Each edit changes what the block computes in a scaledoptim region.
EDITS = st.sampled_from(
    [
        {"aten::mm": "fp32"},
        {"aten::softmax.int": "lower_precision_fp"},
        {"aten::mm": "fp32", "aten::softmax.int": "lower_precision_fp"},
        {"aten::exp": "lower_precision_fp"},
        {"aten::softmax.int": "lower_precision_fp", "aten::exp": "lower_precision_fp"},
    ]
)


class Block(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(8, 8, generator=generator))
        self.w2 = torch.nn.Parameter(torch.randn(8, 8, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Every op sees fp32 inputs where an edit would change its dtype.
        h = torch.softmax(x * 2, dim=-1)  # torch: fp32 (no CPU kernel)
        y = torch.mm(h, self.w1)  # torch: lower precision
        z = torch.exp(y.float() / 8)  # torch: fp32 (no CPU kernel)
        return torch.mm(z, self.w2)


def _set(edits: dict[str, str]) -> None:
    for op, policy in edits.items():
        amp.set_policy(op, policy, "cpu")


def _forward_backward(block: Block, x: torch.Tensor, dtype: torch.dtype, run) -> tuple:
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with amp.autocast("cpu", dtype=dtype):
        out = run(block, x)
    out.float().pow(2).sum().backward()
    return out, x.grad, block.w1.grad, block.w2.grad


def _assert_same(got: tuple, want: tuple) -> None:
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)


@settings(max_examples=20, deadline=None)
@given(edits=EDITS, dtype=LOW, use_reentrant=st.booleans(), seed=st.integers(0, 2**16))
def test_amp_checkpoint_recomputes_under_the_forward_policies(edits, dtype, use_reentrant, seed):
    _set(edits)
    block = Block(seed)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed + 1))
    plain = _forward_backward(block, x, dtype, lambda b, x: b(x))
    checkpointed = _forward_backward(
        block, x, dtype, lambda b, x: amp.checkpoint(b, x, use_reentrant=use_reentrant)
    )
    _assert_same(checkpointed, plain)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_amp_checkpoint_recomputes_with_the_forward_policies_after_an_edit(use_reentrant):
    # The recomputation is part of the forward pass: an edit made between forward and
    # backward applies to the next forward, not to this one's recomputation.
    amp.set_policy("aten::mm", "fp32", "cpu")
    block, x = Block(0), torch.randn(4, 8)
    plain = _forward_backward(block, x, torch.bfloat16, lambda b, x: b(x))
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with amp.autocast("cpu", dtype=torch.bfloat16):
        out = amp.checkpoint(block, x, use_reentrant=use_reentrant)
    amp.set_policy("aten::mm", "lower_precision_fp", "cpu")
    out.float().pow(2).sum().backward()
    _assert_same((out, x.grad, block.w1.grad, block.w2.grad), plain)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_torch_checkpoint_inside_a_region_is_refused_with_the_fix(use_reentrant):
    amp.set_policy("aten::softmax.int", "lower_precision_fp", "cpu")
    block, x = Block(0), torch.randn(4, 8, requires_grad=True)
    refused = pytest.raises(RuntimeError, match=r"scaledoptim\.amp\.checkpoint")
    with amp.autocast("cpu", dtype=torch.bfloat16), refused:
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=use_reentrant)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_torch_checkpoint_of_a_function_that_enters_the_region(use_reentrant):
    # The recomputation enters the region again: nothing to carry over, nothing refused.
    amp.set_policy("aten::softmax.int", "lower_precision_fp", "cpu")
    block, x = Block(0), torch.randn(4, 8)

    def forward(x):
        with amp.autocast("cpu", dtype=torch.bfloat16):
            return block(x)

    def run(use_checkpoint):
        block.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_()
        if use_checkpoint:
            out = torch.utils.checkpoint.checkpoint(forward, leaf, use_reentrant=use_reentrant)
        else:
            out = forward(leaf)
        out.float().pow(2).sum().backward()
        return out, leaf.grad, block.w1.grad, block.w2.grad

    _assert_same(run(True), run(False))


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_torch_checkpoint_without_grad_is_not_refused():
    # No graph is recorded, so there is no recomputation to get wrong.
    amp.set_policy("aten::softmax.int", "lower_precision_fp", "cpu")
    block, x = Block(0), torch.randn(4, 8)
    with amp.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        for use_reentrant in (False, True):
            out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=use_reentrant)
            assert out.dtype == torch.bfloat16


def test_other_saved_tensor_hooks_are_not_mistaken_for_a_checkpoint():
    amp.set_policy("aten::softmax.int", "lower_precision_fp", "cpu")
    block, x = Block(0), torch.randn(4, 8)

    def offloaded(b, x):
        with torch.autograd.graph.save_on_cpu():
            return b(x)

    _assert_same(
        _forward_backward(block, x, torch.bfloat16, offloaded),
        _forward_backward(block, x, torch.bfloat16, lambda b, x: b(x)),
    )


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_nested_amp_checkpoints(use_reentrant):
    _set({"aten::mm": "fp32", "aten::softmax.int": "lower_precision_fp"})
    inner, outer, x = Block(0), Block(1), torch.randn(4, 8)

    def both(x):
        return outer(amp.checkpoint(inner, x, use_reentrant=use_reentrant))

    def run(fn):
        inner.zero_grad(set_to_none=True)
        outer.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_()
        with amp.autocast("cpu", dtype=torch.bfloat16):
            out = fn(leaf)
        out.float().pow(2).sum().backward()
        return out, leaf.grad, inner.w1.grad, outer.w2.grad

    checkpointed = run(lambda x: amp.checkpoint(both, x, use_reentrant=use_reentrant))
    _assert_same(checkpointed, run(both))


def test_a_recomputation_whose_policies_were_dropped_is_refused():
    block, x = Block(0), torch.randn(4, 8, requires_grad=True)
    amp.set_policy("aten::mm", "fp32", "cpu")
    with amp.autocast("cpu", dtype=torch.bfloat16):
        first = amp.checkpoint(block, x, use_reentrant=False)
        for step in range(64):  # 64 more forwards, each under other policies
            policy = "lower_precision_fp" if step % 2 == 0 else "fp32"
            amp.set_policy("aten::mm", policy, "cpu")
            amp.checkpoint(block, x, use_reentrant=False)
    with pytest.raises(RuntimeError, match="no longer kept"):
        first.float().sum().backward()


def _nested(block: Block, x: torch.Tensor, depth: int, use_reentrant: bool) -> torch.Tensor:
    """``depth`` amp.checkpoints, each around an op and the next (the block innermost)."""
    if depth == 0:
        return block(x)

    def level(x: torch.Tensor) -> torch.Tensor:
        return _nested(block, torch.softmax(x, dim=-1) * 4, depth - 1, use_reentrant)

    return amp.checkpoint(level, x, use_reentrant=use_reentrant)


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_nested_amp_checkpoints_recompute_under_their_forwards_policies(depth, use_reentrant):
    # Each level recomputes inside the recomputation of the level around it: with the policies
    # of the forward it recomputes, not those of the backward (edited in between).
    forward_edits = {"aten::softmax.int": "lower_precision_fp", "aten::exp": "lower_precision_fp"}
    block = Block(7)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(8))
    _set(forward_edits)
    plain = _forward_backward(block, x, torch.bfloat16, lambda b, x: _plain_nested(b, x, depth))

    block.zero_grad(set_to_none=True)
    x_in = x.detach().requires_grad_()
    with amp.autocast("cpu", dtype=torch.bfloat16):
        out = _nested(block, x_in, depth, use_reentrant)
    amp.reset_policy()  # backward runs under torch's policies...
    amp.set_policy("aten::mm", "fp32", "cpu")  # ...and another edit
    out.float().pow(2).sum().backward()
    _assert_same((out, x_in.grad, block.w1.grad, block.w2.grad), plain)


def _plain_nested(block: Block, x: torch.Tensor, depth: int) -> torch.Tensor:
    for _ in range(depth):
        x = torch.softmax(x, dim=-1) * 4
    return block(x)
