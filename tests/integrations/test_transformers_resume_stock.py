"""ScaledTrainer resumes a stock ``Trainer(fp16=True)`` checkpoint, importing its GradScaler state
(``scaler.pt``), and takes the scale's settings in one argument, ``scaling_config``, so a run
started with GradScaler moves to scaledoptim without losing its scale.

The checkpoint is written by a stock Trainer on CPU (whose accelerate has no GradScaler there),
plus the ``scaler.pt`` a CUDA run writes: a real torch.amp.GradScaler's state_dict.
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


def test_the_trainer_still_loads_the_scaler_through_its_private_hook():
    """See Note [ScaledTrainer hooks]: the one private method overridden is still called on resume,
    after the optimizer's state is loaded."""
    source = inspect.getsource(transformers.Trainer)
    assert source.index(
        "self._load_optimizer_and_scheduler(resume_from_checkpoint)"
    ) < source.index("self._load_scaler(resume_from_checkpoint)")
