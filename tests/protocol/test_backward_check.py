"""configure_scaling(check_during_backward=True): the same skips and steps as the plain form,
with the grads checked as backward produces them (Note [overlapped overflow check])."""

from __future__ import annotations

import random

import pytest
import torch

import scaledoptim
from scaledoptim.kernels import launcher
from scaledoptim.testing.optim_db import row
from tests.support.training import make_model

# Rows of optim_db by name: the check during backward does not branch on the update.
ADAMW = (row("AdamW"), row("AdamW").default)
SGD_MOMENTUM = (row("SGD"), row("SGD").config("momentum-wd"))


def _twins(case):
    info, config = case
    plain, checked = make_model(), make_model()
    plain_opt = info.make(plain.parameters(), config).configure_scaling(
        init_scale=2.0**8, growth_interval=3
    )
    checked_opt = info.make(checked.parameters(), config).configure_scaling(
        init_scale=2.0**8, growth_interval=3, check_during_backward=True
    )
    return (plain, plain_opt), (checked, checked_opt)


def _backward(model, opt, step: int, poison: str | None) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)
    weight = torch.ones(16, 3)
    if poison == "in backward":  # the backward itself produces inf/nan grads
        weight[3, 1] = float("inf")
    loss = (torch.nn.functional.mse_loss(model(x), y, reduction="none") * weight).mean()
    scaledoptim.scale_outputs(loss, opt.scale).backward()
    if poison == "after backward":  # in place: the grad's version moves on
        model[0].weight.grad[0, 0] = float("nan")
    if poison == "replaced after backward":  # a new grad object
        model[2].bias.grad = torch.full_like(model[2].bias, float("inf"))


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize(
    "case", [ADAMW, SGD_MOMENTUM], ids=lambda case: f"{case[0].name}-{case[1].name}"
)
def test_skips_and_params_equal_the_plain_form_under_random_overflows(case) -> None:
    """Slow (24 steps per row). Exists for a grad poisoned during or after backward (or
    replaced after it) that the check during backward misses or reports twice: the skips and
    params must be the plain form's."""
    rng = random.Random(0)
    twins = _twins(case)
    for step in range(24):
        poison = rng.choice(
            [None, None, "in backward", "after backward", "replaced after backward"]
        )
        accumulate = rng.random() < 0.3
        found = []
        for model, opt in twins:
            opt.zero_grad()
            _backward(model, opt, step, poison if not accumulate else None)
            if accumulate:  # a second micro-batch, scaled by the same S
                _backward(model, opt, 1000 + step, poison)
            _, found_inf, S = opt.unscale_and_step(grads_scaled_by=opt.scale)
            found.append((found_inf.item(), S.item()))
        assert found[0] == found[1], (step, poison, accumulate)
        assert found[0][0] == float(poison is not None)
    for a, b in zip(twins[0][0].parameters(), twins[1][0].parameters()):
        assert torch.equal(a, b)


def test_the_step_checks_only_what_backward_did_not(monkeypatch) -> None:
    """On the kernel backend (torch's ops unscale, and so check, every grad in place anyway)."""
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "emulate")
    (_, _), (model, opt) = _twins(ADAMW)
    checked_in_step = []
    run = launcher.PreparedLaunch.run

    def recording(self, *args, **kwargs):
        if self.kernel.name == "non_finite_check_kernel":
            checked_in_step.append(sum(planned.n_chunks for _, planned in self.plans))
        return run(self, *args, **kwargs)

    _backward(model, opt, 0, None)
    monkeypatch.setattr(launcher.PreparedLaunch, "run", recording)
    opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert checked_in_step == []  # every grad was folded in during backward
    opt.zero_grad()
    _backward(model, opt, 1, "replaced after backward")
    monkeypatch.setattr(launcher.PreparedLaunch, "run", run)
    _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert found_inf.item() == 1.0
