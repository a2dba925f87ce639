"""A compiled training step runs and matches eager (Note [compile boundary]: the protocol runs
eagerly at a clean boundary; forward and backward are compiled around it)."""

from __future__ import annotations

import pytest
import torch

import scaledoptim

pytestmark = pytest.mark.usefixtures("kernel_backend")

X, Y = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)), torch.randn(32, 1)


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, scaledoptim.AdamW(model.parameters(), lr=1e-2).configure_scaling(
        init_scale=2.0**10, growth_interval=2
    )


def unscale_and_step(model, opt):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(X), Y)
    scaledoptim.scale_outputs(loss, opt.scale).backward()
    _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
    return loss.detach(), found_inf


def split_form_with_clipping(model, opt):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(X), Y)
    scaledoptim.scale_outputs(loss, opt.scale).backward()
    found_inf, _ = opt.unscale(grads_scaled_by=opt.scale)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step_after_unscale()
    return loss.detach(), found_inf


def plain_step(model, opt):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(X), Y)
    loss.backward()
    opt.step()
    return loss.detach(), torch.zeros(())


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize(
    "train_step", [unscale_and_step, split_form_with_clipping, plain_step], ids=lambda f: f.__name__
)
def test_a_compiled_training_step_matches_eager(train_step, backend) -> None:
    torch._dynamo.reset()
    eager_model, eager_opt = _model_and_optimizer()
    model, opt = _model_and_optimizer()
    compiled = torch.compile(train_step, backend=backend)
    for _ in range(4):
        eager_loss, eager_inf = train_step(eager_model, eager_opt)
        loss, found_inf = compiled(model, opt)
        assert found_inf.item() == eager_inf.item() == 0.0
    exact = backend == "eager"  # inductor fuses the forward/backward: last-bit differences
    for a, b in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6)
    grown = 2.0**10 if train_step is plain_step else 2.0**12  # two growths in four clean steps
    assert opt.scale.item() == eager_opt.scale.item() == grown
    assert torch.allclose(loss, eager_loss, rtol=1e-5)


def test_a_compiled_optimizer_step_matches_eager() -> None:
    torch._dynamo.reset()
    eager_model, eager_opt = _model_and_optimizer()
    model, opt = _model_and_optimizer()
    compiled_step = torch.compile(opt.step, backend="eager")
    for _ in range(3):
        for m, o, step in ((eager_model, eager_opt, eager_opt.step), (model, opt, compiled_step)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(X), Y).backward()
            step()
    for a, b in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(a, b)


def test_the_protocol_is_one_clean_graph_break() -> None:
    torch._dynamo.reset()
    model, opt = _model_and_optimizer()
    explanation = torch._dynamo.explain(unscale_and_step)(model, opt)
    # forward + scale_outputs and backward compile; the protocol call is the boundary.
    assert explanation.graph_break_count <= 3, explanation.break_reasons
