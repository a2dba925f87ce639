"""The param rounding options of the fused optimizers (``master_weights``, ``stochastic_rounding``)
on both backends, over the default config of every row that takes them (the kernel-level
rounding is tests/kernels/test_emulated_rounding.py; resuming with them,
tests/fused/test_state_dict.py)."""

from __future__ import annotations

import io

import pytest
import torch

import scaledoptim
from scaledoptim.testing.optim_db import OptimInfo, row, rows
from tests.support.training import assert_bit_identical, loss_of, make_model, snapshot

pytestmark = pytest.mark.usefixtures("kernel_backend")

ROUNDING_ROWS = rows(fused=True, rounding=True)
ROUNDING = [dict(master_weights=True), dict(stochastic_rounding=True)]


def _bf16_model_and_opt(info: OptimInfo, config=None, **rounding):
    model = make_model(torch.bfloat16)
    return model, info.make(model.parameters(), config, **rounding).configure_scaling(
        init_scale=2.0**8, growth_interval=3
    )


@pytest.mark.parametrize("info", ROUNDING_ROWS, ids=str)
def test_master_weights_keep_an_fp32_master_and_round_the_param_from_it(info) -> None:
    model, opt = _bf16_model_and_opt(info, master_weights=True)
    fp32_model = make_model(torch.bfloat16).float()  # the same start, exactly
    fp32_opt = info.make(fp32_model.parameters()).configure_scaling(
        init_scale=2.0**8, growth_interval=3
    )
    for step in range(5):
        for m, o in ((model, opt), (fp32_model, fp32_opt)):
            o.zero_grad()
            scaledoptim.scale_outputs(loss_of(m, step), o.scale).backward()
            for p, p32 in zip(m.parameters(), fp32_model.parameters()):
                p.grad = p32.grad.to(p.dtype) if m is model and step > 0 else p.grad
            o.unscale_and_step(grads_scaled_by=o.scale)
    for p in model.parameters():
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and torch.equal(p, master.to(torch.bfloat16))
    fp32_state = fp32_opt.state[next(fp32_model.parameters())]
    assert "master_param" not in fp32_state


@pytest.mark.parametrize("info", ROUNDING_ROWS, ids=str)
@pytest.mark.parametrize("rounding", ROUNDING, ids=lambda r: next(iter(r)))
def test_a_skipped_step_touches_neither_param_nor_master(info, rounding) -> None:
    model, opt = _bf16_model_and_opt(info, **rounding)
    for step in range(3):
        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
        if step == 2:
            before = snapshot(opt)[:-3]  # params and state; the scale backs off
            model[0].weight.grad.view(-1)[0] = float("nan")
        _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert found_inf.item() == 1.0
    assert_bit_identical(before, snapshot(opt)[:-3])


@pytest.mark.parametrize("info", ROUNDING_ROWS, ids=str)
def test_fp32_params_ignore_master_weights(info) -> None:
    model = make_model()
    opt = info.make(model.parameters(), master_weights=True)
    loss_of(model, 0).backward()
    opt.step()
    assert all("master_param" not in s for s in opt.state.values())


@pytest.mark.parametrize("config", row("Lion").generic_configs, ids=str)
def test_stochastic_rounding_gives_the_same_bits_on_both_backends(config, monkeypatch) -> None:
    """Where both backends compute the same fp32 update (Lion), they round it to the same bits:
    the hash is the same integer function (Adam's, SGD's, Adagrad's and LAMB's fp32 updates
    differ by an ulp here and there between torch's ops and our kernels;
    tests/kernels/test_emulated_rounding.py shows the rounding itself identical for every
    kernel)."""
    runs = []
    for mode in ("torch", "emulate"):
        monkeypatch.setenv("SCALEDOPTIM_KERNELS", mode)
        model, opt = _bf16_model_and_opt(row("Lion"), config, stochastic_rounding=True)
        for step in range(4):
            opt.zero_grad()
            scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
            opt.unscale_and_step(grads_scaled_by=opt.scale)
        runs.append(snapshot(opt))
    assert_bit_identical(*runs)


@pytest.mark.parametrize("info", ROUNDING_ROWS, ids=str)
def test_stochastic_rounding_is_reproducible_and_seeded_per_param(info) -> None:
    def run():
        model, opt = _bf16_model_and_opt(info, stochastic_rounding=True)
        for step in range(3):
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()
        return model, opt

    (model, opt), (model2, _) = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    seeds = [opt.state[p]["sr_seed"] for p in model.parameters()]
    assert all(s.dtype == torch.int32 and s.shape == () for s in seeds)
    assert len({s.item() for s in seeds}) == len(seeds)


@pytest.mark.parametrize(
    "kwargs, dtype, error, message",
    [
        (
            dict(stochastic_rounding=True),
            torch.float16,
            ValueError,
            "needs bfloat16 params.*model.bfloat16",
        ),
        (dict(stochastic_rounding=True), torch.float32, ValueError, "needs bfloat16 params"),
        (
            dict(stochastic_rounding=True, master_weights=True),
            torch.bfloat16,
            ValueError,
            "exclusive",
        ),
        (dict(master_weights=1), torch.bfloat16, TypeError, "master_weights must be True or False"),
    ],
)
def test_bad_rounding_options_are_rejected(kwargs, dtype, error, message) -> None:
    for info in ROUNDING_ROWS:
        with pytest.raises(error, match=message):
            info.make(make_model(dtype).parameters(), **kwargs)


def test_stochastic_rounding_on_a_param_group_added_later_is_checked_before_the_step() -> None:
    model = make_model(torch.bfloat16)
    opt = scaledoptim.AdamW(model[0].parameters(), stochastic_rounding=True)
    half = torch.nn.Parameter(torch.randn(3).half())
    opt.add_param_group(dict(params=[half]))
    half.grad = torch.ones(3).half()
    loss_of(model, 0).backward()
    before = snapshot(opt)
    with pytest.raises(ValueError, match="needs bfloat16"):
        opt.step()
    assert_bit_identical(before, snapshot(opt))


@pytest.mark.parametrize("info", ROUNDING_ROWS, ids=str)
def test_master_weights_survive_a_checkpoint_bit_exactly(info) -> None:
    model, opt = _bf16_model_and_opt(info, master_weights=True)
    loss_of(model, 0).backward()
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    model2, opt2 = _bf16_model_and_opt(info, master_weights=True)
    opt2.load_state_dict(torch.load(buffer))
    for p, p2 in zip(model.parameters(), model2.parameters()):
        a, b = opt.state[p]["master_param"], opt2.state[p2]["master_param"]
        assert b.dtype == torch.float32 and torch.equal(a, b)
