"""The split form, ``unscale()`` then ``step_after_unscale()``, takes no Python step per grad:
its host cost does not grow with the number of grads (a loop over them added milliseconds a
step at a few thousand params)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch

import scaledoptim

PACKAGE = os.path.dirname(scaledoptim.__file__)


def _calls_into_scaledoptim(run: Callable[[], Any]) -> int:
    count = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal count
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            count += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return count


def _split_step_calls(make: Callable[..., torch.optim.Optimizer], tensors: int) -> tuple[int, int]:
    params = [torch.nn.Parameter(torch.randn(8)) for _ in range(tensors)]
    opt = make(params)

    def backward() -> None:  # grads reallocated, as after zero_grad(set_to_none=True)
        for p in params:
            p.grad = torch.full_like(p, 2.0)

    for _ in range(3):  # past the steps that build state and the step cache
        backward()
        opt.unscale(grads_scaled_by=opt.scale)
        opt.step_after_unscale()
    backward()
    unscale = _calls_into_scaledoptim(lambda: opt.unscale(grads_scaled_by=opt.scale))
    step = _calls_into_scaledoptim(opt.step_after_unscale)
    return unscale, step


@pytest.mark.parametrize(
    "make",
    [
        lambda params: scaledoptim.AdamW(params, lr=1e-3),
        lambda params: scaledoptim.with_scaling(torch.optim.SGD)(params, lr=0.1),
    ],
    ids=["fused", "generic"],
)
def test_split_form_makes_as_many_calls_for_many_grads_as_for_few(make) -> None:
    few, many = _split_step_calls(make, 4), _split_step_calls(make, 40)
    assert many == few, f"(unscale, step_after_unscale) calls: {few} for 4 grads, {many} for 40"
