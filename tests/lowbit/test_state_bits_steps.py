"""Steps with 8-bit states, against float32 states and the protocol's guarantees, on both
backends (torch's ops; our kernels through the emulator): quality, the skip on overflow, the
clip, resume, host reads, every step form."""

from __future__ import annotations

import io
import math

import pytest
import torch

import scaledoptim
from scaledoptim.doctor.sync_free import no_host_reads
from scaledoptim.kernels import launch_config
from tests.support.lowbit import LOWBIT_ROWS, LinearCode, LowBitRow, regression_loss
from tests.support.training import assert_bit_identical, loss_of, make_model, snapshot

ROWS = [pytest.param(row, id=row.name) for row in LOWBIT_ROWS]


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch) -> None:
    """Chunks of 64 elements and blocks of 16 (the rows' ``block_size`` below): the test
    model's params cross block and chunk boundaries on the kernels."""
    monkeypatch.setattr(launch_config, "chunk_size", 64)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 300 steps of a small model: threads only contend
    yield
    torch.set_num_threads(threads)


def _scaled_steps(opt, model, steps, **kwargs):
    for step in range(steps):
        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
        _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale, **kwargs)
    return found_inf


@pytest.mark.parametrize("row", ROWS)
def test_quality_is_within_a_few_percent_of_float32_states(row: LowBitRow, one_thread) -> None:
    lowbit = regression_loss(lambda params: row.make(params))
    float32 = regression_loss(lambda params: row.make(params, state_bits=32))
    assert abs(lowbit / float32 - 1) < 0.03, (lowbit, float32)


#: The rows with a second moment (an unsigned state), whose linear code fails (Note [block-wise
#: codes]); Lion reads its momentum through a sign, and a linear code of it ends 1.2% from
#: float32 states here.
SECOND_MOMENT_ROWS = [
    pytest.param(row, id=row.name)
    for row in LOWBIT_ROWS
    if any(not code.signed for code in row.cls.lowbit_codes.values())
]


@pytest.mark.parametrize("row", SECOND_MOMENT_ROWS)
def test_a_planted_linear_code_fails_the_quality_test(
    row: LowBitRow, one_thread, monkeypatch
) -> None:
    linear = {name: LinearCode(code.signed) for name, code in row.cls.lowbit_codes.items()}
    monkeypatch.setattr(row.cls, "lowbit_codes", linear)
    lowbit = regression_loss(lambda params: row.make(params))
    float32 = regression_loss(lambda params: row.make(params, state_bits=32))
    assert not abs(lowbit / float32 - 1) < 0.03  # (a NaN loss fails it too)


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("row", ROWS)
def test_an_overflowing_step_leaves_codes_and_scales_bit_identical(row: LowBitRow) -> None:
    model = make_model()
    opt = row.make(model.parameters(), block_size=16)
    _scaled_steps(opt, model, 3)
    before = snapshot(opt)
    opt.zero_grad()
    scaledoptim.scale_outputs(loss_of(model, 3), opt.scale).backward()
    model[0].weight.grad[1, 2] = float("inf")
    _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert found_inf.item() == 1.0
    after = snapshot(opt)
    assert_bit_identical(before[:-3], after[:-3])  # all but the scale, which backed off


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("row", ROWS)
def test_clipping_in_the_step_is_the_split_form_with_clip_grad_norm(row: LowBitRow) -> None:
    """``opt.grad_norm`` is ``clip_grad_norm_`` of the unscaled grads, and the step with
    ``max_grad_norm`` is the split form that clips them (on the kernels, whose norm sums in
    another order, to float32 rounding: a code of the dithered rounding may land one step
    over)."""
    fused, split = make_model(), make_model()
    opt_fused = row.make(fused.parameters(), block_size=16)
    opt_split = row.make(split.parameters(), block_size=16)
    for step in range(3):
        for model, opt in ((fused, opt_fused), (split, opt_split)):
            opt.zero_grad()
            scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
        opt_fused.unscale_and_step(grads_scaled_by=opt_fused.scale, max_grad_norm=0.05)
        opt_split.unscale(grads_scaled_by=opt_split.scale)
        norm = torch.nn.utils.clip_grad_norm_(split.parameters(), 0.05)
        opt_split.step_after_unscale()
        assert opt_fused.grad_norm is not None and norm > 0.05  # it clips
        torch.testing.assert_close(opt_fused.grad_norm, norm, rtol=1e-6, atol=0)
    for fused_param, split_param in zip(fused.parameters(), split.parameters()):
        torch.testing.assert_close(fused_param, split_param, rtol=1e-5, atol=1e-7)
        for key, value in opt_fused.state[fused_param].items():
            expected = opt_split.state[split_param][key]
            if key.endswith("_codes"):
                steps = (value.int() - expected.int()).abs()
                assert steps.max() <= 1 and steps.float().mean() < 0.01
            else:
                torch.testing.assert_close(value, expected, rtol=1e-5, atol=0)


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("row", ROWS)
def test_a_resumed_run_is_bit_for_bit_the_same(row: LowBitRow) -> None:
    model = make_model()
    opt = row.make(model.parameters(), block_size=16)
    _scaled_steps(opt, model, 3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = make_model(seed=1)
    resumed.load_state_dict(saved["model"])
    opt_resumed = row.make(resumed.parameters(), block_size=16)
    opt_resumed.load_state_dict(saved["opt"])
    for step in range(3, 6):
        for m, o in ((model, opt), (resumed, opt_resumed)):
            o.zero_grad()
            scaledoptim.scale_outputs(loss_of(m, step), o.scale).backward()
            o.unscale_and_step(grads_scaled_by=o.scale)
    assert_bit_identical(snapshot(opt), snapshot(opt_resumed))


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("overflow", [False, True])
def test_a_step_performs_no_host_read(row: LowBitRow, overflow: bool) -> None:
    model = make_model()
    opt = row.make(model.parameters(), block_size=16)
    _scaled_steps(opt, model, 1)  # (the first step creates the state)
    opt.zero_grad()
    scaledoptim.scale_outputs(loss_of(model, 1), opt.scale).backward()
    if overflow:
        model[2].bias.grad[0] = float("nan")
    with no_host_reads():
        _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale, max_grad_norm=1.0)
    assert found_inf.item() == float(overflow)


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("row", ROWS)
def test_the_closure_form_and_the_gradscaler_step_as_unscale_and_step(row: LowBitRow) -> None:
    models = [make_model() for _ in range(3)]
    opts = [row.make(m.parameters(), block_size=16) for m in models]
    scaler = scaledoptim.GradScaler("cpu")
    for step in range(3):
        plain, with_closure, with_scaler = zip(models, opts)
        model, opt = plain
        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
        opt.unscale_and_step(grads_scaled_by=opt.scale)

        model, opt = with_closure

        def closure(S, model=model, opt=opt, step=step):
            opt.zero_grad()
            loss = loss_of(model, step)
            scaledoptim.scale_outputs(loss, S).backward()
            return loss

        opt.unscale_and_step(closure, grads_scaled_by=opt.scale)

        model, opt = with_scaler
        opt.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        scaler.step(opt)
        scaler.update()
    reference = snapshot(opts[0])[:-3]
    for opt in opts[1:]:
        assert_bit_identical(reference, snapshot(opt)[:-3])


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("rounding", ["master_weights", "stochastic_rounding"])
def test_bf16_params_with_master_weights_or_stochastic_rounding(row: LowBitRow, rounding) -> None:
    model = make_model(torch.bfloat16)
    opt = row.make(model.parameters(), block_size=16, **{rounding: True})
    first = loss_of(model, 0).item()
    _scaled_steps(opt, model, 8)
    assert loss_of(model, 0).item() < first
    state = opt.state[model[0].weight]
    assert state[f"{row.states[0]}_codes"].dtype == torch.uint8
    assert ("master_param" in state) == (rounding == "master_weights")
    assert all(math.isfinite(p.float().sum().item()) for p in model.parameters())
