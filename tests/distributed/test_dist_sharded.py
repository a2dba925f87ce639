"""FSDP2 and tensor parallel on a gloo world of 2, one spawn for every scenario, on both backends:

* the loss scale through torch.distributed.checkpoint: ``get_optimizer_state_dict`` /
  ``set_optimizer_state_dict`` (sharded and full) carry it, so a resume with nothing saved
  beside is bit-identical, in the same world and resharded to one process (the last test, in
  the pytest process); a checkpoint that saved the scale beside (the old recipe) still loads;
* an overflow in one rank's shard, with no ``process_group``: every rank skips and backs off;
* FSDP2's ``MixedPrecisionPolicy`` (fp16 and bf16 compute, fp32 reduce) against torch.optim and
  ``torch.amp.GradScaler`` on the same sharded model;
* tensor parallel (``ColwiseParallel`` / ``RowwiseParallel``) for every elementwise fused
  optimizer, clean and with an overflow on one rank, against torch.optim and GradScaler.
"""

from __future__ import annotations

import copy
import functools
import pathlib

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world

import scaledoptim
from scaledoptim.doctor.sync_free import no_host_reads
from tests.support.references import kernels_mode
from tests.support.training import assert_bit_identical, loss_of, make_model

BACKENDS = ("torch", "emulate")
OPTIMIZERS = ("AdamW", "Adam", "SGD", "Adagrad", "RMSprop", "Lion")  # the elementwise ones
STEPS = 8
INJECTED = {1: 0, 2: 1, 3: 1, 6: 0}  # step -> the one rank whose shard overflows


def _scaled(opt: scaledoptim.Optimizer) -> scaledoptim.Optimizer:
    # No process_group: the params' mesh is what the ranks agree over.
    return opt.configure_scaling(init_scale=2.0**10, growth_interval=3, hysteresis=2)


def _gathered(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _fsdp2_model(**fully_shard_options):
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **fully_shard_options)
    fully_shard(model, **fully_shard_options)
    return model


def _scale_state(opt: scaledoptim.Optimizer) -> list[torch.Tensor]:
    loss_scale = opt._scaling().loss_scale
    return [loss_scale.scale, loss_scale.growth_tracker, loss_scale.hysteresis_tracker]


def _everything(opt: scaledoptim.Optimizer, view=_local) -> list[torch.Tensor]:
    """Params, per-param state (in param order) and the scale state, each through ``view``."""
    params = [p for group in opt.param_groups for p in group["params"]]
    state = [view(v).detach().clone() for p in params for v in opt.state[p].values()]
    return (
        [view(p).detach().clone() for p in params] + state + [t.clone() for t in _scale_state(opt)]
    )


def _train(model, opt, rank, steps, overflow=INJECTED):
    """Scaled steps; an inf in the injecting rank's shard of the first param's grad."""
    found, S = [], opt.scale
    for step in steps:
        opt.zero_grad()
        scaledoptim.scale_outputs(loss_of(model, step), S).backward()
        if overflow.get(step) == rank:
            _local(next(model.parameters()).grad).view(-1)[0] = float("inf")
        before = _everything(opt)[:-3]  # the scale state moves on a skipped step
        with no_host_reads():
            _, found_inf, S = opt.unscale_and_step(grads_scaled_by=S)
        found.append(found_inf.item())
        if found[-1]:
            assert_bit_identical(before, _everything(opt)[:-3])
    return found


# ---------------------------------------------------------------- found_inf without process_group
def _fsdp2_overflow_on_one_shard(backend: str, rank: int, world_size: int, tmp) -> None:
    with kernels_mode(backend):
        model = _fsdp2_model()
        opt = _scaled(scaledoptim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
        found = _train(model, opt, rank, range(STEPS))
    assert found == [float(step in INJECTED) for step in range(STEPS)]
    seen = _gathered((found, [t.item() for t in _scale_state(opt)]))
    assert seen[0] == seen[1]


# ---------------------------------------------------------------- the scale through DCP
def _dcp_resume(backend: str, full: bool, rank: int, world_size: int, tmp) -> None:
    """Save mid hysteresis with nothing beside the optimizer's own state_dict; resume in the
    same world bit for bit; leave the full values for the one-process resume to compare."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=full)

    def fresh():
        model = _fsdp2_model()
        return model, _scaled(scaledoptim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))

    with kernels_mode(backend):
        model, opt = fresh()
        _train(model, opt, rank, range(5))
        scale, growth_tracker, _ = (t.item() for t in _scale_state(opt))
        assert scale < 2.0**10 and growth_tracker == 1, "a resume that reset the scale shows"
        saved_full = _everything(opt, _full)
        optim_state = get_optimizer_state_dict(model, opt, options=options)
        model_state = get_model_state_dict(model, options=options)
        if full:  # as torch.save would: its plain tensors (step counters) are the live ones
            optim_state, model_state = copy.deepcopy((optim_state, model_state))
        else:
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
            if rank == 0:
                torch.save(saved_full, tmp / "full-values.pt")
        _train(model, opt, rank, range(5, STEPS))

        resumed_model, resumed_opt = fresh()
        if not full:
            model_state = get_model_state_dict(resumed_model)
            optim_state = get_optimizer_state_dict(resumed_model, resumed_opt)
            dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
        set_model_state_dict(resumed_model, model_state, options=options)
        set_optimizer_state_dict(resumed_model, resumed_opt, optim_state, options=options)
        assert_bit_identical(saved_full, _everything(resumed_opt, _full))
        assert all(set(g) == set(opt.param_groups[0]) for g in resumed_opt.param_groups)
        _train(resumed_model, resumed_opt, rank, range(5, STEPS))
    assert_bit_identical(_everything(opt), _everything(resumed_opt))


def _dcp_old_format_loads(rank: int, world_size: int, tmp) -> None:
    """A checkpoint of the old recipe: no scale in the optimizer's state, the scale beside."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def fresh():
        model = _fsdp2_model()
        return model, _scaled(scaledoptim.AdamW(model.parameters(), lr=1e-2))

    def old_checkpoint(model, opt):
        model_state, optim_state = get_state_dict(model, opt)
        for group in optim_state["param_groups"]:
            group.pop("loss_scale", None)  # as an older release wrote it
        return {"model": model_state, "optim": optim_state,
                "loss_scale": opt.state_dict()["loss_scale"]}  # fmt: skip

    model, opt = fresh()
    _train(model, opt, rank, range(5))
    dcp.save(old_checkpoint(model, opt), checkpoint_id=tmp)
    _train(model, opt, rank, range(5, STEPS))

    resumed_model, resumed_opt = fresh()
    state = old_checkpoint(resumed_model, resumed_opt)
    dcp.load(state, checkpoint_id=tmp)
    set_state_dict(
        resumed_model, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    resumed_opt.load_state_dict({**resumed_opt.state_dict(), "loss_scale": state["loss_scale"]})
    _train(resumed_model, resumed_opt, rank, range(5, STEPS))
    assert_bit_identical(_everything(opt), _everything(resumed_opt))


SCENARIOS = {
    **{
        f"fsdp2-overflow-no-group-{backend}": functools.partial(
            _fsdp2_overflow_on_one_shard, backend
        )
        for backend in BACKENDS
    },
    **{
        f"dcp-{'full' if full else 'sharded'}-{backend}": functools.partial(
            _dcp_resume, backend, full
        )
        for backend in BACKENDS
        for full in (False, True)
    },
    "dcp-old-format": _dcp_old_format_loads,
}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str | None], pathlib.Path]:
    tmp = pathlib.Path(tmp_path_factory.mktemp("sharded"))
    return run_world(2, SCENARIOS, tmp), tmp


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_sharded_scenario(world, scenario) -> None:
    failure = world[0][scenario]
    assert failure is None, failure


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("backend", BACKENDS)
def test_dcp_checkpoint_of_two_ranks_resumes_in_one_process(world, backend) -> None:
    """The sharded checkpoint of 2 FSDP2 ranks, loaded into one unsharded process: params,
    state, scale and trackers bit for bit, with nothing saved beside."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    outcomes, tmp = world
    assert outcomes[f"dcp-sharded-{backend}"] is None, "the save failed"
    checkpoint = tmp / f"dcp-sharded-{backend}"
    with kernels_mode(backend):
        model = make_model(seed=1)
        opt = _scaled(scaledoptim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt),
        }
        dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        assert_bit_identical(torch.load(checkpoint / "full-values.pt"), _everything(opt))
