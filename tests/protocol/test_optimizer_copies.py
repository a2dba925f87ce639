"""Every optimizer of optim_db survives ``copy.deepcopy``, ``pickle`` and ``torch.save``/
``torch.load`` of itself with its params: the copy's first step equals the original's, bit for
bit (params, state, scale), on both backends. The step cache and the other lazily made buffers
(LAMB's norm scratch, the master watch) are not copied; the copy makes its own."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import scaledoptim
from scaledoptim.testing.optim_db import OptimInfo, optim_db

pytestmark = pytest.mark.usefixtures("kernel_backend")


def _deepcopy(obj):
    return copy.deepcopy(obj)


def _pickle(obj):
    return pickle.loads(pickle.dumps(obj))


def _torch_save(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"deepcopy": _deepcopy, "pickle": _pickle, "torch.save": _torch_save}


def _params(info: OptimInfo) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    dtypes = info.mixed_param_dtypes if info.fused else (torch.float32,)
    return [
        torch.nn.Parameter(torch.randn(4, 3, generator=gen).to(dtype)) for dtype in dtypes
    ]


def _step(info: OptimInfo, opt, params, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
    if info.needs_closure:
        weights = [g.float() for g in grads]

        def closure(scale):
            opt.zero_grad()
            loss = sum(((p.float() - w) ** 2).sum() for p, w in zip(params, weights))
            scaledoptim.scale_outputs(loss, scale).backward()
            return loss

        opt.unscale_and_step(closure, grads_scaled_by=opt.scale)
        return
    for p, g in zip(params, grads):
        p.grad = g
    opt.unscale_and_step(grads_scaled_by=opt.scale)


def _equal(x, y) -> bool:
    """Bit for bit, through LBFGS's lists of tensors."""
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_equal, x, y))
    return x == y


def _assert_identical(a: tuple, b: tuple) -> None:
    (params_a, opt_a), (params_b, opt_b) = a, b
    for p, q in zip(params_a, params_b):
        assert torch.equal(p, q)
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert _equal(sa[key], sb[key]), key
    assert torch.equal(opt_a.scale, opt_b.scale)


@pytest.mark.parametrize("method", COPIES)
@pytest.mark.parametrize("info", optim_db, ids=str)
def test_the_first_step_of_a_copy_equals_the_originals(info, method) -> None:
    kwargs = {"master_weights": True} if info.rounding else {}
    params = _params(info)
    original = (params, info.make(params, **kwargs))
    for seed in range(2):  # the state exists and (fused) the step plan is kept
        _step(info, original[1], original[0], seed)
    copied = COPIES[method](original)
    assert copied[1] is not original[1]
    for twin in (original, copied):
        _step(info, twin[1], twin[0], seed=7)
    _assert_identical(original, copied)
    for twin in (original, copied):  # and the copy keeps stepping as the original does
        _step(info, twin[1], twin[0], seed=8)
    _assert_identical(original, copied)
