"""The optimizers torch.optim lacks (Lion, LAMB) against float64 references written from their
formulas (tests/reference_optimizers.py), through the generic tests of the optimizer table, on
both backends; and the param rounding options (master_weights, stochastic_rounding) of every
fused optimizer."""

from __future__ import annotations

import io

import pytest
import test_closure
import test_dtypes
import test_layouts
import test_parity
import test_state_dict
import test_sync_free
import torch
from optimizer_table import OptimizerCase, assert_bit_identical, loss_of, make_model, snapshot
from reference_optimizers import LambReference, LionReference

import scaledoptim

pytestmark = pytest.mark.usefixtures("kernel_backend")

# Rows for tests/optimizer_table.py once its generic tests accept a non-torch.optim reference.
NEW_CASES = [
    OptimizerCase("lion", scaledoptim.Lion, LionReference, dict(lr=1e-3)),
    OptimizerCase("lion-wd-maximize", scaledoptim.Lion, LionReference,
                  dict(lr=1e-3, betas=(0.8, 0.95), weight_decay=0.5, maximize=True)),
    OptimizerCase("lamb", scaledoptim.LAMB, LambReference, dict(lr=1e-2)),
    OptimizerCase("lamb-nvlamb-l2-no-averaging", scaledoptim.LAMB, LambReference,
                  dict(lr=1e-2, weight_decay=0.0, use_nvlamb=True, grad_averaging=False, max_grad_norm=0.5)),
    OptimizerCase("lamb-l2-no-clip-no-bias-correction", scaledoptim.LAMB, LambReference,
                  dict(lr=1e-2, weight_decay=0.1, adam_w_mode=False, max_grad_norm=0.0, bias_correction=False)),
]  # fmt: skip
ROUNDING = [dict(master_weights=True), dict(stochastic_rounding=True)]


@pytest.mark.parametrize("case", NEW_CASES, ids=str)
@pytest.mark.parametrize("form", ["unscale_and_step", "unscale+step_after_unscale"])
def test_trajectory_with_overflows_matches_gradscaler(case, form) -> None:
    test_parity.test_trajectory_matches_gradscaler(case, form)


@pytest.mark.parametrize("case", NEW_CASES, ids=str)
def test_plain_step_matches_the_reference(case) -> None:
    test_parity.test_plain_step_matches_torch(case)


@pytest.mark.parametrize("case", NEW_CASES, ids=str)
@pytest.mark.parametrize("dtype", test_dtypes.DTYPES, ids=str)
@pytest.mark.parametrize("path", ["step", "unscale_and_step"])
def test_every_dtype_matches_the_reference_rounded_once(case, dtype, path) -> None:
    test_dtypes.test_every_path_and_dtype_matches_the_fp32_reference(case, dtype, path)


@pytest.mark.parametrize("case", NEW_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_is_bit_identical(case, dtype) -> None:
    test_state_dict.test_resume_from_checkpoint_is_bit_identical(case, dtype)


@pytest.mark.parametrize("case", NEW_CASES[:1], ids=str)
def test_closure_replays(case) -> None:
    test_closure.test_step_after_unscale_closure_form_replays(case)
    test_closure.test_closure_that_never_becomes_finite_raises_and_changes_nothing(case)


@pytest.mark.parametrize("case", NEW_CASES[:1], ids=str)
def test_transposed_grads_and_channels_last(case) -> None:
    test_layouts.test_transposed_grad_is_applied_element_for_element(case)
    test_layouts.test_channels_last_params_step_like_contiguous_ones(case)


@pytest.mark.parametrize("case", NEW_CASES[:1], ids=str)
@pytest.mark.parametrize("overflow", [False, True])
def test_no_host_read(case, overflow) -> None:
    test_sync_free.test_unscale_and_step_performs_no_host_read(case, overflow)


# ------------------------------------------------------------------ the param rounding options
ALL_OPTIMIZERS = [
    OptimizerCase("adamw", scaledoptim.AdamW, torch.optim.AdamW, dict(lr=1e-2)),
    OptimizerCase("sgd-momentum", scaledoptim.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    OptimizerCase(
        "adagrad",
        scaledoptim.Adagrad,
        torch.optim.Adagrad,
        dict(lr=0.1, initial_accumulator_value=0.1),
    ),
    *NEW_CASES[:1],
    NEW_CASES[2],
]


def _bf16_model_and_opt(case, **rounding):
    model = make_model(torch.bfloat16)
    return model, case.ours(model.parameters(), **case.kwargs, **rounding).configure_scaling(
        init_scale=2.0**8, growth_interval=3
    )


@pytest.mark.parametrize("case", ALL_OPTIMIZERS, ids=str)
@pytest.mark.parametrize("rounding", ROUNDING, ids=lambda r: next(iter(r)))
def test_rounding_resume_is_bit_identical(case, rounding) -> None:
    case = OptimizerCase(case.name, case.ours, case.reference, {**case.kwargs, **rounding})
    test_state_dict.test_resume_from_checkpoint_is_bit_identical(case, torch.bfloat16)


@pytest.mark.parametrize("case", ALL_OPTIMIZERS, ids=str)
def test_master_weights_keep_an_fp32_master_and_round_the_param_from_it(case) -> None:
    model, opt = _bf16_model_and_opt(case, master_weights=True)
    fp32_model = make_model(torch.bfloat16).float()  # the same start, exactly
    fp32_opt = case.ours(fp32_model.parameters(), **case.kwargs).configure_scaling(
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


@pytest.mark.parametrize("case", ALL_OPTIMIZERS, ids=str)
@pytest.mark.parametrize("rounding", ROUNDING, ids=lambda r: next(iter(r)))
def test_a_skipped_step_touches_neither_param_nor_master(case, rounding) -> None:
    model, opt = _bf16_model_and_opt(case, **rounding)
    for step in range(3):
        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
        if step == 2:
            before = snapshot(opt)[:-3]  # params and state; the scale backs off
            model[0].weight.grad.view(-1)[0] = float("nan")
        _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
    assert found_inf.item() == 1.0
    assert_bit_identical(before, snapshot(opt)[:-3])


def test_fp32_params_ignore_master_weights() -> None:
    model = make_model()
    opt = scaledoptim.AdamW(model.parameters(), master_weights=True)
    loss_of(model, 0).backward()
    opt.step()
    assert all("master_param" not in s for s in opt.state.values())


@pytest.mark.parametrize("case", NEW_CASES[:2], ids=str)
def test_stochastic_rounding_gives_the_same_bits_on_both_backends(case, monkeypatch) -> None:
    """Where both backends compute the same fp32 update (Lion), they round it to the same bits:
    the hash is the same integer function (Adam's, SGD's, Adagrad's and LAMB's fp32 updates
    differ by an ulp here and there between torch's ops and our kernels; tests/kernels/test_emulated_rounding.py
    shows the rounding itself identical for every kernel)."""
    runs = []
    for mode in ("torch", "emulate"):
        monkeypatch.setenv("SCALEDOPTIM_KERNELS", mode)
        model, opt = _bf16_model_and_opt(case, stochastic_rounding=True)
        for step in range(4):
            opt.zero_grad()
            scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
            opt.unscale_and_step(grads_scaled_by=opt.scale)
        runs.append(snapshot(opt))
    assert_bit_identical(*runs)


def test_stochastic_rounding_is_reproducible_and_seeded_per_param() -> None:
    def run():
        model, opt = _bf16_model_and_opt(ALL_OPTIMIZERS[0], stochastic_rounding=True)
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
    for case in ALL_OPTIMIZERS:
        with pytest.raises(error, match=message):
            case.ours(make_model(dtype).parameters(), **case.kwargs, **kwargs)


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


def test_master_weights_survive_a_checkpoint_bit_exactly() -> None:
    model, opt = _bf16_model_and_opt(ALL_OPTIMIZERS[0], master_weights=True)
    loss_of(model, 0).backward()
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    model2, opt2 = _bf16_model_and_opt(ALL_OPTIMIZERS[0], master_weights=True)
    opt2.load_state_dict(torch.load(buffer))
    for p, p2 in zip(model.parameters(), model2.parameters()):
        a, b = opt.state[p]["master_param"], opt2.state[p2]["master_param"]
        assert b.dtype == torch.float32 and torch.equal(a, b)
