"""The Accelerate recipe of docs/integrations/accelerate.md, with real accelerate on CPU."""

from __future__ import annotations

import pytest
import torch
from prerequisites import require_module

import scaledoptim
from scaledoptim.integrations.accelerate import unwrap_optimizer

require_module("accelerate", "the Accelerate recipe is tested with real accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402

from tests.support.accelerate_state import fresh_accelerator_state  # noqa: E402, F401 (autouse)

ACCUMULATE, OVERFLOW_MICRO_BATCH = 2, 3


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    opt = scaledoptim.AdamW(model.parameters(), lr=1e-2).configure_scaling(init_scale=2.0**10)
    return model, opt, torch.utils.data.DataLoader(data, batch_size=8)


def _loss(model, x, y):
    with scaledoptim.autocast("cpu", dtype=torch.float16):
        return torch.nn.functional.mse_loss(model(x).float(), y)


def test_the_recipe_matches_a_hand_written_accumulation_loop() -> None:
    accelerator = Accelerator(
        mixed_precision="no", cpu=True, gradient_accumulation_steps=ACCUMULATE
    )
    model, opt, data = accelerator.prepare(*_setup())
    scaled_opt = unwrap_optimizer(opt)
    S, skipped = scaled_opt.scale, 0.0
    for i, (x, y) in enumerate(data):
        with accelerator.accumulate(model):
            accelerator.backward(scaledoptim.scale_outputs(_loss(model, x, y), S))
            if i == OVERFLOW_MICRO_BATCH:
                model[2].bias.grad[0] = float("inf")
            if accelerator.sync_gradients:
                found_inf, S = scaled_opt.unscale(grads_scaled_by=S)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaled_opt.step_after_unscale()
                skipped += found_inf.item()
            opt.zero_grad()

    reference, ref_opt, ref_data = _setup()
    S, ref_skipped = ref_opt.scale, 0.0
    batches = list(ref_data)
    for start in range(0, len(batches), ACCUMULATE):
        ref_opt.zero_grad()
        for i in range(start, start + ACCUMULATE):
            scaledoptim.scale_outputs(_loss(reference, *batches[i]) / ACCUMULATE, S).backward()
            if i == OVERFLOW_MICRO_BATCH:
                reference[2].bias.grad[0] = float("inf")
        found_inf, S = ref_opt.unscale(grads_scaled_by=S)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step_after_unscale()
        ref_skipped += found_inf.item()

    assert skipped == ref_skipped == 1
    assert scaled_opt.scale.item() == ref_opt.scale.item() == 2.0**9
    for ours, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


def test_unwrap_refuses_a_second_scaler_and_a_plain_optimizer() -> None:
    Accelerator(mixed_precision="no", cpu=True)
    model, opt, _ = _setup()
    assert unwrap_optimizer(opt) is opt
    # What Accelerator(mixed_precision="fp16") would build on a GPU:
    scaler = torch.amp.GradScaler("cpu")
    with_scaler = AcceleratedOptimizer(opt, device_placement=False, scaler=scaler)
    with pytest.raises(RuntimeError, match="mixed_precision='no'"):
        unwrap_optimizer(with_scaler)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = AcceleratedOptimizer(sgd, device_placement=False)
    with pytest.raises(TypeError, match="patch_optimizer"):
        unwrap_optimizer(plain)
