"""ScaledTrainer (scaledoptim.integrations.transformers) with real transformers, on CPU.

A config-built one-layer GPT-2 (no download), a few steps each.
"""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest
import torch
from prerequisites import require_module

import scaledoptim

require_module("transformers", "ScaledTrainer is tested with real transformers")
require_module("accelerate", "ScaledTrainer is tested with real accelerate")
import transformers  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from scaledoptim.integrations.transformers import ScaledTrainer  # noqa: E402
from tests.support.accelerate_state import fresh_accelerator_state  # noqa: E402, F401 (autouse)

SEQ, VOCAB = 16, 64


def _model() -> Any:
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _data(n: int = 32) -> list[dict[str, torch.Tensor]]:
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": t, "labels": t} for t in tokens]


def _args(tmp_path, **kwargs) -> transformers.TrainingArguments:
    defaults = dict(
        use_cpu=True, report_to=[], per_device_train_batch_size=8, logging_steps=1,
        save_strategy="no", disable_tqdm=True, seed=0, data_seed=0,
    )
    return transformers.TrainingArguments(str(tmp_path), **{**defaults, **kwargs})


def _inner(trainer: Any) -> Any:
    """The scaledoptim optimizer inside accelerate's wrapper."""
    return trainer.optimizer.optimizer


def _scheduler(trainer: Any) -> Any:
    return trainer.lr_scheduler


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _overflow_at(trainer_ref: list, model: Any, global_step: int) -> None:
    """Makes the grads of the optimizer step after ``global_step`` steps inf."""
    weight = model.transformer.wte.weight

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if trainer_ref[0].state.global_step == global_step:
            return torch.full_like(grad, float("inf"))
        return grad

    weight.register_hook(hook)


def _forward_dtypes(model: Any) -> list[torch.dtype]:
    dtypes: list[torch.dtype] = []
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    return dtypes


def _reference_grad_norm(tmp_path, data: list[dict[str, torch.Tensor]]) -> float:
    """The first step's grad norm under transformers' own Trainer, in fp32."""
    trainer = transformers.Trainer(
        model=_model(), args=_args(tmp_path / "fp32", max_steps=1), train_dataset=data
    )
    trainer.train()
    return trainer.state.log_history[0]["grad_norm"]


def test_fp16_trains_scaled_on_cpu_and_backs_off(tmp_path):
    model = _model()
    dtypes = _forward_dtypes(model)
    ref: list = []
    trainer = ScaledTrainer(
        model=model, args=_args(tmp_path, fp16=True, max_steps=4), train_dataset=_data()
    )
    ref.append(trainer)
    _overflow_at(ref, model, global_step=1)  # the second step overflows
    trainer.train()

    opt = _inner(trainer)
    assert isinstance(opt, scaledoptim.AdamW)
    assert trainer.accelerator.mixed_precision == "no" and trainer.accelerator.scaler is None
    assert set(dtypes) == {torch.float16}  # fp16 autocast, on CPU
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["loss_scale"] for entry in logs] == [2.0**16, 2.0**15, 2.0**15, 2.0**15]
    assert opt.scale.item() == 2.0**15 < 2.0**16
    assert _scheduler(trainer).last_epoch == 3  # four steps, one skipped
    # Trainer's no-decay groups: biases and LayerNorms get none.
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == trainer.args.weight_decay and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("bias" in names[id(p)] or "ln_" in names[id(p)] for p in no_decay["params"])
    assert opt.param_groups[0]["lr"] == pytest.approx(_scheduler(trainer).get_last_lr()[0])


def test_overflowed_step_is_skipped_and_scheduler_holds(tmp_path):
    model = _model()
    opt = scaledoptim.AdamW(model.parameters(), lr=1e-3).configure_scaling(init_scale=2.0**40)
    before = _params(model)
    trainer = ScaledTrainer(
        model=model,
        args=_args(tmp_path, fp16=True, max_steps=1),
        train_dataset=_data(),
        optimizers=(opt, None),
    )
    trainer.train()

    assert _inner(trainer) is opt
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # skipped
    for state in opt.state.values():  # the fused step skipped on device: nothing moved
        assert all(not torch.is_tensor(v) or not v.any() for v in state.values())
    assert _scheduler(trainer).last_epoch == 0  # the scheduler did not advance
    assert opt.scale.item() == 2.0**39
    assert trainer.state.log_history[0]["loss_scale"] == 2.0**39
    assert not math.isfinite(trainer.state.log_history[0]["grad_norm"])


class _Elementwise(torch.nn.Module):
    """Ops that fp16 autocast leaves in float32: a scaled fp16 run computes the fp32 grads
    times a power of two, so it can match the stock fp32 Trainer bit for bit."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(8))
        self.bias = torch.nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        prediction = torch.tanh(x * self.weight + self.bias).sum(-1)
        return {"loss": ((prediction - labels) ** 2).mean()}


def _elementwise_data(n: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 8, generator=g), 3 * torch.randn(n, generator=g)
    return [{"x": a, "labels": b} for a, b in zip(x, y, strict=True)]


def _grad_norms(trainer: Any) -> list[float]:
    return [e["grad_norm"] for e in trainer.state.log_history if "loss" in e]


def test_max_grad_norm_clips_in_the_step_as_the_stock_trainer_clips(tmp_path):
    data = _elementwise_data()
    seen: list[float] = []

    class Probe(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            seen.append(float(torch.stack([p.grad.norm() for p in model.parameters()]).norm()))

    ours = _Elementwise()
    trainer = ScaledTrainer(
        model=ours, args=_args(tmp_path, fp16=True, max_steps=4, max_grad_norm=0.5),
        train_dataset=data, callbacks=[Probe()],
    )
    trainer.train()
    stock_model = _Elementwise()
    stock = transformers.Trainer(
        model=stock_model, args=_args(tmp_path / "fp32", max_steps=4, max_grad_norm=0.5),
        train_dataset=data,
    )
    stock.train()

    assert min(_grad_norms(stock)) > 0.5  # every step clips
    assert _grad_norms(trainer) == pytest.approx(_grad_norms(stock), rel=1e-6)
    for (name, p), q in zip(ours.named_parameters(), stock_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
    opt = _inner(trainer)
    assert opt.grad_norm is not None  # the clip ran in opt.unscale_and_step
    assert opt.grad_norm.item() == _grad_norms(trainer)[-1]
    # The Trainer's own clip was skipped: the grads before the step are scaled, not clipped.
    assert seen[0] == pytest.approx(_grad_norms(stock)[0] * 2.0**16, rel=1e-5)


def test_without_max_grad_norm_the_grads_are_unscaled_before_the_step(tmp_path):
    data = _data(8)
    seen: list[float] = []

    class Probe(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            seen.append(float(torch.stack([p.grad.norm() for p in model.parameters()]).norm()))

    trainer = ScaledTrainer(
        model=_model(), args=_args(tmp_path, fp16=True, max_steps=1, max_grad_norm=0.0),
        train_dataset=data, callbacks=[Probe()],
    )
    trainer.train()

    reference = _reference_grad_norm(tmp_path, data)
    assert trainer.state.log_history[0]["grad_norm"] == pytest.approx(reference, rel=1e-3)
    assert seen[0] == pytest.approx(reference, rel=1e-3)  # unscaled in place, not clipped
    assert _inner(trainer).grad_norm is None  # no clip in the step


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_a_max_grad_norm_that_is_no_norm_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="max_grad_norm"):
        ScaledTrainer(model=_model(), args=_args(tmp_path, fp16=True, max_grad_norm=bad))


def test_clip_grad_norm_with_another_max_norm_is_refused(tmp_path):
    trainer = ScaledTrainer(
        model=_Elementwise(), args=_args(tmp_path, fp16=True, max_steps=1, max_grad_norm=0.5),
        train_dataset=_elementwise_data(8),
    )
    trainer.create_optimizer()
    with pytest.raises(RuntimeError, match="max_grad_norm"):
        trainer.accelerator.clip_grad_norm_(trainer.model.parameters(), 2.0)


def test_resume_from_checkpoint_reproduces_the_run(tmp_path):
    data = _data(24)

    def run(output_dir, resume=None, overflow=False):
        model = _model()
        ref: list = []
        args = _args(
            output_dir,
            fp16=True,
            max_steps=6,
            per_device_train_batch_size=4,
            save_strategy="steps",
            save_steps=3,
        )
        trainer = ScaledTrainer(model=model, args=args, train_dataset=data)
        ref.append(trainer)
        if overflow:
            _overflow_at(ref, model, global_step=1)  # before the checkpoint: its scale is 2**15
        trainer.train(resume_from_checkpoint=resume)
        return trainer, model

    full, full_model = run(tmp_path / "full", overflow=True)
    checkpoint = tmp_path / "full" / "checkpoint-3"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert float(saved["loss_scale"]["scale"]) == 2.0**15
    # and GradScaler's copy, for a stock Trainer to resume (test_transformers_resume_stock.py)
    assert torch.load(checkpoint / "scaler.pt", weights_only=True)["scale"] == 2.0**15

    resumed, resumed_model = run(tmp_path / "resumed", resume=str(checkpoint))
    for (name, p), q in zip(full_model.named_parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert torch.equal(_inner(resumed).scale, _inner(full).scale)
    assert _inner(resumed).scale.item() == 2.0**15
    assert _scheduler(resumed).last_epoch == _scheduler(full).last_epoch == 5

    def logged(trainer):
        return [
            (e["loss"], e["loss_scale"])
            for e in trainer.state.log_history
            if "loss" in e and e["step"] > 3
        ]

    assert logged(resumed) == logged(full) and len(logged(full)) == 3


def test_gradient_accumulation_unscales_once_per_step_and_evaluates(tmp_path):
    data = _data(16)
    args = _args(
        tmp_path,
        fp16=True,
        max_steps=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    )
    trainer = ScaledTrainer(model=_model(), args=args, train_dataset=data, eval_dataset=data[:8])
    trainer.train()  # a second unscale in a window would raise

    stock_args = _args(
        tmp_path / "fp32", max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2
    )
    stock = transformers.Trainer(model=_model(), args=stock_args, train_dataset=data)
    stock.train()
    ours = [e["grad_norm"] for e in trainer.state.log_history if "loss" in e]
    theirs = [e["grad_norm"] for e in stock.state.log_history if "loss" in e]
    assert ours == pytest.approx(
        theirs, rel=2e-3
    )  # every micro-batch scaled by one S, unscaled once
    assert _scheduler(trainer).last_epoch == 2
    metrics = trainer.evaluate()  # under fp16 autocast too
    assert math.isfinite(metrics["eval_loss"]) and "loss_scale" not in metrics


def test_bf16_trains_unscaled(tmp_path):
    data = _data(8)
    model = _model()
    dtypes = _forward_dtypes(model)
    opt = scaledoptim.AdamW(model.parameters(), lr=1e-3)
    trainer = ScaledTrainer(
        model=model,
        args=_args(tmp_path, bf16=True, max_steps=2),
        train_dataset=data,
        optimizers=(opt, None),
    )
    trainer.train()

    assert set(dtypes) == {torch.bfloat16}
    assert opt.scale.item() == 2.0**16  # never moved: nothing was scaled
    assert trainer.accelerator.mixed_precision == "no"
    assert all("loss_scale" not in entry for entry in trainer.state.log_history)
    reference = _reference_grad_norm(tmp_path, data)
    assert trainer.state.log_history[0]["grad_norm"] == pytest.approx(
        reference, rel=2e-2
    )  # unscaled
    assert _scheduler(trainer).last_epoch == 2


def test_fp16_refuses_an_optimizer_without_the_protocol(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    trainer = ScaledTrainer(
        model=model,
        args=_args(tmp_path, fp16=True, max_steps=1),
        train_dataset=_data(),
        optimizers=(opt, None),
    )
    with pytest.raises(TypeError, match="patch_optimizer"):
        trainer.train()


def test_the_one_reach_past_the_trainer_is_in_place(tmp_path):
    """See Note [ScaledTrainer hooks]: the Trainer's Accelerator gets two public overrides by a
    class swap; a transformers or accelerate release that changes what they rely on fails
    here (the other tests would fail less clearly)."""
    trainer = ScaledTrainer(
        model=_model(), args=_args(tmp_path, fp16=True, max_steps=1), train_dataset=_data()
    )
    assert isinstance(trainer.accelerator, Accelerator)
    assert type(trainer.accelerator).__mro__[2] is Accelerator
    assert trainer.args.mixed_precision == "fp16"  # restored after the Accelerator was built
    # The Trainer still asks these two public members of the Accelerator.
    source = __import__("inspect").getsource(transformers.Trainer)
    assert "self.accelerator.backward(" in source
    assert "self.accelerator.optimizer_step_was_skipped" in source


def test_importing_the_integrations_package_needs_no_transformers():
    code = (
        "import sys, scaledoptim, scaledoptim.integrations; "
        "assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
