"""Drop-in fidelity: wherever a user can tell, scaledoptim behaves like torch.optim + GradScaler.

One test (or parametrised group) per item of the fidelity list: memory layouts of state, scales
float32 cannot invert, step hooks/profiler/schedulers, pickling, old checkpoints, load hooks,
resuming a shared scale, params torch accepts, torch-style closures, corrupt state sizes.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import warnings

import pytest
import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import scaledoptim
from scaledoptim.testing.optim_db import Config, OptimInfo, row
from tests.support.training import assert_bit_identical, loss_of, make_model, snapshot

# (row, config) pairs of optim_db, by name: each item compares with the row's torch.optim class.
Case = tuple[OptimInfo, Config]
ADAMW: Case = (row("AdamW"), row("AdamW").default)
ADAM: Case = (row("Adam"), row("Adam").config("wd"))
ADAM_AMSGRAD: Case = (row("Adam"), row("Adam").config("amsgrad-betas-wd"))
SGD_MOMENTUM: Case = (row("SGD"), row("SGD").config("momentum-wd"))


def _id(case: Case) -> str:
    return f"{case[0].name}-{case[1].name}"


def _ours(case: Case, params):
    return case[0].make(params, case[1])


def _theirs(case: Case, params):
    return case[0].reference_for(params, case[1])


def _state_key(case: Case) -> str:
    """The first per-param state entry of the case's optimizer."""
    opt = _ours(case, [torch.nn.Parameter(torch.zeros(1))])
    return next(key for key in opt.state_keys(opt.param_groups[0]) if key is not None)


def _conv_pair(case, seed=0):
    torch.manual_seed(seed)
    ours = torch.nn.Conv2d(3, 4, 3)
    ref = copy.deepcopy(ours)
    return ours, ref, _ours(case, ours.parameters()), _theirs(case, ref.parameters())


def _conv_backward(model, opt, step):
    opt.zero_grad()
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(step))
    loss = (
        model(x.to(memory_format=torch.channels_last) if _is_channels_last(model) else x)
        .tanh()
        .sum()
    )
    if isinstance(opt, scaledoptim.Optimizer):
        loss = scaledoptim.scale_outputs(loss, opt.scale)
    loss.backward()


def _is_channels_last(model) -> bool:
    weight = model.weight
    return weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()


def _close(ours, ref) -> None:
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _bits_equal(model_a, model_b) -> bool:
    return all(torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters()))


# ---------------------------------------------------------------- 1. state in another layout
def _layout_run(case, switch_at):
    """Steps a 4-D param (and torch.optim a copy) with the same grads, switching both to
    channels_last before step ``switch_at``; returns (ours, torch's) after every step."""
    data = torch.randn(4, 3, 3, 5, generator=torch.Generator().manual_seed(0))
    ours, ref = torch.nn.Parameter(data.clone()), torch.nn.Parameter(data.clone())
    opt, ref_opt = _ours(case, [ours]), _theirs(case, [ref])
    trace = []
    for step in range(5):
        if step == switch_at:
            for param in (ours, ref):
                param.data = param.data.to(memory_format=torch.channels_last)
        grad = torch.randn(4, 3, 3, 5, generator=torch.Generator().manual_seed(step + 1))
        ours.grad = (
            (grad * 1024).to(memory_format=torch.channels_last)
            if step >= switch_at
            else grad * 1024
        )
        ref.grad = grad.clone()
        opt.unscale_and_step(grads_scaled_by=1024.0)
        ref_opt.step()
        trace.append((ours.detach().clone(), ref.detach().clone()))
    assert ours.is_contiguous(memory_format=torch.channels_last) == (switch_at < 5)
    for state in opt.state.values():
        for value in state.values():
            assert value.dim() != 4 or value.stride() == ours.stride()
    return trace


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("case", [ADAMW, SGD_MOMENTUM], ids=_id)
def test_item1_state_in_another_layout_steps_like_torch_optim(case, kernel_backend) -> None:
    """The param turns channels_last after the optimizer has state: every step equals
    torch.optim's. Our kernels walk storage flat, so there it is bit for bit the run that never
    changed layout (torch's CPU fused SGD rounds strided tensors differently, as torch.optim's
    own fused SGD does)."""
    switched, plain = _layout_run(case, switch_at=2), _layout_run(case, switch_at=99)
    for step, ((ours, ref), (ours_plain, _)) in enumerate(zip(switched, plain)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
        if kernel_backend == "emulated-kernels":
            assert torch.equal(ours, ours_plain), (
                f"step {step}: the layout change altered the update"
            )


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("case", [ADAMW, SGD_MOMENTUM], ids=_id)
def test_item1_contiguous_checkpoint_into_channels_last_model(case) -> None:
    ours, ref, opt, ref_opt = _conv_pair(case)
    for step in range(2):
        for model, optimizer in ((ours, opt), (ref, ref_opt)):
            _conv_backward(model, optimizer, step)
        opt.unscale_and_step(grads_scaled_by=opt.scale)
        ref_opt.step()
    saved, ref_saved = opt.state_dict(), ref_opt.state_dict()
    ours.to(memory_format=torch.channels_last)
    ref.to(memory_format=torch.channels_last)
    opt = _ours(case, ours.parameters())
    ref_opt = _theirs(case, ref.parameters())
    opt.load_state_dict(saved)
    ref_opt.load_state_dict(ref_saved)
    for step in range(2, 5):
        for model, optimizer in ((ours, opt), (ref, ref_opt)):
            _conv_backward(model, optimizer, step)
        opt.unscale_and_step(grads_scaled_by=opt.scale)
        ref_opt.step()
        _close(ours, ref)


# ---------------------------------------------------------------- 3. scales float32 cannot invert
@pytest.mark.parametrize("value", [0.0, 1e-45, 1e-39, 1e39, float("inf"), float("nan")])
@pytest.mark.parametrize("name", ["init_scale", "min_scale", "max_scale"])
def test_item3_configure_scaling_refuses_scales_without_a_float32_reciprocal(name, value) -> None:
    opt = scaledoptim.AdamW([torch.nn.Parameter(torch.randn(3))])
    before = snapshot(opt)
    kwargs = {name: value}
    if name == "init_scale":
        kwargs["min_scale"] = 1.0 if math.isnan(value) else min(value, 1.0)
    with pytest.raises(ValueError, match=rf"Invalid {name}.*float32"):
        opt.configure_scaling(**kwargs)
    with pytest.raises(ValueError, match=rf"Invalid {name}.*float32"):
        scaledoptim.ScalingConfig(**kwargs)
    assert_bit_identical(before, snapshot(opt))


def test_item3_smallest_normal_float32_still_is_a_valid_scale() -> None:
    tiny = torch.finfo(torch.float32).tiny
    opt = scaledoptim.AdamW([torch.nn.Parameter(torch.randn(3))])
    opt.configure_scaling(init_scale=tiny, min_scale=tiny)
    assert opt.scale.item() == tiny


@pytest.mark.parametrize("where", ["scale", "min_scale"])
def test_item3_a_checkpoint_with_a_subnormal_scale_is_refused(where) -> None:
    param = torch.nn.Parameter(torch.randn(3))
    opt = scaledoptim.AdamW([param])
    state_dict = opt.state_dict()
    loss_scale = state_dict["loss_scale"]
    loss_scale["config"] = dict(loss_scale["config"], min_scale=1e-45)
    if where == "scale":
        loss_scale["scale"] = torch.tensor(1e-44)
        loss_scale["config"]["init_scale"] = 1e-44
    fresh = scaledoptim.AdamW([param])
    before = snapshot(fresh)
    with pytest.raises(ValueError, match="float32"):
        fresh.load_state_dict(state_dict)
    assert_bit_identical(before, snapshot(fresh))


# ---------------------------------------------------------------- 5. hooks, profiler, schedulers
def _scaled_backward(param, opt, overflow=False):
    opt.zero_grad()
    scaledoptim.scale_outputs((param * 2).sum(), opt.scale).backward()
    if overflow:
        param.grad[0] = float("inf")


def _watched(opt):
    calls = []
    opt.register_step_pre_hook(lambda *args: calls.append("pre"))
    opt.register_step_post_hook(lambda *args: calls.append("post"))
    return calls


_STEPPERS = {
    "fused": lambda params: scaledoptim.AdamW(params, lr=0.1),
    "with_scaling": lambda params: scaledoptim.with_scaling(torch.optim.RMSprop)(params, lr=0.1),
    "patched": lambda params: scaledoptim.patch_optimizer(torch.optim.Adagrad(params, lr=0.1)),
}


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("overflow", [False, True], ids=["clean", "skipped-on-device"])
@pytest.mark.parametrize("kind", list(_STEPPERS))
def test_item5_step_hooks_fire_on_unscale_and_step(kind, overflow) -> None:
    """torch + GradScaler: ``scaler.step(opt)`` of a fused optimizer calls ``opt.step()`` even when
    it skips (found_inf rides into the kernel), so hooks fire then too; we do the same for every
    optimizer whose step skips on device (fused ones), and GenericStepPlan skips the call (as
    GradScaler does for the others) only when it reads found_inf on the host."""
    param = torch.nn.Parameter(torch.randn(4))
    opt = _STEPPERS[kind]([param])
    calls = _watched(opt)
    seen_global = []
    handles = [
        register_optimizer_step_pre_hook(lambda *a: seen_global.append("pre")),
        register_optimizer_step_post_hook(lambda *a: seen_global.append("post")),
    ]
    try:
        _scaled_backward(param, opt, overflow)
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    finally:
        for handle in handles:
            handle.remove()
    skipped_on_host = overflow and kind != "fused"
    assert calls == ([] if skipped_on_host else ["pre", "post"])
    assert seen_global == calls


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("kind", list(_STEPPERS))
def test_item5_the_profiler_records_an_optimizer_step(kind) -> None:
    param = torch.nn.Parameter(torch.randn(4))
    opt = _STEPPERS[kind]([param])
    _scaled_backward(param, opt)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    base = type(opt).__mro__[1].__name__ if kind != "fused" else type(opt).__name__
    names = {event.name for event in prof.events()}
    assert any(name.startswith("Optimizer.step#") and name.endswith(".step") for name in names), (
        names
    )
    assert (
        f"Optimizer.step#{type(opt).__name__}.step" in names
        or f"Optimizer.step#{base}.step" in names
    )


def _no_scheduler_warning(record) -> None:
    messages = [str(w.message) for w in record]
    assert not any("lr_scheduler.step()" in m for m in messages), messages


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("kind", list(_STEPPERS))
def test_item5_no_scheduler_warning_after_unscale_and_step(kind) -> None:
    param = torch.nn.Parameter(torch.randn(4))
    opt = _STEPPERS[kind]([param])
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            _scaled_backward(param, opt)
            opt.unscale_and_step(grads_scaled_by=opt.scale)
            scheduler.step()
    _no_scheduler_warning(record)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.25)


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("scaled", [True, False])
def test_item5_no_scheduler_warning_after_closure_replay(scaled) -> None:
    param = torch.nn.Parameter(torch.randn(4))
    opt = scaledoptim.AdamW([param], lr=0.1)
    lbfgs_param = torch.nn.Parameter(torch.randn(4))
    lbfgs = scaledoptim.LBFGS([lbfgs_param], lr=0.1, max_iter=3)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1) for o in (opt, lbfgs)]
    overflowed = []

    def closure_of(p):
        def closure(S):
            p.grad = None
            loss = (p * 2).sum()
            if S is None:
                loss.backward()
                return loss
            scaledoptim.scale_outputs(loss, S).backward()
            if not overflowed:  # the first evaluation overflows: a replay follows
                overflowed.append(True)
                p.grad[0] = float("inf")
            return loss

        return closure

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for o, p in ((opt, param), (lbfgs, lbfgs_param)):
            overflowed.clear()
            o.unscale_and_step(closure_of(p), grads_scaled_by=o.scale if scaled else None)
        for scheduler in schedulers:
            scheduler.step()
    _no_scheduler_warning(record)


# ---------------------------------------------------------------- 6. deepcopy, pickle, torch.save
def _trained(opt_factory, steps=3):
    model = make_model()
    opt = opt_factory(model.parameters()).configure_scaling(
        init_scale=256.0, growth_interval=3, hysteresis=2
    )
    _train(model, opt, range(steps))
    return model, opt


def _train(model, opt, steps):
    for step in steps:
        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
        if step % 4 == 1:
            model[2].bias.grad[0] = float("inf")
        opt.unscale_and_step(grads_scaled_by=opt.scale)


def _copies(model, opt):
    """(model, opt) copied three ways, as a user would: deepcopy, pickle, torch.save."""
    yield copy.deepcopy((model, opt))
    yield pickle.loads(pickle.dumps((model, opt)))
    buffer = io.BytesIO()
    torch.save((model, opt), buffer)
    buffer.seek(0)
    yield torch.load(buffer, weights_only=False)


_FACTORIES = {
    "adamw": lambda params: scaledoptim.AdamW(params, lr=1e-2),
    "sgd": lambda params: scaledoptim.SGD(params, lr=0.05, momentum=0.9),
    "with_scaling": lambda params: scaledoptim.with_scaling(torch.optim.RMSprop)(params, lr=1e-2),
    "patched": lambda params: scaledoptim.patch_optimizer(torch.optim.Adagrad(params, lr=1e-2)),
}


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("kind", list(_FACTORIES))
def test_item6_copies_keep_the_scale_and_step_bit_for_bit(kind) -> None:
    model, opt = _trained(_FACTORIES[kind])
    config = opt.scaling_state.loss_scale.config
    for copied_model, copied in _copies(model, opt):
        assert type(copied) is type(opt)
        assert copied.scaling_state.loss_scale.config == config
        assert_bit_identical(snapshot(opt), snapshot(copied))
        assert copied.scaling_state.process_group is None
        original = copy.deepcopy((model, opt))  # stepping the original would spoil later copies
        _train(original[0], original[1], range(3, 9))
        _train(copied_model, copied, range(3, 9))
        assert_bit_identical(snapshot(original[1]), snapshot(copied))
        assert _bits_equal(original[0], copied_model)


def test_item6_a_copy_of_a_sharer_gets_a_scale_of_its_own() -> None:
    a, b = (scaledoptim.AdamW([torch.nn.Parameter(torch.randn(3))]) for _ in range(2))
    scaledoptim.share_scale(a, b)
    copied = copy.deepcopy(a)
    assert copied.scale is not a.scale
    assert copied.scaling_state.loss_scale.sharers == 1
    assert torch.equal(copied.scale, a.scale)


# ---------------------------------------------------------------- 7. old checkpoints
_NEWER_KEYS = (
    "decoupled_weight_decay",
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
)


def _as_old_checkpoint(state_dict):
    """What an older torch (or scaledoptim) saved: fewer group options, int steps."""
    old = copy.deepcopy(state_dict)
    old.pop("loss_scale", None)
    for group in old["param_groups"]:
        for key in _NEWER_KEYS:
            group.pop(key, None)
    for state in old["state"].values():
        if "step" in state:
            state["step"] = int(state["step"].item())
    return old


def _two_models_trained(case, steps=3):
    model, ref = make_model(), make_model()
    opt, ref_opt = _ours(case, model.parameters()), _theirs(case, ref.parameters())
    for step in range(steps):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss_of(m, step).backward()
        opt.unscale_and_step()
        ref_opt.step()
    return model, ref, opt, ref_opt


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("case", [ADAMW, ADAM, SGD_MOMENTUM], ids=_id)
def test_item7_an_old_checkpoint_loads_and_steps_like_torch_optim(case) -> None:
    model, ref, opt, ref_opt = _two_models_trained(case)
    old = _as_old_checkpoint(ref_opt.state_dict())
    opt = _ours(case, model.parameters())
    ref_opt = _theirs(case, ref.parameters())
    opt.load_state_dict(copy.deepcopy(old))
    ref_opt.load_state_dict(copy.deepcopy(old))
    for key in _NEWER_KEYS:
        if key in ref_opt.param_groups[0]:
            assert opt.param_groups[0][key] == ref_opt.param_groups[0][key], key
    for step in range(3, 7):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss_of(m, step).backward()
        opt.unscale_and_step()
        ref_opt.step()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("kernel_backend")
def test_item7_an_adam_checkpoint_loaded_into_adamw_keeps_adamw_semantics() -> None:
    adam_case, adamw_case = ADAM, ADAMW
    _, _, adam, _ = _two_models_trained(adam_case)
    saved = adam.state_dict()
    assert saved["param_groups"][0]["decoupled_weight_decay"] is False
    model, ref = make_model(), make_model()
    opt = scaledoptim.AdamW(model.parameters(), **adam_case[1].kwargs)
    ref_opt = torch.optim.AdamW(ref.parameters(), **adam_case[1].kwargs)
    opt.load_state_dict(copy.deepcopy(saved))
    ref_opt.load_state_dict({k: v for k, v in copy.deepcopy(saved).items() if k != "loss_scale"})
    assert opt.param_groups[0]["decoupled_weight_decay"] is True
    assert ref_opt.param_groups[0]["decoupled_weight_decay"] is True
    for step in range(3, 6):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss_of(m, step).backward()
        opt.unscale_and_step()
        ref_opt.step()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    del adamw_case


# ---------------------------------------------------------------- 8. load_state_dict hooks
@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [ADAMW, SGD_MOMENTUM], ids=_id)
def test_item8_load_state_dict_hooks_see_what_torch_optims_see(case, dtype) -> None:
    model = make_model(dtype)
    opt = _ours(case, model.parameters())
    _train(model, opt, range(2))
    saved = opt.state_dict()
    fresh = _ours(case, model.parameters())
    seen = {}

    def pre_hook(optimizer, state_dict):
        seen["pre"] = len(state_dict["state"])

    def post_hook(optimizer):
        seen["post"] = len(optimizer.state)
        seen["dtypes"] = {
            v.dtype for s in optimizer.state.values() for k, v in s.items() if k != "step"
        }

    fresh.register_load_state_dict_pre_hook(pre_hook)
    fresh.register_load_state_dict_post_hook(post_hook)
    fresh.load_state_dict(saved)
    n_params = len(list(model.parameters()))
    assert seen["pre"] == seen["post"] == n_params
    assert seen["dtypes"] == {torch.float32}  # 16-bit params keep fp32 state, even in the hook
    assert_bit_identical(snapshot(opt), snapshot(fresh))


def test_item8_a_pre_hook_may_replace_the_state_dict() -> None:
    model = make_model()
    opt = scaledoptim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, range(2))
    saved = opt.state_dict()
    changed = copy.deepcopy(saved)
    changed["param_groups"][0]["lr"] = 0.5
    fresh = scaledoptim.AdamW(model.parameters(), lr=1e-2)
    fresh.register_load_state_dict_pre_hook(lambda optimizer, state_dict: changed)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["lr"] == 0.5


# ---------------------------------------------------------------- 9. resuming a shared scale
def _gan(seed=0):
    torch.manual_seed(seed)
    gen, disc = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opt_g = scaledoptim.AdamW(gen.parameters(), lr=1e-3).configure_scaling(
        init_scale=2.0**10, growth_interval=2
    )
    opt_d = scaledoptim.SGD(disc.parameters(), lr=1e-2, momentum=0.9)
    return gen, disc, opt_g, opt_d


def _gan_steps(gen, disc, opt_g, opt_d, steps):
    for step in steps:
        opt_g.zero_grad()
        opt_d.zero_grad()
        z = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        loss = -disc(gen(z)).mean() + disc(gen(z).detach()).mean()
        scaledoptim.scale_outputs(loss, opt_g.scale).backward()
        if step % 3 == 2:
            gen.bias.grad[0] = float("inf")
        opt_g.unscale_and_step(grads_scaled_by=opt_g.scale)
        opt_d.unscale_and_step(grads_scaled_by=opt_d.scale)


@pytest.mark.usefixtures("kernel_backend")
def test_item9_load_then_share_resumes_a_shared_scale_bit_for_bit() -> None:
    gen, disc, opt_g, opt_d = _gan()
    scaledoptim.share_scale(opt_g, opt_d)
    _gan_steps(gen, disc, opt_g, opt_d, range(5))
    saved = copy.deepcopy(
        (gen.state_dict(), disc.state_dict(), opt_g.state_dict(), opt_d.state_dict())
    )
    _gan_steps(gen, disc, opt_g, opt_d, range(5, 12))

    gen2, disc2, opt_g2, opt_d2 = _gan(seed=1)
    gen2.load_state_dict(saved[0])
    disc2.load_state_dict(saved[1])
    opt_g2.load_state_dict(saved[2])
    opt_d2.load_state_dict(saved[3])
    scaledoptim.share_scale(opt_g2, opt_d2)  # the documented order: load, then share
    _gan_steps(gen2, disc2, opt_g2, opt_d2, range(5, 12))
    assert_bit_identical(snapshot(opt_g), snapshot(opt_g2))
    assert_bit_identical(snapshot(opt_d), snapshot(opt_d2))
    assert opt_g2.scale is opt_d2.scale


@pytest.mark.usefixtures("kernel_backend")
def test_item9_an_iteration_aborted_between_sharers_does_not_wedge_the_next() -> None:
    gen, disc, opt_g, opt_d = _gan()
    scaledoptim.share_scale(opt_g, opt_d)
    _gan_steps(gen, disc, opt_g, opt_d, range(2))
    scale_before = opt_g.scale.clone()
    # iteration 2 aborts after opt_g unscaled (a data error, an exception in between)
    opt_g.zero_grad()
    opt_d.zero_grad()
    (disc(gen(torch.randn(8, 4))).mean()).backward()
    opt_g.unscale_and_step(grads_scaled_by=opt_g.scale)
    assert torch.equal(opt_g.scale, scale_before)  # the round is pending: the scale waits
    # the next iterations run normally (zero_grad() ended the abandoned round), and the scale
    # moves as in a run without the aborted iteration
    reference = _gan()
    scaledoptim.share_scale(reference[2], reference[3])
    _gan_steps(*reference, range(2))
    for step in range(3, 9):
        _gan_steps(gen, disc, opt_g, opt_d, [step])
        _gan_steps(*reference, [step])
        assert torch.equal(opt_g.scale, reference[2].scale), step
        assert torch.equal(
            opt_g.scaling_state.loss_scale.growth_tracker,
            reference[2].scaling_state.loss_scale.growth_tracker,
        )
    assert opt_g.scale is opt_d.scale


def test_item9_unscaling_twice_in_one_round_without_zero_grad_still_raises() -> None:
    gen, disc, opt_g, opt_d = _gan()
    scaledoptim.share_scale(opt_g, opt_d)
    disc(gen(torch.randn(8, 4))).mean().backward()
    opt_g.unscale_and_step(grads_scaled_by=opt_g.scale)
    disc(gen(torch.randn(8, 4))).mean().backward()
    with pytest.raises(RuntimeError, match="already unscaled in the current round"):
        opt_g.unscale_and_step(grads_scaled_by=opt_g.scale)


def test_item9_step_then_zero_grad_keeps_the_round() -> None:
    """``step(); zero_grad()`` per optimizer is a common order: the round must still count both."""
    gen, disc, opt_g, opt_d = _gan()
    scaledoptim.share_scale(opt_g, opt_d)
    before = opt_g.scale.clone()
    disc(gen(torch.randn(8, 4))).mean().backward()
    gen.bias.grad[0] = float("inf")
    opt_g.unscale_and_step(grads_scaled_by=opt_g.scale)
    opt_g.zero_grad()
    opt_d.unscale_and_step(grads_scaled_by=opt_d.scale)
    opt_d.zero_grad()
    assert opt_g.scale.item() == before.item() / 2  # opt_g's overflow moved the shared scale


# ---------------------------------------------------------------- 10. params torch accepts
@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("case", [ADAMW, SGD_MOMENTUM], ids=_id)
def test_item10_a_transposed_param_steps_like_torch_optim(case) -> None:
    data = torch.randn(7, 5)
    ours = torch.nn.Parameter(data.clone().t())
    ref = torch.nn.Parameter(data.clone().t())
    opt, ref_opt = _ours(case, [ours]), _theirs(case, [ref])
    for step in range(3):
        grad = torch.randn(5, 7, generator=torch.Generator().manual_seed(step))
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.unscale_and_step(grads_scaled_by=1.0)
        ref_opt.step()
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert ours.stride() == (1, 5)


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("case", [ADAMW, ADAM_AMSGRAD, SGD_MOMENTUM], ids=_id)
def test_item10_float64_params_step_like_torch_optim(case) -> None:
    """float64 params (next to float32 ones) step on every backend, as torch.optim's do."""
    torch.manual_seed(0)
    params = [
        torch.randn(5, dtype=torch.float64),
        torch.randn(3),
        torch.randn(4, dtype=torch.float64),
    ]
    ours = [torch.nn.Parameter(p.clone()) for p in params]
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    opt, ref_opt = _ours(case, ours), _theirs(case, ref)
    for step in range(4):
        for o, r in zip(ours, ref):
            grad = torch.randn(
                o.shape, dtype=o.dtype, generator=torch.Generator().manual_seed(step)
            )
            o.grad, r.grad = grad * 8, grad.clone()
            if step == 2:
                o.grad[0] = float("inf")
        _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=8.0)
        if step != 2:
            ref_opt.step()
        assert found_inf.item() == (1.0 if step == 2 else 0.0)
        for o, r in zip(ours, ref):
            assert o.dtype == r.dtype
            torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-7)


def _tensor_options(case):
    options = dict(case[1].kwargs)
    options["lr"] = torch.tensor(options["lr"])
    if "betas" in options or case[0].cls is not scaledoptim.SGD:
        options["betas"] = tuple(torch.tensor(b) for b in options.get("betas", (0.9, 0.999)))
    return options


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("case", [ADAMW, ADAM, SGD_MOMENTUM], ids=_id)
def test_item10_tensor_hyperparameters_are_accepted_like_torch_optim(case) -> None:
    model, ref = make_model(), make_model()
    opt = case[0].cls(model.parameters(), **_tensor_options(case))
    ref_opt = case[0].reference(ref.parameters(), **_tensor_options(case))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss_of(m, step).backward()
        opt.unscale_and_step()
        ref_opt.step()
        scheduler.step()
        ref_scheduler.step()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)


def test_item10_bad_tensor_hyperparameters_are_refused() -> None:
    param = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        scaledoptim.SGD([param], lr=torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        scaledoptim.AdamW([param], lr=torch.tensor(-1.0))
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        scaledoptim.AdamW([param], betas=(torch.tensor(0.9), torch.tensor(1.5)))


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: torch.nn.Parameter(torch.randn(4, 4).to_sparse()), RuntimeError, r"sparse"),
        (
            lambda: torch.nn.Parameter(torch.randn(3, dtype=torch.complex64)),
            TypeError,
            r"complex64.*does not support complex",
        ),
        (
            lambda: torch.nn.Parameter(torch.randn(4, 6)[:, ::2]),
            RuntimeError,
            r"view with gaps.*contiguous",
        ),
    ],
    ids=["sparse", "complex", "strided-view"],
)
def test_item10_unsupported_params_say_what_they_are(make, error, message) -> None:
    param = make()
    param.grad = param.detach().clone()
    with pytest.raises(error, match=message) as info:
        # Lion has no torch.optim implementation to take them (SGD's does: tests/optim/).
        scaledoptim.Lion([param], lr=0.1).unscale_and_step(grads_scaled_by=2.0)
    if param.layout != torch.strided:
        assert "view" not in str(info.value)


def test_item10_a_sparse_grad_is_refused_accurately() -> None:
    param = torch.nn.Parameter(torch.randn(4, 3))
    param.grad = torch.randn(4, 3).to_sparse()
    opt = scaledoptim.Lion([param], lr=0.1)  # SGD takes sparse grads, as torch.optim.SGD
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.unscale_and_step(grads_scaled_by=2.0)


# ---------------------------------------------------------------- 11. torch-style closures
@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("kind", ["adamw", "lbfgs"])
def test_item11_a_closure_without_arguments_works_unscaled(kind) -> None:
    model, ref = make_model(), make_model()
    make = {
        "adamw": (scaledoptim.AdamW, torch.optim.AdamW),
        "lbfgs": (scaledoptim.LBFGS, torch.optim.LBFGS),
    }[kind]
    opt, ref_opt = make[0](model.parameters(), lr=0.1), make[1](ref.parameters(), lr=0.1)

    def closure_of(m, o):
        def closure():
            o.zero_grad()
            loss = loss_of(m, 0)
            loss.backward()
            return loss

        return closure

    loss, found_inf, scale = opt.unscale_and_step(closure_of(model, opt))
    ref_loss = ref_opt.step(closure_of(ref, ref_opt))
    assert torch.equal(loss, ref_loss) and found_inf.item() == 0.0 and scale is None
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["unscale_and_step", "step_after_unscale"])
def test_item11_a_closure_without_arguments_given_a_scale_is_refused_first(method) -> None:
    model = make_model()
    opt = scaledoptim.AdamW(model.parameters(), lr=0.1)
    _train(model, opt, range(1))
    before = snapshot(opt)
    keyword = "grads_scaled_by" if method == "unscale_and_step" else "current_grad_scale"
    with pytest.raises(TypeError, match=r"closure\(S\)"):
        getattr(opt, method)(lambda: loss_of(model, 0), **{keyword: opt.scale})
    assert_bit_identical(before, snapshot(opt))


# ---------------------------------------------------------------- 14. state of the wrong size
def _wrong_state(kind, param):
    if kind == "wrong-size":
        return torch.zeros(4)
    return torch.zeros(param.numel()).reshape(param.shape[::-1])  # same numel, wrong shape


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("kind", ["wrong-size", "wrong-shape"])
@pytest.mark.parametrize("case", [ADAMW, SGD_MOMENTUM], ids=_id)
def test_item14_a_wrong_size_state_is_refused_on_load(case, kind) -> None:
    param = torch.nn.Parameter(torch.randn(3, 5))
    param.grad = torch.randn(3, 5)
    opt = _ours(case, [param])
    opt.unscale_and_step(grads_scaled_by=1.0)
    saved = opt.state_dict()
    key = _state_key(case)
    saved["state"][0][key] = _wrong_state(kind, param)
    fresh = _ours(case, [param])
    with pytest.raises(ValueError, match=r"Corrupt optimizer state_dict.*\(3, 5\)"):
        fresh.load_state_dict(saved)
    assert len(fresh.state) == 0


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("kind", ["wrong-size", "wrong-shape"])
@pytest.mark.parametrize("case", [ADAMW, SGD_MOMENTUM], ids=_id)
def test_item14_a_wrong_size_state_is_refused_at_step_time(case, kind) -> None:
    param = torch.nn.Parameter(torch.randn(3, 5))
    param.grad = torch.randn(3, 5)
    opt = _ours(case, [param])
    opt.unscale_and_step(grads_scaled_by=1.0)
    key = _state_key(case)
    opt.state[param][key] = _wrong_state(kind, param)  # edited after load
    before = snapshot(opt)
    for call in (opt.step, lambda: opt.unscale_and_step(grads_scaled_by=opt.scale)):
        with pytest.raises(
            ValueError, match=r"Corrupt optimizer state.*\(3, 5\).*opt.state\[p\].clear\(\)"
        ):
            call()
        assert_bit_identical(before, snapshot(opt))


@pytest.mark.usefixtures("kernel_backend")
@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "Adagrad"])
def test_a_fused_group_given_foreach_steps_fused_as_torch_optim(name) -> None:
    """torch.optim's constructor refuses ``fused=True`` with ``foreach=True``, but a group edited
    (or loaded) with both steps fused: so do ours, edited and loaded, to the same params."""
    results = []
    for cls in (getattr(torch.optim, name), getattr(scaledoptim, name)):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(5))
        opt = cls([p], lr=0.1, fused=True)
        with pytest.raises(RuntimeError, match="cannot be `True` together"):
            cls([torch.nn.Parameter(torch.randn(2))], lr=0.1, fused=True, foreach=True)
        opt.param_groups[0]["foreach"] = True
        for _ in range(2):
            p.grad = torch.randn(5)
            opt.step()
        state = opt.state_dict()
        opt.load_state_dict(state)  # a saved group with both flags loads
        p.grad = torch.randn(5)
        opt.step()
        results.append(p.detach().clone())
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-7)
