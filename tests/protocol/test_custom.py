"""Custom optimizers by inheritance, with_scaling, patch_optimizer, and several optimizers sharing
a scale."""

from __future__ import annotations

import pytest
import torch

import scaledoptim
from tests.support.training import loss_of, make_model


class SignSGD(scaledoptim.Optimizer):
    """A custom optimizer with an ordinary step(), written without any thought of scaling."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])
        return loss


def _scaled_backward(model, opt, step, S, overflow=False):
    opt.zero_grad()
    scaledoptim.scale_outputs(loss_of(model, step), S).backward()
    if overflow:
        next(model.parameters()).grad.view(-1)[0] = float("nan")


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda params: SignSGD(params, lr=0.01),
        lambda params: scaledoptim.with_scaling(torch.optim.RMSprop)(params, lr=0.01),
        lambda params: scaledoptim.patch_optimizer(torch.optim.Adagrad(params, lr=0.1)),
        lambda params: scaledoptim.patch_optimizer(torch.optim.AdamW(params, lr=0.01, fused=True)),
    ],
    ids=["subclass", "with_scaling", "patch_optimizer", "patched-torch-fused"],
)
def test_custom_optimizers_get_the_whole_protocol(make_optimizer) -> None:
    model = make_model()
    opt = make_optimizer(model.parameters())
    assert isinstance(opt, scaledoptim.Optimizer)
    opt.configure_scaling(init_scale=2.0**8, growth_interval=2)
    S = opt.scale
    expected_scales = [2.0**8, 2.0**9, 2.0**8, 2.0**8, 2.0**9]
    for step, overflow in enumerate([False, False, True, False, False]):
        _scaled_backward(model, opt, step, S, overflow)
        before = [p.clone() for p in model.parameters()]
        _, found_inf, S = opt.unscale_and_step(grads_scaled_by=S)
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert found_inf.item() == float(overflow) and changed != overflow
        assert S.item() == expected_scales[step]
    _scaled_backward(model, opt, 9, S)
    found_inf, S = opt.unscale(grads_scaled_by=S)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step_after_unscale()


def test_with_scaling_returns_one_class_and_keeps_the_classes_own_methods() -> None:
    class Own(torch.optim.SGD):
        def unscale_and_step(self, closure=None, grads_scaled_by=None):
            return "mine"

    assert scaledoptim.with_scaling(Own) is scaledoptim.with_scaling(Own)
    assert issubclass(scaledoptim.with_scaling(Own), Own)
    opt = scaledoptim.patch_optimizer(Own(make_model().parameters(), lr=0.1))
    assert opt.unscale_and_step() == "mine"
    assert callable(opt.unscale) and callable(opt.step_after_unscale)


def test_patch_optimizer_keeps_params_and_state() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_of(model, 0).backward()
    opt.step()
    buffers = [s["momentum_buffer"] for s in opt.state.values()]
    assert scaledoptim.patch_optimizer(opt) is opt
    assert [s["momentum_buffer"] for s in opt.state.values()] == buffers
    assert isinstance(opt, torch.optim.SGD)


def test_patch_optimizer_rejects_non_optimizers() -> None:
    with pytest.raises(TypeError, match="optimizer instance"):
        scaledoptim.patch_optimizer(object())


def test_shared_scale_moves_once_per_iteration_and_each_optimizer_skips_its_own_overflow() -> None:
    gen, disc = make_model(seed=1), make_model(seed=2)
    opt_g = scaledoptim.AdamW(gen.parameters(), lr=1e-2).configure_scaling(
        init_scale=64.0, growth_interval=2
    )
    opt_d = scaledoptim.SGD(disc.parameters(), lr=0.1)
    S = scaledoptim.share_scale(opt_g, opt_d)
    assert S is opt_g.scale is opt_d.scale and S.item() == 64.0
    scales = []
    for step, overflow_d in enumerate([False, False, True, False]):
        for o in (opt_g, opt_d):
            o.zero_grad()
        scaledoptim.scale_outputs(loss_of(gen, step) + loss_of(disc, step), S).backward()
        if overflow_d:
            disc[0].bias.grad[0] = float("inf")
        before_g = [p.clone() for p in gen.parameters()]
        _, inf_g, S = opt_g.unscale_and_step(grads_scaled_by=S)
        assert S.item() == (scales[-1] if scales else 64.0), (
            "not moved before every optimizer reported"
        )
        _, inf_d, S = opt_d.unscale_and_step(grads_scaled_by=S)
        scales.append(S.item())
        assert inf_g.item() == 0.0 and inf_d.item() == float(overflow_d)
        assert any(not torch.equal(b, p) for b, p in zip(before_g, gen.parameters()))
    assert scales == [64.0, 128.0, 64.0, 64.0]


def test_shared_scale_refuses_a_second_unscale_in_one_round() -> None:
    a, b = make_model(seed=1), make_model(seed=2)
    opt_a, opt_b = scaledoptim.SGD(a.parameters(), lr=0.1), scaledoptim.SGD(b.parameters(), lr=0.1)
    S = scaledoptim.share_scale(opt_a, opt_b)
    _scaled_backward(a, opt_a, 0, S)
    opt_a.unscale_and_step(grads_scaled_by=S)
    _scaled_backward(a, opt_a, 1, S)
    with pytest.raises(RuntimeError, match="once per iteration"):
        opt_a.unscale_and_step(grads_scaled_by=S)
