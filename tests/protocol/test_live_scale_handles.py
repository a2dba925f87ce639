"""A scale handle the user holds stays live, so a resumed run cannot restart at a stale scale.

``S = opt.scale`` taken once is the scale in use for the optimizer's lifetime: loads and
configuration copy into it. Where it cannot stay (another optimizer's scale after
``share_scale``, a scale moved to another device), passing it is refused with a clear error,
before anything changes; it is never copied over newer state.
"""

from __future__ import annotations

import pytest
import torch

import scaledoptim

pytestmark = pytest.mark.usefixtures("kernel_backend")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _backward(model: torch.nn.Module, S: torch.Tensor, step: int, overflow: bool = False) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaledoptim.scale_outputs(loss, S).backward()
    if overflow:
        model[0].weight.grad[0, 0] = float("inf")


def _train(model, opt, S, steps, start=0, overflow_at=()):
    for step in range(start, start + steps):
        opt.zero_grad()
        _backward(model, S, step, overflow=step in overflow_at)
        _, _, S = opt.unscale_and_step(grads_scaled_by=S)
    return S


def _state(model, opt) -> list[torch.Tensor]:
    scale = opt.scaling_state.loss_scale
    tensors = [p.detach().clone() for p in model.parameters()]
    tensors += [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return [*tensors, scale.scale.clone(), scale.growth_tracker.clone()]


@pytest.mark.parametrize(
    "optimizer", [scaledoptim.AdamW, scaledoptim.with_scaling(torch.optim.SGD)]
)
def test_a_handle_taken_before_load_state_dict_resumes_the_checkpointed_scale(optimizer) -> None:
    """The nanoGPT port: ``S = opt.scale`` before the resume, then the loop; the resumed run must
    continue at the checkpoint's scale (it silently restarted at 65536)."""
    model = _model()
    opt = optimizer(model.parameters(), lr=1e-2)
    _train(model, opt, opt.scale, 5, overflow_at={0, 1})  # 65536 -> 32768 -> 16384
    checkpoint = opt.state_dict()
    saved_scale = checkpoint["loss_scale"]["scale"].item()
    assert saved_scale == 2.0**14

    resumed_model = _model()
    resumed_model.load_state_dict(model.state_dict())
    resumed = optimizer(resumed_model.parameters(), lr=1e-2)
    S = resumed.scale  # the handle, taken before the load (e.g. while building the loop)
    resumed.load_state_dict(checkpoint)
    _train(resumed_model, resumed, S, 2, start=5)
    _train(model, opt, opt.scale, 2, start=5)
    assert resumed.scale.item() == opt.scale.item() == saved_scale
    for a, b in zip(resumed_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert S is resumed.scale


def test_a_handle_stays_live_across_configure_scaling() -> None:
    model = _model()
    opt = scaledoptim.AdamW(model.parameters())
    S = opt.scale
    opt.configure_scaling(init_scale=1024.0, growth_interval=100)
    assert S is opt.scale and S.item() == 1024.0
    _train(model, opt, S, 2)
    assert opt.scale.item() == 1024.0  # not 65536: the old handle did not reset the new config


def test_a_handle_stays_live_across_a_gradscaler_state_load() -> None:
    model = _model()
    opt = scaledoptim.SGD(model.parameters(), lr=0.1)
    S = opt.scale
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=100)
    opt.load_gradscaler_state_dict(scaler.state_dict())
    assert S is opt.scale and S.item() == 512.0
    _train(model, opt, S, 2)
    assert opt.scale.item() == 512.0


def test_a_handle_stays_live_across_a_plain_torch_checkpoint() -> None:
    model = _model()
    opt = scaledoptim.AdamW(model.parameters()).configure_scaling(init_scale=256.0)
    S = opt.scale
    opt.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())  # no "loss_scale"
    assert S is opt.scale and S.item() == 256.0  # reset to the configured init_scale, in place


def test_share_scale_keeps_the_first_handle_and_refuses_the_others() -> None:
    """"One tensor" with two optimizers: the shared scale is the first optimizer's tensor (it
    continues the first's state); the second's old handle no longer names a scale in use and
    is refused, before anything changes, with the fix."""
    model_a, model_b = _model(), _model()
    opt_a = scaledoptim.AdamW(model_a.parameters())
    opt_b = scaledoptim.AdamW(model_b.parameters())
    S_a, S_b = opt_a.scale, opt_b.scale
    S = scaledoptim.share_scale(opt_a, opt_b)
    assert S is S_a is opt_a.scale is opt_b.scale
    opt_b.zero_grad()
    with pytest.raises(RuntimeError, match="share_scale"):
        _backward(model_b, S_b, 0)  # refused at its first use
    _backward(model_b, S_b.item(), 0)
    before = _state(model_b, opt_b)
    with pytest.raises(RuntimeError, match="share_scale"):
        opt_b.unscale_and_step(grads_scaled_by=S_b)
    for a, b in zip(before, _state(model_b, opt_b)):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="share_scale"):
        opt_b.unscale(grads_scaled_by=S_b)
    # The live handle works.
    opt_a.zero_grad()
    _backward(model_a, S, 0)
    for opt in (opt_a, opt_b):
        opt.unscale_and_step(grads_scaled_by=S)
