"""``scaledoptim.GradScaler``: torch.amp.GradScaler's object, with the scale in the optimizers,
for the frameworks that pass a scaler object around (Note [GradScaler facade]).

Each run here is compared with ``torch.amp.GradScaler`` driving the matching torch optimizer:
same scales, same skipped iterations, same params within kernel rounding (bit for bit on torch's
fused ops).
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch

import scaledoptim
from scaledoptim.doctor.sync_free import HostRead, no_host_reads

pytestmark = pytest.mark.usefixtures("kernel_backend")


STEPS = 10
OVERFLOWS = {2, 3, 7}  # iterations whose loss overflows in backward
UNSCALE_AT = {1, 3, 4, 8}  # iterations that unscale_ and clip before step
GROWTH_INTERVAL = 3

PAIRS = {
    "AdamW": (
        lambda p: scaledoptim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    ),
    "Adam": (
        lambda p: scaledoptim.Adam(p, lr=1e-2, amsgrad=True),
        lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, fused=True),
    ),
    "SGD": (
        lambda p: scaledoptim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    ),
    "with_scaling(RMSprop)": (
        lambda p: scaledoptim.with_scaling(torch.optim.RMSprop)(p, lr=1e-2),
        lambda p: torch.optim.RMSprop(p, lr=1e-2),
    ),
}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(12, 6, generator=gen), torch.randn(12, 2, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x), y)
    return loss * 1e38 if step in OVERFLOWS else loss  # 1e38 * S overflows float32


def _iteration(model, opt, scaler, step: int) -> None:
    opt.zero_grad()
    scaler.scale(_loss(model, step)).backward()
    if step in UNSCALE_AT:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(opt)
    scaler.update()


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_close(ours, theirs, exact: bool) -> None:
    for a, b in zip(ours, theirs):
        if exact:
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _exact(name: str, kernel_backend: str) -> bool:
    # torch's fused ops run both sides on torch-native; our kernels, or torch's foreach SGD /
    # single-tensor RMSprop against our fused SGD, round differently.
    return kernel_backend == "torch-native" and name in ("AdamW", "Adam")


@pytest.mark.parametrize("name", list(PAIRS))
def test_the_trajectory_is_torch_gradscalers(name, kernel_backend) -> None:
    ours_cls, torch_cls = PAIRS[name]
    model, reference = _model(), _model()
    opt, torch_opt = ours_cls(model.parameters()), torch_cls(reference.parameters())
    scaler = scaledoptim.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    torch_scaler = torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    scales = []
    for step in range(STEPS):
        before, torch_before = _params(model), _params(reference)
        _iteration(model, opt, scaler, step)
        _iteration(reference, torch_opt, torch_scaler, step)
        skipped = all(torch.equal(a, b) for a, b in zip(before, _params(model)))
        torch_skipped = all(torch.equal(a, b) for a, b in zip(torch_before, _params(reference)))
        assert skipped == torch_skipped == (step in OVERFLOWS), step
        assert scaler.get_scale() == torch_scaler.get_scale(), step
        # One place: the optimizer's scale is the scaler's, and its checkpoint carries it.
        assert opt.scale is scaler._get_scale_async()
        assert opt.state_dict()["loss_scale"]["scale"].item() == scaler.get_scale()
        _assert_close(_params(model), _params(reference), _exact(name, kernel_backend))
        scales.append(scaler.get_scale())
    assert scaler.state_dict() == torch_scaler.state_dict()
    assert scales[-1] != 2.0**16 and len(set(scales)) > 2  # it backed off and grew


def test_two_optimizers_skip_on_their_own_grads_and_back_off_once(kernel_backend) -> None:
    def run(make_a, make_b, scaler):
        model_a, model_b = _model(0), _model(1)
        opt_a, opt_b = make_a(model_a.parameters()), make_b(model_b.parameters())
        history = []
        for step in range(6):
            for opt in (opt_a, opt_b):
                opt.zero_grad()
            loss = _loss(model_a, 0) + _loss(model_b, 1)  # never overflows by itself
            scaler.scale(loss).backward()
            if step in (1, 4):  # only a's grads overflow
                next(model_a.parameters()).grad[0, 0] = float("inf")
            before = (_params(model_a), _params(model_b))
            if step == 4:
                scaler.unscale_(opt_b)
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
            moved_a = not all(torch.equal(x, y) for x, y in zip(before[0], _params(model_a)))
            moved_b = not all(torch.equal(x, y) for x, y in zip(before[1], _params(model_b)))
            history.append((moved_a, moved_b, scaler.get_scale()))
        return history, (model_a, model_b), (opt_a, opt_b)

    ours, (ours_a, ours_b), (opt_a, opt_b) = run(
        PAIRS["AdamW"][0], PAIRS["SGD"][0], scaledoptim.GradScaler("cpu", growth_interval=2)
    )
    theirs, (ref_a, ref_b), _ = run(
        PAIRS["AdamW"][1], PAIRS["SGD"][1], torch.amp.GradScaler("cpu", growth_interval=2)
    )
    assert ours == theirs
    assert [moved for moved, _, _ in ours] == [True, False, True, True, False, True]
    assert all(moved for _, moved, _ in ours)  # b steps on its own clean grads
    assert [s for _, _, s in ours] == [2.0**16, 2.0**15, 2.0**15, 2.0**16, 2.0**15, 2.0**15]
    assert opt_a.scale is opt_b.scale
    exact = kernel_backend == "torch-native"
    _assert_close(_params(ours_a), _params(ref_a), exact)
    _assert_close(_params(ours_b), _params(ref_b), exact=False)


def test_the_patch_catches_host_reads_and_restores_torch() -> None:
    before = dict(vars(torch.Tensor))
    with no_host_reads(), pytest.raises(HostRead, match="host read"):
        bool(torch.ones(()))
    assert dict(vars(torch.Tensor)) == before


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD"])
@pytest.mark.parametrize("unscale", [False, True], ids=["step", "unscale_+step"])
def test_scale_unscale_step_and_update_never_read_the_host(name, unscale) -> None:
    model = _model()
    opt = PAIRS[name][0](model.parameters())
    scaler = scaledoptim.GradScaler("cpu", growth_interval=2)
    for step in range(5):
        opt.zero_grad()
        loss = _loss(model, step)
        with no_host_reads():
            scaled = scaler.scale(loss)
        scaled.backward()
        with no_host_reads():
            if unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() == 2.0**15  # grown after 0 and 1, backed off at 2 and 3


# ---------------------------------------------------------------------------- checkpoints
def _checkpoint(model, opt, scaler) -> bytes:
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()},
        buffer,
    )
    return buffer.getvalue()


def _load(data: bytes) -> dict:
    return torch.load(io.BytesIO(data))  # weights_only: the scaler's state is plain data


def test_torch_gradscaler_resumes_from_ours_as_ours_continues(kernel_backend) -> None:
    model = _model()
    opt = PAIRS["AdamW"][0](model.parameters())
    scaler = scaledoptim.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    for step in range(5):
        _iteration(model, opt, scaler, step)
    checkpoint = _load(_checkpoint(model, opt, scaler))

    resumed = _model(seed=7)
    resumed.load_state_dict(checkpoint["model"])
    # (torch's default AdamW: the saved param groups say fused=None, which a load keeps.)
    torch_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2, weight_decay=0.1)
    torch_opt.load_state_dict(checkpoint["opt"])
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(checkpoint["scaler"])
    for step in range(5, STEPS):
        _iteration(model, opt, scaler, step)
        _iteration(resumed, torch_opt, torch_scaler, step)
        assert torch_scaler.get_scale() == scaler.get_scale() == opt.scale.item(), step
        _assert_close(_params(resumed), _params(model), exact=False)
    assert torch_scaler.state_dict() == scaler.state_dict()


def test_ours_resumes_from_torch_gradscaler_as_torch_continues(kernel_backend) -> None:
    ours_cls, torch_cls = PAIRS["AdamW"]
    reference = _model()
    torch_opt = torch_cls(reference.parameters())
    torch_scaler = torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    for step in range(5):
        _iteration(reference, torch_opt, torch_scaler, step)
    checkpoint = _load(_checkpoint(reference, torch_opt, torch_scaler))

    model = _model(seed=7)
    model.load_state_dict(checkpoint["model"])
    opt = ours_cls(model.parameters())
    opt.load_state_dict(checkpoint["opt"])
    scaler = scaledoptim.GradScaler("cpu")
    scaler.load_state_dict(checkpoint["scaler"])
    assert scaler.state_dict() == torch_scaler.state_dict()
    for step in range(5, STEPS):
        _iteration(reference, torch_opt, torch_scaler, step)
        _iteration(model, opt, scaler, step)
        assert scaler.get_scale() == torch_scaler.get_scale() == opt.scale.item(), step
        _assert_close(_params(model), _params(reference), exact=kernel_backend == "torch-native")
    assert scaler.state_dict() == torch_scaler.state_dict()


def test_the_optimizers_checkpoint_carries_the_scalers_scale() -> None:
    """A resume that loads both (in either order) continues exactly; one that loads only the
    optimizer into a fresh scaler is warned that the checkpointed scale is dropped."""
    model = _model()
    opt = PAIRS["AdamW"][0](model.parameters())
    scaler = scaledoptim.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    for step in range(5):
        _iteration(model, opt, scaler, step)
    data = _checkpoint(model, opt, scaler)
    for order in ("opt-first", "scaler-first"):
        checkpoint = _load(data)
        resumed = _model(seed=7)
        resumed.load_state_dict(checkpoint["model"])
        resumed_opt = PAIRS["AdamW"][0](resumed.parameters())
        resumed_scaler = scaledoptim.GradScaler("cpu")
        loads = [(resumed_opt, checkpoint["opt"]), (resumed_scaler, checkpoint["scaler"])]
        for target, state in loads if order == "opt-first" else loads[::-1]:
            target.load_state_dict(state)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _iteration(resumed, resumed_opt, resumed_scaler, 5)
        assert resumed_scaler.get_scale() == resumed_opt.scale.item()
    fresh_model = _model()
    fresh = PAIRS["AdamW"][0](fresh_model.parameters())
    fresh.load_state_dict(_load(data)["opt"])
    with pytest.warns(UserWarning, match="scaler's state_dict too"):
        _iteration(fresh_model, fresh, scaledoptim.GradScaler("cpu"), 5)


BAD_STATES = {
    "empty": ({}, RuntimeError, "empty"),
    "missing key": ({"scale": 1024.0, "growth_factor": 2.0}, ValueError, "missing"),
    "unknown key": (
        dict(
            scale=8.0,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=10,
            _growth_tracker=0,
            hysteresis=2,
        ),
        ValueError,
        "unknown",
    ),
    "tensor scale": (
        dict(
            scale=torch.tensor(8.0),
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=10,
            _growth_tracker=0,
        ),
        TypeError,
        "scale",
    ),
    "inf scale": (
        dict(
            scale=float("inf"),
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=10,
            _growth_tracker=0,
        ),
        ValueError,
        "scale",
    ),
    "zero scale": (
        dict(
            scale=0.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=10, _growth_tracker=0
        ),
        ValueError,
        "scale",
    ),
    "growth factor below one": (
        dict(
            scale=8.0, growth_factor=0.5, backoff_factor=0.5, growth_interval=10, _growth_tracker=0
        ),
        ValueError,
        "growth_factor",
    ),
    "negative tracker": (
        dict(
            scale=8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=10, _growth_tracker=-1
        ),
        ValueError,
        "_growth_tracker",
    ),
    "a GradScaler": (torch.amp.GradScaler("cpu"), TypeError, "state"),
}


@pytest.mark.parametrize("bad", list(BAD_STATES))
def test_a_bad_state_dict_is_refused_and_changes_nothing(bad) -> None:
    state, error, match = BAD_STATES[bad]
    model = _model()
    opt = PAIRS["AdamW"][0](model.parameters())
    scaler = scaledoptim.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    for step in range(4):
        _iteration(model, opt, scaler, step)
    before, opt_scale = scaler.state_dict(), opt.state_dict()["loss_scale"]
    with pytest.raises(error, match=match):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before
    after = opt.state_dict()["loss_scale"]
    assert (
        torch.equal(after["scale"], opt_scale["scale"]) and after["config"] == opt_scale["config"]
    )
    assert torch.equal(after["growth_tracker"], opt_scale["growth_tracker"])
    _iteration(model, opt, scaler, 4)  # still usable


def test_pickled_and_copied_scalers_continue_as_the_original() -> None:
    model = _model()
    opt = PAIRS["AdamW"][0](model.parameters())
    scaler = scaledoptim.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    for step in range(4):
        _iteration(model, opt, scaler, step)
    restored = pickle.loads(pickle.dumps(scaler))
    assert restored.state_dict() == scaler.state_dict() and restored.is_enabled()
    twin_model, twin_opt, twin_scaler = copy.deepcopy((model, opt, scaler))
    for step in range(4, STEPS):
        _iteration(model, opt, scaler, step)
        _iteration(twin_model, twin_opt, twin_scaler, step)
        assert twin_scaler.get_scale() == scaler.get_scale() == twin_opt.scale.item()
        _assert_close(_params(twin_model), _params(model), exact=True)
    assert twin_opt.scale is not opt.scale
    opt.zero_grad()
    scaler.scale(_loss(model, 0)).backward()
    scaler.unscale_(opt)
    with pytest.raises(AssertionError, match="pickled"):  # as torch: not mid-iteration
        pickle.dumps(scaler)


def test_disabled_it_passes_everything_through() -> None:
    model, reference = _model(), _model()
    opt = PAIRS["AdamW"][0](model.parameters())
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    scaler = scaledoptim.GradScaler("cpu", enabled=False)
    for _ in range(3):
        loss = _loss(model, 0)
        assert scaler.scale(loss) is loss
        opt.zero_grad()
        loss.backward()
        scaler.unscale_(opt)
        assert scaler.step(opt) is None
        scaler.update()
        torch_opt.zero_grad()
        _loss(reference, 0).backward()
        torch_opt.step()
    _assert_close(_params(model), _params(reference), exact=False)
    assert not scaler.is_enabled() and scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    scaler.load_state_dict({"anything": 1})  # a no-op, as torch's
    assert opt.scale.item() == 2.0**16  # the optimizer's own scale was never involved


def test_it_scales_nested_lists_tuples_and_dicts() -> None:
    scaler = scaledoptim.GradScaler("cpu", init_scale=4.0)
    a, b, c = torch.ones(2), torch.full((3,), 2.0), torch.tensor([0.5], dtype=torch.float16)
    out = scaler.scale({"a": a, "rest": [b, (c, None)]})
    assert isinstance(out, dict) and set(out) == {"a", "rest"}
    assert torch.equal(out["a"], a * 4) and torch.equal(out["rest"][0], b * 4)
    assert out["rest"][1][0].dtype == torch.float16 and out["rest"][1][0].item() == 2.0
    assert out["rest"][1][1] is None
    assert torch.equal(
        scaler.scale([a, b])[1], torch.amp.GradScaler("cpu", init_scale=4.0).scale([a, b])[1]
    )


def test_getters_and_setters_move_the_one_scale() -> None:
    model = _model()
    opt = PAIRS["AdamW"][0](model.parameters())
    scaler = scaledoptim.GradScaler("cpu", init_scale=1024.0, growth_interval=5)
    assert scaler.get_scale() == 1024.0 and scaler.get_growth_interval() == 5
    scaler.set_growth_interval(1)
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    _iteration(model, opt, scaler, 0)  # clean: grows by 4 at once
    assert opt.state_dict()["loss_scale"]["config"]["growth_interval"] == 1
    assert scaler.get_scale() == opt.scale.item() == 4096.0
    _iteration(model, opt, scaler, 2)  # overflow: backs off by 4
    assert scaler.get_scale() == 1024.0
    scaler.update(new_scale=64.0)
    assert opt.scale.item() == 64.0
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_growth_factor(0.5)
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale=0.0)
    assert scaler.get_growth_factor() == 4.0 and scaler.get_backoff_factor() == 0.25


def test_an_optimizer_it_steps_refuses_its_own_protocol_and_a_plain_step_on_scaled_grads() -> None:
    model = _model()
    opt = PAIRS["AdamW"][0](model.parameters())
    scaler = scaledoptim.GradScaler("cpu")
    _iteration(model, opt, scaler, 0)
    opt.zero_grad()
    scaler.scale(_loss(model, 1)).backward()
    before = _params(model)
    with pytest.raises(RuntimeError, match=r"scaler\.step\(opt\)"):
        opt.step()  # forgot scaler.step: the grads are scaled
    with pytest.raises(RuntimeError, match=r"scaler\.step\(opt\)"):
        opt.unscale_and_step(grads_scaled_by=opt.scale)
    _assert_close(_params(model), before, exact=True)
    scaler.step(opt)
    scaler.update()


def test_a_plain_torch_optimizer_gets_torch_gradscaler_exactly() -> None:
    model, reference = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    scaler = scaledoptim.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    torch_scaler = torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    for step in range(STEPS):
        _iteration(model, opt, scaler, step)
        _iteration(reference, torch_opt, torch_scaler, step)
        assert scaler.get_scale() == torch_scaler.get_scale()
        _assert_close(_params(model), _params(reference), exact=True)


@pytest.mark.parametrize("name", ["AdamW", "with_scaling(RMSprop)"])
def test_torch_gradscaler_driving_a_scaledoptim_optimizer_warns_once_and_steps_right(
    name, kernel_backend
) -> None:
    ours_cls, torch_cls = PAIRS[name]
    model, reference = _model(), _model()
    opt, torch_opt = ours_cls(model.parameters()), torch_cls(reference.parameters())
    scaler = torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    torch_scaler = torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    with pytest.warns(UserWarning, match="scaledoptim.GradScaler") as record:
        for step in range(STEPS):
            before = _params(model)
            _iteration(model, opt, scaler, step)
            _iteration(reference, torch_opt, torch_scaler, step)
            skipped = all(torch.equal(a, b) for a, b in zip(before, _params(model)))
            assert skipped == (step in OVERFLOWS)
            _assert_close(_params(model), _params(reference), _exact(name, kernel_backend))
    assert len([w for w in record if "torch.amp.GradScaler steps" in str(w.message)]) == 1
    assert opt.scale.item() == 2.0**16  # what the warning says: not the scale in use


def test_lightning_still_sees_an_optimizer_that_lets_the_scaler_unscale() -> None:
    """Lightning asks ``_step_supports_amp_scaling`` to decide whether the optimizer "unscales
    internally" (and then refuses gradient clipping); only torch's GradScaler.step gets yes."""
    opt = scaledoptim.AdamW(_model().parameters())
    assert getattr(opt, "_step_supports_amp_scaling", False) is False
    fused = scaledoptim.with_scaling(torch.optim.AdamW)(_model().parameters(), fused=True)
    assert fused._step_supports_amp_scaling is True  # torch's own answer for its fused step
