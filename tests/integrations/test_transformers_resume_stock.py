"""ScaledTrainer and the stock ``Trainer(fp16=True)`` resume each other's checkpoints with the
scale carried over, and ScaledTrainer takes the scale's settings in one argument,
``scaling_config``, so a run moves between GradScaler and scaledoptim without losing its scale.

On a CUDA device accelerate gives the stock Trainer a GradScaler, which it saves as
``scaler.pt``; on a CPU it gives none. ``_stock_trainer`` gives it one as on CUDA (the same
``torch.amp.GradScaler``, on the CPU), so these tests run the stock Trainer's fp16 loop as it runs
on a GPU: backward of the scaled loss, ``unscale_`` + ``clip_grad_norm_``, ``scaler.step`` (with
``adamw_torch_fused``, torch's fused AdamW taking ``grad_scale`` and ``found_inf``).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from prerequisites import require_module

import scaledoptim

require_module("transformers", "ScaledTrainer is tested with real transformers")
require_module("accelerate", "ScaledTrainer is tested with real accelerate")
import transformers  # noqa: E402

from scaledoptim.integrations.transformers import ScaledTrainer  # noqa: E402
from tests.integrations.test_transformers_trainer import _args, _data, _inner, _model  # noqa: E402
from tests.support.accelerate_state import fresh_accelerator_state  # noqa: E402, F401 (autouse)

STOCK_SCALE, STOCK_TRACKER, GROWTH_INTERVAL = 512.0, 1, 2
OPTIMS = ["adamw_torch_fused", "adamw_torch"]


class _Scales(transformers.TrainerCallback):
    """The scale each step starts with (the stock Trainer's scaler's, or the optimizer's)."""

    def __init__(self, read) -> None:
        self.read, self.at = read, {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.at[state.global_step + 1] = self.read()


def _stock_trainer(tmp_path, optim: str, max_steps: int, **kwargs) -> transformers.Trainer:
    """A stock fp16 Trainer whose accelerate has a GradScaler, as on a CUDA device."""
    args = _args(tmp_path, fp16=True, optim=optim, max_steps=max_steps,
                 per_device_train_batch_size=4, save_strategy="steps", save_steps=3)
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_data(48), **kwargs)
    trainer.accelerator.scaler = torch.amp.GradScaler(
        "cpu", init_scale=STOCK_SCALE, growth_interval=GROWTH_INTERVAL
    )
    trainer.accelerator.native_amp = True
    scales = _Scales(lambda: trainer.accelerator.scaler.get_scale())
    trainer.add_callback(scales)
    trainer.scales = scales.at
    return trainer


def _scaled_trainer(tmp_path, optim: str, max_steps: int) -> ScaledTrainer:
    args = _args(tmp_path, fp16=True, optim=optim, max_steps=max_steps,
                 per_device_train_batch_size=4, save_strategy="steps", save_steps=3)
    config = scaledoptim.ScalingConfig(init_scale=2.0**12, growth_interval=GROWTH_INTERVAL)
    trainer = ScaledTrainer(
        model=_model(), args=args, train_dataset=_data(48), scaling_config=config
    )
    scales = _Scales(lambda: _inner(trainer).scale.item())
    trainer.add_callback(scales)
    trainer.scales = scales.at
    return trainer


@pytest.mark.parametrize("optim", OPTIMS)
def test_the_stock_trainer_resumes_a_scaledtrainer_checkpoint_with_its_scale(tmp_path, optim):
    ours = _scaled_trainer(tmp_path / "ours", optim, max_steps=3)
    ours.train()
    checkpoint = tmp_path / "ours" / "checkpoint-3"
    saved = _inner(ours).state_dict()
    assert all(g["fused"] is (True if optim == "adamw_torch_fused" else None)
               for g in saved["param_groups"])  # what the stock Trainer's AdamW is built with
    scaler_state = torch.load(checkpoint / "scaler.pt", weights_only=True)
    assert scaler_state == _inner(ours).gradscaler_state_dict()  # GradScaler's format
    assert scaler_state["scale"] not in (STOCK_SCALE, 2.0**16)

    stock = _stock_trainer(tmp_path / "stock", optim, max_steps=6)
    stock.train(resume_from_checkpoint=str(checkpoint))  # steps 4-6, stepped by GradScaler

    assert stock.scales[4] == scaler_state["scale"]  # carried over
    assert torch.amp.GradScaler("cpu").state_dict().keys() == scaler_state.keys()
    assert all(torch.isfinite(p).all() for p in stock.model.parameters())
    assert isinstance(stock.optimizer.optimizer, torch.optim.AdamW)


@pytest.mark.parametrize("optim", OPTIMS)
def test_scaledtrainer_resumes_a_stock_checkpoint_as_the_stock_trainer_does(tmp_path, optim):
    _stock_trainer(tmp_path / "stock", optim, max_steps=3).train()
    checkpoint = str(tmp_path / "stock" / "checkpoint-3")
    stock_state = torch.load(f"{checkpoint}/scaler.pt", weights_only=True)

    stock = _stock_trainer(tmp_path / "stock-on", optim, max_steps=6)
    stock.train(resume_from_checkpoint=checkpoint)
    ours = _scaled_trainer(tmp_path / "ours", optim, max_steps=6)
    ours.train(resume_from_checkpoint=checkpoint)

    assert ours.scales[4] == stock_state["scale"]  # carried over
    assert [ours.scales[s] for s in (4, 5, 6)] == [stock.scales[s] for s in (4, 5, 6)]


def test_a_checkpoint_crosses_to_the_stock_trainer_and_back(tmp_path):
    """ScaledTrainer -> stock Trainer (which keeps our stale scale in its param groups) ->
    ScaledTrainer: the scale of the stock run's scaler.pt wins."""
    _scaled_trainer(tmp_path / "ours", "adamw_torch_fused", max_steps=3).train()
    stock = _stock_trainer(tmp_path / "stock", "adamw_torch_fused", max_steps=6)
    stock.train(resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-3"))
    checkpoint = tmp_path / "stock" / "checkpoint-6"
    stock_state = torch.load(checkpoint / "scaler.pt", weights_only=True)
    assert stock_state["scale"] != stock.scales[4]  # the scale moved in the stock run

    back = _scaled_trainer(tmp_path / "back", "adamw_torch_fused", max_steps=8)
    back.train(resume_from_checkpoint=str(checkpoint))
    assert back.scales[7] == stock_state["scale"]


def test_a_scaledtrainer_resume_keeps_what_scaler_pt_cannot_hold(tmp_path):
    """Resuming its own checkpoint, ScaledTrainer keeps optimizer.pt's scale state (hysteresis
    included), equal to scaler.pt's scale and tracker: scaler.pt is not imported over it."""
    args = _args(tmp_path, fp16=True, max_steps=3, per_device_train_batch_size=4,
                 save_strategy="steps", save_steps=3)
    config = scaledoptim.ScalingConfig(hysteresis=3, init_scale=2.0**40)  # overflows first
    first = ScaledTrainer(model=_model(), args=args, train_dataset=_data(24),
                          scaling_config=config)
    first.train()
    hysteresis = _inner(first).scaling_state.loss_scale.hysteresis_tracker.item()
    assert hysteresis < 3  # some of the allowance was used
    resumed = ScaledTrainer(
        model=_model(), args=_args(tmp_path / "r", fp16=True, max_steps=3,
                                   per_device_train_batch_size=4),
        train_dataset=_data(24), scaling_config=config,
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    loss_scale = _inner(resumed).scaling_state.loss_scale
    assert loss_scale.hysteresis_tracker.item() == hysteresis


def _stock_checkpoint(tmp_path) -> str:
    """checkpoint-3 of a stock fp16 Trainer, with the scaler.pt of a GradScaler that scaled by
    ``STOCK_SCALE`` and counted ``STOCK_TRACKER`` clean steps."""
    args = _args(tmp_path / "stock", fp16=True, max_steps=3, per_device_train_batch_size=4,
                 save_strategy="steps", save_steps=3)
    transformers.Trainer(model=_model(), args=args, train_dataset=_data(24)).train()
    checkpoint = tmp_path / "stock" / "checkpoint-3"
    scaler = torch.amp.GradScaler("cpu", init_scale=STOCK_SCALE, growth_interval=GROWTH_INTERVAL)
    scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": STOCK_TRACKER})
    torch.save(scaler.state_dict(), checkpoint / "scaler.pt")
    return str(checkpoint)


def test_a_stock_fp16_checkpoint_resumes_with_its_gradscaler_scale(tmp_path):
    checkpoint = _stock_checkpoint(tmp_path)
    config = scaledoptim.ScalingConfig(hysteresis=2)
    args = _args(tmp_path / "resumed", fp16=True, max_steps=6, per_device_train_batch_size=4)
    trainer = ScaledTrainer(
        model=_model(), args=args, train_dataset=_data(24), scaling_config=config
    )
    trainer.train(resume_from_checkpoint=checkpoint)

    history = trainer.state.log_history  # the stock run's steps 1-3, then ours
    logged = [(e["step"], e["loss_scale"]) for e in history if "loss" in e and e["step"] > 3]
    # The stock scaler's tracker was 1 of 2: the first clean step grows 512 to 1024, every
    # second one after it again (logs carry the scale of the next step).
    assert logged == [(4, 1024.0), (5, 1024.0), (6, 2048.0)]
    loss_scale = _inner(trainer).scaling_state.loss_scale
    assert loss_scale.config.growth_interval == GROWTH_INTERVAL  # from the GradScaler state
    assert loss_scale.config.hysteresis == 2  # from scaling_config
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_scaling_config_sets_the_scale_of_a_fresh_run(tmp_path):
    config = scaledoptim.ScalingConfig(init_scale=2.0**8, growth_interval=2)
    args = _args(tmp_path, fp16=True, max_steps=3, per_device_train_batch_size=4)
    trainer = ScaledTrainer(
        model=_model(), args=args, train_dataset=_data(12), scaling_config=config
    )
    trainer.train()
    logged = [e["loss_scale"] for e in trainer.state.log_history if "loss" in e]
    assert logged == [256.0, 512.0, 512.0]
    assert _inner(trainer).scaling_state.loss_scale.config == config


def test_scaling_config_must_be_a_scaling_config(tmp_path):
    with pytest.raises(TypeError, match="ScalingConfig"):
        ScaledTrainer(
            model=_model(), args=_args(tmp_path, fp16=True), scaling_config={"init_scale": 8.0}
        )


def test_the_trainer_still_saves_and_loads_the_scaler_through_its_private_hooks():
    """See Note [ScaledTrainer hooks]: the two private methods overridden are still called, on
    save and on resume after the optimizer's state is loaded."""
    source = inspect.getsource(transformers.Trainer)
    assert source.index(
        "self._load_optimizer_and_scheduler(resume_from_checkpoint)"
    ) < source.index("self._load_scaler(resume_from_checkpoint)")
    saving = inspect.getsource(transformers.Trainer._save_checkpoint)
    assert "self._save_scaler(output_dir)" in saving
