"""ScaledMixedPrecision under a real lightning.pytorch Trainer (CPU), against hand-written loops."""

from __future__ import annotations

import pytest
import torch
from prerequisites import require_module

import scaledoptim

require_module("lightning", "the Lightning integration is tested with real Lightning")
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from scaledoptim.integrations.lightning import ScaledMixedPrecision  # noqa: E402

BATCHES = 6


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCHES * 8, 4, generator=g)
    y = x @ torch.randn(4, 1, generator=g)
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, len(x), 8)]


def _loader(batches: list) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(batches, batch_size=None)  # items are whole batches


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _adamw(params):
    opt = scaledoptim.AdamW(params, lr=1e-2)
    return opt.configure_scaling(init_scale=2.0**10, growth_interval=2)


def _poison(net: torch.nn.Module) -> None:
    net[2].bias.grad[0] = float("inf")


class Regression(pl.LightningModule):
    def __init__(self, make_optimizer=_adamw, overflows=(), manual: bool = False) -> None:
        super().__init__()
        self.net = _net()
        self.make_optimizer, self.overflows = make_optimizer, set(overflows)
        self.automatic_optimization = not manual
        self.seen_grad_norms: list[float] = []
        self.output_dtypes: set[torch.dtype] = set()

    def _loss(self, batch):
        x, y = batch
        out = self.net(x)
        self.output_dtypes.add(out.dtype)
        return torch.nn.functional.mse_loss(out.float(), y)

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return self._loss(batch)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self._loss(batch))
        opt.step()

    def on_after_backward(self) -> None:
        if self.global_step in self.overflows:
            _poison(self.net)

    def on_before_optimizer_step(self, optimizer) -> None:
        norms = [p.grad.norm() for p in self.parameters() if p.grad is not None]
        self.seen_grad_norms.append(torch.stack(norms).norm().item())

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def _trainer(plugin=None, **kwargs) -> pl.Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        max_steps=BATCHES,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    options.update(kwargs)
    return pl.Trainer(plugins=[plugin or ScaledMixedPrecision("16-mixed")], **options)


def _hand_written(overflows=(), clip=None, accumulate=1, make_optimizer=_adamw):
    """The loop of docs/migration.md, with the plugin's autocast, poisoning, clipping and
    accumulation."""
    net = _net()
    opt = make_optimizer(net.parameters())
    S, skipped, scales, norms = opt.scale, 0.0, [], []
    batches = _data()
    for step in range(len(batches) // accumulate):
        opt.zero_grad()
        for x, y in batches[step * accumulate : (step + 1) * accumulate]:
            with scaledoptim.autocast("cpu", dtype=torch.float16, cache_enabled=False):
                loss = torch.nn.functional.mse_loss(net(x).float(), y) / accumulate
            scaledoptim.scale_outputs(loss, S).backward()
            if step in overflows:
                _poison(net)
        found_inf, S = opt.unscale(grads_scaled_by=S)
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), clip).item())
        opt.step_after_unscale()
        skipped += found_inf.item()
        scales.append(S.item())
    if clip is not None:
        return net, skipped, scales, norms
    return net, skipped, scales


def _assert_same_params(module: torch.nn.Module, reference: torch.nn.Module, atol=1e-6) -> None:
    for ours, ref in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, ref, rtol=0, atol=atol)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_adamw_matches_a_hand_written_loop_with_the_same_skips(manual) -> None:
    model = Regression(overflows={1, 4}, manual=manual)
    trainer = _trainer()
    trainer.fit(model, _loader(_data()))
    reference, skipped, scales = _hand_written(overflows={1, 4})
    _assert_same_params(model.net, reference)
    metrics = trainer.callback_metrics
    assert metrics["scaledoptim/skipped_steps"].item() == skipped == 2
    assert metrics["scaledoptim/scale"].item() == scales[-1]
    assert trainer.progress_bar_metrics["scaledoptim/skipped_steps"] == 2
    assert model.output_dtypes == {torch.float16}


def test_hooks_and_trainer_clipping_see_unscaled_grads() -> None:
    model = Regression(overflows={2})
    trainer = _trainer(ScaledMixedPrecision("16-mixed", clip_in_step=False), gradient_clip_val=0.05)
    trainer.fit(model, _loader(_data()))
    reference, _, _, _ = _hand_written(overflows={2}, clip=0.05)
    _assert_same_params(model.net, reference)
    finite = [n for n in model.seen_grad_norms if n == n and n != float("inf")]
    assert len(finite) == BATCHES - 1 and max(finite) < 50  # scaled by 2**10 they would be ~1e3+


def _torch_adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def test_norm_clipping_runs_in_the_step_as_lightnings_own_amp_clips() -> None:
    model = Regression(overflows={2})
    trainer = _trainer(gradient_clip_val=0.05)
    trainer.fit(model, _loader(_data()))
    # Lightning's own AMP: torch.amp.GradScaler unscale_, clip_grad_norm_, torch AdamW.
    stock = Regression(make_optimizer=_torch_adamw, overflows={2})
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    _trainer(MixedPrecision("16-mixed", "cpu", scaler=scaler), gradient_clip_val=0.05).fit(
        stock, _loader(_data())
    )
    _, skipped, scales, norms = _hand_written(overflows={2}, clip=0.05)

    _assert_same_params(model.net, stock.net)
    assert min(n for n in norms if n == n and n != float("inf")) > 0.05  # every step clips
    metrics = trainer.callback_metrics
    assert metrics["scaledoptim/grad_norm"].item() == pytest.approx(norms[-1], rel=1e-6)
    assert metrics["scaledoptim/skipped_steps"].item() == skipped == 1
    assert scaler.get_scale() == scales[-1] == metrics["scaledoptim/scale"].item()
    # The hooks ran before the step, on the grads as the backward left them: scaled.
    assert model.seen_grad_norms[0] == pytest.approx(norms[0] * 2.0**10, rel=1e-4)


def test_a_zero_gradient_clip_val_does_not_clip() -> None:
    model = Regression()
    _trainer(gradient_clip_val=0.0).fit(model, _loader(_data()))
    reference, _, _ = _hand_written()
    _assert_same_params(model.net, reference)
    assert "scaledoptim/grad_norm" not in _trainer().callback_metrics


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_gradient_clip_val_that_is_no_norm_is_refused(bad) -> None:
    model = Regression()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="gradient_clip_val"):
        _trainer(gradient_clip_val=bad).fit(model, _loader(_data()))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_value_clipping_keeps_unscaling_first_and_a_clip_by_value_in_step_is_refused() -> None:
    model = Regression()
    trainer = _trainer(gradient_clip_val=0.01, gradient_clip_algorithm="value", max_steps=2)
    trainer.fit(model, _loader(_data()))
    assert max(model.seen_grad_norms) < 50  # unscaled before the hooks, as without clipping

    class ValueClipping(Regression):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val, **kwargs):
            self.clip_gradients(optimizer, gradient_clip_val, "value")

    model = ValueClipping()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="clip_in_step=False"):
        _trainer(gradient_clip_val=0.05).fit(model, _loader(_data()))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_gradient_accumulation_scales_every_micro_batch_by_the_same_scale() -> None:
    model = Regression(overflows={1})
    trainer = _trainer(accumulate_grad_batches=2, max_steps=BATCHES // 2)
    trainer.fit(model, _loader(_data()))
    reference, skipped, _ = _hand_written(overflows={1}, accumulate=2)
    _assert_same_params(model.net, reference)
    assert trainer.callback_metrics["scaledoptim/skipped_steps"].item() == skipped == 1


def _lbfgs(params):
    return scaledoptim.LBFGS(params, lr=0.5, max_iter=5).configure_scaling(init_scale=2.0**40)


def test_lightnings_own_amp_plugin_refuses_lbfgs() -> None:
    model = Regression(make_optimizer=lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=5))
    refusal = "AMP and the LBFGS optimizer are not compatible"
    with pytest.raises(MisconfigurationException, match=refusal):
        _trainer(MixedPrecision("16-mixed", "cpu")).fit(model, _loader(_data()))


def test_lbfgs_trains_in_fp16_with_closure_replay() -> None:
    model = Regression(make_optimizer=_lbfgs)
    trainer = _trainer(max_steps=3)
    trainer.fit(model, _loader(_data()[:3]))
    # The hand-written closure form of docs/recipes/closures-lbfgs.md, same seed and data.
    net = _net()
    opt = _lbfgs(net.parameters())
    S = opt.scale
    for x, y in _data()[:3]:
        def closure(S, x=x, y=y):
            opt.zero_grad()
            with scaledoptim.autocast("cpu", dtype=torch.float16, cache_enabled=False):
                loss = torch.nn.functional.mse_loss(net(x).float(), y)
            scaledoptim.scale_outputs(loss, S).backward()
            return loss
        _, _, S = opt.unscale_and_step(closure, grads_scaled_by=S)
    _assert_same_params(model.net, net)
    assert trainer.callback_metrics["scaledoptim/scale"].item() == S.item() < 2.0**40
    assert trainer.callback_metrics["scaledoptim/skipped_steps"].item() == 0
    # Every evaluation Lightning's hook saw was unscaled; the overflowed ones are inf/nan.
    finite = [n for n in model.seen_grad_norms if n == n and n != float("inf")]
    assert len(finite) >= 3 and max(finite) < 1e3
    assert len(model.seen_grad_norms) > len(finite), "the first tries overflowed and replayed"


def test_lbfgs_replay_refuses_gradient_accumulation() -> None:
    with pytest.raises(RuntimeError, match="accumulate_grad_batches"):
        _trainer(accumulate_grad_batches=2).fit(Regression(make_optimizer=_lbfgs), _loader(_data()))


def test_checkpoint_resume_is_bit_exact(tmp_path) -> None:
    data = _data()[:3]
    straight = Regression(overflows={1, 4})
    straight_trainer = _trainer(max_steps=-1, max_epochs=2)
    straight_trainer.fit(straight, _loader(data))

    first = Regression(overflows={1, 4})
    trainer = _trainer(max_steps=-1, max_epochs=1)
    trainer.fit(first, _loader(data))
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed = Regression(overflows={1, 4})
    resumed_trainer = _trainer(max_steps=-1, max_epochs=2)
    resumed_trainer.fit(resumed, _loader(data), ckpt_path=tmp_path / "epoch1.ckpt")

    _assert_same_params(resumed.net, straight.net, atol=0)
    opt, straight_opt = resumed_trainer.optimizers[0], straight_trainer.optimizers[0]
    assert opt.state_dict()["loss_scale"].keys() == straight_opt.state_dict()["loss_scale"].keys()
    ours, straight_scale = opt.state_dict()["loss_scale"], straight_opt.state_dict()["loss_scale"]
    for key in ("scale", "growth_tracker", "hysteresis_tracker"):
        assert torch.equal(ours[key], straight_scale[key])
    assert resumed_trainer.precision_plugin.state_dict() == {"skipped_steps": {0: 2}}


def test_any_scaledoptim_optimizer_works_and_a_plain_one_is_refused() -> None:
    def patched_sgd(params):
        return scaledoptim.patch_optimizer(torch.optim.SGD(params, lr=0.1))

    patched = Regression(make_optimizer=patched_sgd)
    _trainer(max_steps=2).fit(patched, _loader(_data()))
    rmsprop = Regression(make_optimizer=scaledoptim.with_scaling(torch.optim.RMSprop))
    _trainer(max_steps=2).fit(rmsprop, _loader(_data()))
    plain = Regression(make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(TypeError, match="patch_optimizer"):
        _trainer(max_steps=2).fit(plain, _loader(_data()))


def test_manual_backward_refuses_two_unshared_scales() -> None:
    class TwoOptimizers(Regression):
        def configure_optimizers(self):
            return [_adamw(self.net[0].parameters()), _adamw(self.net[2].parameters())]

        def training_step(self, batch, batch_idx):
            self.manual_backward(self._loss(batch))

    with pytest.raises(RuntimeError, match="share_scale"):
        _trainer(max_steps=1).fit(TwoOptimizers(manual=True), _loader(_data()))


def test_bf16_mixed_needs_no_scale_and_takes_a_plain_optimizer() -> None:
    model = Regression(make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    _trainer(ScaledMixedPrecision("bf16-mixed"), max_steps=2).fit(model, _loader(_data()))
    assert model.output_dtypes == {torch.bfloat16}
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_bad_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="'16-mixed' or 'bf16-mixed'"):
        ScaledMixedPrecision("16-true")
