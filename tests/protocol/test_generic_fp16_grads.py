"""An optimizer whose own ``step()`` reads the grads (``with_scaling(X)``, a patched instance, a
generic subclass) would unscale scaled fp16 grads in place, in fp16, where a small true grad
flushes to zero unnoticed: it refuses them as torch.amp.GradScaler does ("Attempting to unscale
FP16 gradients"), through every entry point, before anything changes, naming what works (a fused
class, ``master_weights=True``). Unscaled grads (``grads_scaled_by=None``) and bf16 grads step."""

from __future__ import annotations

import pytest
import torch

import scaledoptim
from tests.support.training import assert_bit_identical, snapshot

MAKERS = {
    "with_scaling(SGD)": lambda p: scaledoptim.with_scaling(torch.optim.SGD)(p, lr=0.1),
    "with_scaling(Adam, fused)": lambda p: scaledoptim.with_scaling(torch.optim.Adam)(
        p, lr=0.1, fused=True
    ),
    "patched Adamax": lambda p: scaledoptim.patch_optimizer(torch.optim.Adamax(p, lr=0.1)),
    "LBFGS": lambda p: scaledoptim.LBFGS(p, lr=0.1),
}
SMALL = 2.0**-20  # a true grad fp16 unscaled in place would keep only to 1 significant bit


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=generator).to(dtype))]


def _backward(opt, params, scale, size: float = SMALL) -> torch.Tensor:
    opt.zero_grad()
    loss = (params[0].float() * size).sum()
    scaledoptim.scale_outputs(loss, scale).backward()
    return loss


def _grads(opt) -> list[torch.Tensor]:
    return [p.grad.clone() for g in opt.param_groups for p in g["params"]]


def _entry_points(opt, params):
    """(name, call) of every way to take a scaled step."""

    def closure(scale):
        return _backward(opt, params, scale)

    yield "unscale_and_step(closure)", lambda: opt.unscale_and_step(
        closure, grads_scaled_by=opt.scale
    )
    if isinstance(opt, torch.optim.LBFGS):
        return
    yield "unscale_and_step", lambda: opt.unscale_and_step(grads_scaled_by=opt.scale)
    yield "unscale", lambda: opt.unscale(grads_scaled_by=opt.scale)
    yield "step() after a scaled backward", opt.step
    for method in ("step", "unscale_"):
        scaler = scaledoptim.GradScaler("cpu")
        scaler.scale(torch.ones(()))
        yield f"GradScaler.{method}", lambda s=scaler, m=method: getattr(s, m)(opt)


@pytest.mark.parametrize("name", list(MAKERS))
def test_scaled_fp16_grads_are_refused_by_every_entry_point_changing_nothing(name) -> None:
    params = _params(torch.float16)
    opt = MAKERS[name](params)
    for entry, call in _entry_points(opt, params):
        _backward(opt, params, opt.scale)
        before, grads = snapshot(opt), _grads(opt)
        with pytest.raises(ValueError, match="unscaled in place in fp16") as raised:
            call()
        message = str(raised.value)
        assert "master_weights=True" in message and "scaledoptim.Adam, AdamW" in message, entry
        assert_bit_identical(before, snapshot(opt))
        assert_bit_identical(grads, _grads(opt))


def test_torch_gradscaler_refuses_the_same_grads() -> None:
    params = _params(torch.float16)
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale((params[0].float() * SMALL).sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.step(opt)


@pytest.mark.usefixtures("kernel_backend")
def test_the_fused_class_named_steps_them_with_the_true_grad() -> None:
    params = _params(torch.float16)
    opt = scaledoptim.SGD(params, lr=1.0, master_weights=True)
    before = opt.state_dict()  # no state yet
    start = params[0].detach().float().clone()
    _backward(opt, params, opt.scale)
    _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert found_inf.item() == 0.0 and before["state"] == {}
    master = opt.state[params[0]]["master_param"]
    torch.testing.assert_close(master, start - SMALL, rtol=0, atol=0)


@pytest.mark.parametrize("dtype, scaled", [(torch.float16, False), (torch.bfloat16, True)])
def test_unscaled_fp16_and_scaled_bf16_grads_step(dtype, scaled) -> None:
    params = _params(dtype)
    opt = MAKERS["with_scaling(SGD)"](params)
    start = params[0].detach().clone()
    _backward(opt, params, opt.scale if scaled else None, size=1.0)
    opt.unscale_and_step(grads_scaled_by=opt.scale if scaled else None)
    torch.testing.assert_close(params[0].detach(), start - 0.1, rtol=0, atol=1e-2)
