"""A compiled training step whose function first touches ``opt.scale`` backs the scale off.

The README's loop shape, compiled: ``S = opt.scale`` inside the compiled function creates the
optimizer's scale during tracing. found_inf was right but the scale never backed off (65536
where eager ends at 32768): the scale the protocol moved was not the one the next call read.
The scale is now created eagerly, outside any trace, and the compiled run matches eager.
"""

from __future__ import annotations

import pytest
import torch

import scaledoptim

pytestmark = pytest.mark.usefixtures("kernel_backend")

X, Y = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), torch.randn(16, 1)
OVERFLOW = 1e38  # the loss times this overflows float32 in backward


def _model_and_optimizer(optimizer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, optimizer(model.parameters())


def readme_step(model, opt, blow_up):
    S = opt.scale  # first touched here, inside the compiled function
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(X), Y) * blow_up
    scaledoptim.scale_outputs(loss, S).backward()
    _, found_inf, S = opt.unscale_and_step(grads_scaled_by=S)
    return found_inf


def split_step(model, opt, blow_up):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(X), Y) * blow_up
    scaledoptim.scale_outputs(loss, opt.scale).backward()
    found_inf, _ = opt.unscale(grads_scaled_by=opt.scale)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step_after_unscale()
    return found_inf


OPTIMIZERS = {
    "AdamW": lambda params: scaledoptim.AdamW(params, lr=1e-2),
    "with_scaling(SGD)": lambda params: scaledoptim.with_scaling(torch.optim.SGD)(params, lr=1e-2),
}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("train_step", [readme_step, split_step], ids=lambda f: f.__name__)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_scale_first_touched_inside_torch_compile_backs_off_as_in_eager(
    optimizer, train_step, backend
) -> None:
    torch._dynamo.reset()
    eager_model, eager_opt = _model_and_optimizer(OPTIMIZERS[optimizer])
    model, opt = _model_and_optimizer(OPTIMIZERS[optimizer])
    compiled = torch.compile(train_step, backend=backend)
    for step in range(4):
        blow_up = torch.tensor(OVERFLOW if step == 1 else 1.0)
        eager_inf = train_step(eager_model, eager_opt, blow_up)
        found_inf = compiled(model, opt, blow_up)
        assert found_inf.item() == eager_inf.item() == float(step == 1)
        assert opt.scale.item() == eager_opt.scale.item(), step
    assert opt.scale.item() == 2.0**15
    for a, b in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
