"""scale_outputs, backward and grad with scale_grads_by."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

import scaledoptim


def test_scale_outputs_handles_nested_sequences_and_none() -> None:
    Pair = namedtuple("Pair", "a b")
    t = torch.ones(2)
    out = scaledoptim.scale_outputs([t, (None, Pair(t, {"k": t}))], torch.tensor(4.0))
    assert torch.equal(out[0], 4 * t) and out[1][0] is None
    assert isinstance(out[1][1], Pair) and torch.equal(out[1][1].b["k"], 4 * t)


def test_scale_none_passes_outputs_through() -> None:
    t = torch.ones(2)
    assert scaledoptim.scale_outputs(t, None) is t


@pytest.mark.parametrize("shape", [(), (3,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scaled_output_dtype_and_value_match_gradscaler(shape, dtype) -> None:
    output = torch.full(shape, 3.0, dtype=dtype)
    expected = torch.amp.GradScaler("cpu", init_scale=8.0).scale(output)
    actual = scaledoptim.scale_outputs(output, torch.tensor(8.0))
    assert actual.dtype == expected.dtype and torch.equal(actual, expected)


def test_scale_outputs_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="tensors, None"):
        scaledoptim.scale_outputs([torch.ones(1), 3], 2.0)


def test_backward_and_grad_scale_the_grads() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    scaledoptim.backward((w * w).sum(), scale_grads_by=8.0)
    assert torch.equal(w.grad, 8 * 2 * w.detach())
    w.grad = None
    scaledoptim.backward(w * w, grad_tensors=torch.ones(2), scale_grads_by=torch.tensor(2.0))
    assert torch.equal(w.grad, 2 * 2 * w.detach())
    (g,) = scaledoptim.grad((w * w).sum(), w, create_graph=True, scale_grads_by=4.0)
    assert torch.equal(g.detach(), 4 * 2 * w.detach()) and g.requires_grad
    (g,) = scaledoptim.grad(w * w, w, grad_outputs=torch.ones(2), scale_grads_by=None)
    assert torch.equal(g, 2 * w.detach())
