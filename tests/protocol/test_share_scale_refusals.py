"""``share_scale`` refuses what it cannot share correctly, at share time, so that a mistake fails
once, where it is made.

``share_scale(a, a)`` and ``share_scale(b, c)`` after ``share_scale(a, b)`` were accepted; the
second iteration then failed forever with a misleading "already unscaled" error. They are
refused when called, naming the fix, and change nothing; calling ``share_scale`` again with the
same optimizers is a no-op that returns the same scale.
"""

from __future__ import annotations

import pytest
import torch

import scaledoptim


def _optimizer(seed: int) -> scaledoptim.AdamW:
    torch.manual_seed(seed)
    return scaledoptim.AdamW(torch.nn.Linear(3, 2).parameters())


def _iteration(*opts: scaledoptim.Optimizer) -> None:
    for opt in opts:
        opt.zero_grad()
        for group in opt.param_groups:
            for p in group["params"]:
                scaledoptim.scale_outputs(p.sum(), opt.scale).backward()
    for opt in opts:
        opt.unscale_and_step(grads_scaled_by=opt.scale)


def test_the_same_optimizer_twice_is_refused() -> None:
    a, b = _optimizer(0), _optimizer(1)
    scale = a.scale
    with pytest.raises(ValueError, match="more than once"):
        scaledoptim.share_scale(a, a)
    with pytest.raises(ValueError, match="more than once"):
        scaledoptim.share_scale(a, b, a)
    assert a.scale is scale and a.scaling_state.loss_scale.sharers == 1
    for _ in range(2):
        _iteration(a)  # a still has a scale of its own


def test_an_optimizer_that_already_shares_is_refused() -> None:
    a, b, c = _optimizer(0), _optimizer(1), _optimizer(2)
    S = scaledoptim.share_scale(a, b)
    c_scale = c.scale
    with pytest.raises(RuntimeError, match="already shares"):
        scaledoptim.share_scale(b, c)
    with pytest.raises(RuntimeError, match="already shares"):
        scaledoptim.share_scale(c, a)
    assert a.scale is b.scale is S and c.scale is c_scale
    for _ in range(3):  # both groups keep working, iteration after iteration
        _iteration(a, b)
        _iteration(c)


def test_sharing_again_with_the_same_optimizers_is_a_no_op() -> None:
    a, b = _optimizer(0), _optimizer(1)
    S = scaledoptim.share_scale(a, b)
    assert scaledoptim.share_scale(b, a) is S
    for _ in range(2):
        _iteration(a, b)
