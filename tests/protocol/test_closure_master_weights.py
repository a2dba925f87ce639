"""The closure form on fp16 params with ``master_weights=True``: each evaluation is checked as a
step without a closure checks it (the update unscales in fp32), so it steps as that step does,
replaying on overflow, instead of failing on ``unscale()``'s fp16 refusal."""

from __future__ import annotations

import pytest
import torch

import scaledoptim
from tests.support.training import assert_bit_identical, snapshot

pytestmark = pytest.mark.usefixtures("kernel_backend")

CLASSES = [scaledoptim.AdamW, scaledoptim.SGD, scaledoptim.Lion]


def _fp16_model() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    return torch.nn.Linear(8, 2).half(), x, y


def _backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, S, inf: bool):
    loss = torch.nn.functional.mse_loss(model(x.half()).float(), y)
    scaledoptim.scale_outputs(loss, S).backward()
    if inf:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    return loss


@pytest.mark.parametrize("clip", [None, 0.1], ids=["no-clip", "clip"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_closure_steps_fp16_params_with_masters_as_the_step_without_one(cls, clip) -> None:
    (model, x, y), (twin, _, _) = _fp16_model(), _fp16_model()
    opt = cls(model.parameters(), lr=1e-2, master_weights=True)
    ref = cls(twin.parameters(), lr=1e-2, master_weights=True)
    for step in range(4):
        overflow = step == 1  # the first evaluation overflows: replayed at half the scale
        evaluations: list[float] = []

        def closure(S, overflow=overflow, evaluations=evaluations):
            opt.zero_grad()
            loss = _backward(model, x, y, S, overflow and not evaluations)
            evaluations.append(float(S))
            return loss

        loss, found_inf, S = opt.unscale_and_step(
            closure, grads_scaled_by=opt.scale, max_grad_norm=clip
        )
        assert found_inf.item() == 0.0 and loss.isfinite()
        # The twin takes the same evaluations without a closure: the overflowed one is skipped.
        for i, scale in enumerate(evaluations):
            ref.zero_grad()
            _backward(twin, x, y, ref.scale, overflow and i == 0)
            assert ref.scale.item() == scale
            ref.unscale_and_step(grads_scaled_by=ref.scale, max_grad_norm=clip)
        assert len(evaluations) == (2 if overflow else 1)
        assert_bit_identical(snapshot(ref), snapshot(opt))
        assert S is opt.scale and S.item() == ref.scale.item()
        if clip is not None:
            assert_bit_identical([ref.grad_norm], [opt.grad_norm])
