"""A step never consumes scaled grads as if they were unscaled (GradScaler's habit of a plain
``step()`` after a scaled backward must not step on scaled or overflowed grads).

The GradScaler habit ``scale_outputs(loss, S).backward(); opt.step()``: a plain ``step()``
after a backward scaled by ``opt.scale`` does exactly what ``unscale_and_step(grads_scaled_by=
opt.scale)`` does (unscale, skip on overflow, move the scale). After ``unscale()``, a plain
``step()`` honours ``found_inf`` exactly as ``step_after_unscale()`` does. For fused optimizers
(sync-free) and generic ones (``with_scaling``, a subclass with its own ``step``, a patched
instance).
"""

from __future__ import annotations

import copy

import pytest
import torch

import scaledoptim
from scaledoptim.doctor.sync_free import no_host_reads

pytestmark = pytest.mark.usefixtures("kernel_backend")


class MySGD(scaledoptim.Optimizer):
    """A custom optimizer with an ordinary step() (the seed's "Custom Optimizer Pitfall")."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


MAKERS = {
    "AdamW": lambda params: scaledoptim.AdamW(params, lr=0.01),
    "SGD": lambda params: scaledoptim.SGD(params, lr=0.1, momentum=0.9),
    "with_scaling(RMSprop)": lambda params: scaledoptim.with_scaling(torch.optim.RMSprop)(
        params, lr=0.01
    ),
    "MySGD": lambda params: MySGD(params, lr=0.1),
    "patch_optimizer(Adam)": lambda params: scaledoptim.patch_optimizer(
        torch.optim.Adam(params, lr=0.01)
    ),
}


def _twins(kind: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    return (model, MAKERS[kind](model.parameters())), (twin, MAKERS[kind](twin.parameters()))


def _backward(model, opt, step: int, overflow: bool) -> None:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(8, 4, generator=gen)
    opt.zero_grad()
    scaledoptim.scale_outputs(model(x).square().mean(), opt.scale).backward()
    if overflow:
        model[0].weight.grad[1, 1] = float("inf")


def _assert_same(a, b) -> None:
    (model_a, opt_a), (model_b, opt_b) = a, b
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert opt_a.scale.item() == opt_b.scale.item()
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["loss_scale"]["growth_tracker"].item() == sb["loss_scale"]["growth_tracker"].item()


@pytest.mark.parametrize("kind", list(MAKERS))
def test_a_plain_step_after_a_scaled_backward_unscales_and_skips(kind) -> None:
    plain, protocol = _twins(kind)
    overflows = {1, 2}
    for step in range(5):
        for (model, opt) in (plain, protocol):
            _backward(model, opt, step, step in overflows)
        plain[1].step()  # the GradScaler habit: what does this do with scaled grads?
        protocol[1].unscale_and_step(grads_scaled_by=protocol[1].scale)
        _assert_same(plain, protocol)
    assert plain[1].scale.item() == 2.0**14  # backed off twice, on the two overflows


@pytest.mark.parametrize("kind", list(MAKERS))
def test_a_plain_step_after_unscale_honours_found_inf(kind) -> None:
    plain, protocol = _twins(kind)
    for step in range(4):
        overflow = step == 1
        for (model, opt) in (plain, protocol):
            _backward(model, opt, step, overflow)
            found_inf, _ = opt.unscale(grads_scaled_by=opt.scale)
            assert found_inf.item() == float(overflow)
        plain[1].step()  # what frameworks that only know step() call
        protocol[1].step_after_unscale()
        _assert_same(plain, protocol)


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_the_plain_step_of_a_fused_optimizer_stays_sync_free(kind) -> None:
    (model, opt), _ = _twins(kind)
    for step in range(3):
        _backward(model, opt, step, overflow=step == 1)
        with no_host_reads():
            opt.step()
    assert opt.scale.item() == 2.0**15


def test_a_step_told_the_grads_are_not_scaled_after_a_scaled_backward_is_refused() -> None:
    (model, opt), _ = _twins("AdamW")
    _backward(model, opt, 0, overflow=False)
    grads = [p.grad.clone() for p in model.parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"scaled by opt\.scale"):
        opt.unscale_and_step(grads_scaled_by=None)
    for p, g, q in zip(model.parameters(), grads, params):
        assert torch.equal(p.grad, g) and torch.equal(p, q)
    assert opt.scale.item() == 2.0**16
    opt.step()  # still usable: the plain step unscales
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_unscaled_backward_steps_as_torch_does() -> None:
    """Nothing changes for unscaled training (bf16/fp32, or S = None): the plain step is torch's."""
    (model, opt), (twin, torch_opt) = _twins("AdamW")
    torch_opt = torch.optim.AdamW(twin.parameters(), lr=0.01)
    for step in range(3):
        for m, o in ((model, opt), (twin, torch_opt)):
            o.zero_grad()
            m(
                torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            ).square().mean().backward()
            o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    assert opt.scale.item() == 2.0**16  # never touched
