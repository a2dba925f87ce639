"""FSDP2 and tensor parallel on a gloo world of 2, one spawn for every scenario, on both backends:

* the loss scale through torch.distributed.checkpoint: ``get_optimizer_state_dict`` /
  ``set_optimizer_state_dict`` (sharded and full) carry it, so a resume with nothing saved
  beside is bit-identical, in the same world and resharded to one process (the last test, in
  the pytest process); a checkpoint that saved the scale beside (the old recipe) still loads;
* an overflow in one rank's shard, with no ``process_group``: every rank skips and backs off;
* FSDP2's ``MixedPrecisionPolicy`` (fp16 and bf16 compute, fp32 reduce) against torch.optim and
  ``torch.amp.GradScaler`` on the same sharded model;
* tensor parallel (``ColwiseParallel`` / ``RowwiseParallel``) for every fused optimizer, clean
  and with an overflow on one rank, against torch.optim and GradScaler (Lion and LAMB, which
  torch lacks: our own on the unsharded model);
* FSDP2 for every elementwise fused optimizer, clean steps and an overflow in one rank's shard,
  against torch.optim and ``ShardedGradScaler`` on the same sharded model (Lion: our own on the
  unsharded model); on the emulated backend, FSDP2 and tensor parallel steps launch our kernels
  over the local shards (Note [DTensor steps on our kernels]; LAMB keeps torch's ops);
* LAMB on FSDP2's uneven Shard(0), its global grad norm clipping and its trust ratio on: its
  norms over the whole sharded tensors (Note [sums over the mesh]), so it follows the same LAMB
  on the unsharded model; its state DTensors, saved and resumed through DCP bit for bit;
* HSDP on a world of 4 (a 2-D mesh: replicated over one dimension, sharded over the other), for
  AdamW and LAMB, an overflow in one rank's shard, against the same optimizer unsharded.
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
from tests.support.launches import recorded_launches
from tests.support.references import kernels_mode
from tests.support.training import assert_bit_identical, loss_of, make_model

BACKENDS = ("torch", "emulate")
OPTIMIZERS = ("AdamW", "Adam", "SGD", "Adagrad", "RMSprop", "Lion", "LAMB")
#: Clipping by the global grad norm engaged (the grads' norms here are about 0.3 to 3), the trust
#: ratio on (weight decay).
LAMB_OPTIONS = {"weight_decay": 0.1, "max_grad_norm": 0.1}
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
    loss_scale = opt.scaling_state.loss_scale
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
    # Gathered before any assert, one verdict on both ranks: a rank that failed alone would
    # leave the other waiting in the next collective.
    seen = _gathered((found, [t.item() for t in _scale_state(opt)]))
    assert seen[0] == seen[1]
    assert found == [float(step in INJECTED) for step in range(STEPS)]


# ---------------------------------------------------------------- the scale through DCP
def _dcp_resume(backend: str, full: bool, rank: int, world_size: int, tmp, name="AdamW") -> None:
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
        options = LAMB_OPTIONS if name == "LAMB" else {"weight_decay": 0.1}
        return model, _scaled(getattr(scaledoptim, name)(model.parameters(), lr=1e-2, **options))

    with kernels_mode(backend):
        model, opt = fresh()
        _train(model, opt, rank, range(5))
        scale, growth_tracker, _ = (t.item() for t in _scale_state(opt))
        seen = _gathered((scale, growth_tracker))  # before the assert: both ranks get here
        assert all(s < 2.0**10 and g == 1 for s, g in seen), "a reset scale would show"
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
                "loss_scale": opt.state_dict()["loss_scale"]}

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


# ---------------------------------------------------------------- tensor parallel
class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def _mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)


def _options(name: str) -> dict:
    if name == "LAMB":
        return LAMB_OPTIONS
    return {"momentum": 0.9} if name in ("SGD", "RMSprop") else {}


def _tp_against_gradscaler(name: str, backend: str, rank: int, world_size: int, tmp) -> None:
    """Colwise ``up``, Rowwise ``down``; an inf in rank 1's shard of ``up.weight``'s grad
    (global row 8) on the overflow steps: every rank skips; the params and the scale follow
    torch.optim + GradScaler on the unsharded model (Lion and LAMB, which torch lacks: our own
    on it; ``down.bias`` is Replicate, so LAMB sums its norms over no mesh dimension)."""
    from torch.distributed.tensor import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world_size,))
    overflow_steps = (1, 3)

    def train(model, opt, overflow):
        """Our protocol; returns the skip flags and the scale after each step."""
        found, scales, S = (
            [],
            [],
            opt.configure_scaling(init_scale=2.0**10, growth_interval=2).scale,
        )
        for step in range(5):
            opt.zero_grad()
            x, y = _mlp_batch(step)
            scaledoptim.scale_outputs(torch.nn.functional.mse_loss(model(x), y), S).backward()
            if step in overflow_steps:
                overflow(model.up.weight.grad)
            _, found_inf, S = opt.unscale_and_step(grads_scaled_by=S)
            found.append(found_inf.item())
            scales.append(S.item())
        return found, scales

    def inf_in_rank_1(grad):
        if rank == 1:
            grad.to_local()[0, 0] = float("inf")

    def inf_in_row_8(grad):  # rank 1's first row, in the whole tensor
        grad[8, 0] = float("inf")

    with kernels_mode(backend), recorded_launches() as launched:
        model = parallelize_module(
            _MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}
        )
        opt = getattr(scaledoptim, name)(model.parameters(), lr=1e-2, **_options(name))
        found, scales = train(model, opt, inf_in_rank_1)
    _assert_ran_on(backend, name, launched)

    reference_model = _MLP()
    reference_cls = getattr(torch.optim, name, None)
    if reference_cls is None:  # Lion, LAMB: our own, on the whole tensors with torch's ops
        with kernels_mode("torch"):
            reference = getattr(scaledoptim, name)(
                reference_model.parameters(), lr=1e-2, **_options(name)
            )
            ref_found, ref_scales = train(reference_model, reference, inf_in_row_8)
    else:
        reference = reference_cls(reference_model.parameters(), lr=1e-2, **_options(name))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        ref_found, ref_scales = [], []
        for step in range(5):
            reference.zero_grad()
            x, y = _mlp_batch(step)
            scaler.scale(torch.nn.functional.mse_loss(reference_model(x), y)).backward()
            if step in overflow_steps:
                inf_in_row_8(reference_model.up.weight.grad)
            scale = scaler.get_scale()
            scaler.step(reference)
            scaler.update()
            ref_found.append(float(scaler.get_scale() < scale))
            ref_scales.append(scaler.get_scale())
    seen = _gathered((found, scales))  # first, and the same verdict on both ranks
    assert seen[0] == seen[1]
    assert found == ref_found == [float(step in overflow_steps) for step in range(5)]
    assert scales == ref_scales
    for param, twin in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(param.full_tensor(), twin.detach(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ FSDP2, every elementwise optimizer
def _assert_ran_on(backend: str, name: str, launched: list[str]) -> None:
    """See Note [DTensor steps on our kernels]: on the emulated kernels an elementwise optimizer's
    DTensor step is the check, its kernel and the epilogue over the local shards; LAMB's, and
    every step on the torch backend, launch none of ours."""
    kernel = getattr(scaledoptim, name).kernel.name
    if backend == "emulate" and name != "LAMB":
        assert {"non_finite_check_kernel", kernel, "step_epilogue_kernel"} <= set(launched)
    else:
        assert launched == []


def _scaler_step(scaler, model, opt, step: int, overflow: bool) -> float:
    """torch's loop, one iteration (an inf in this rank's shard of the first grad if
    ``overflow``); returns 1.0 when the scaler backed off (the step was skipped)."""
    scaler.scale(loss_of(model, step)).backward()
    if overflow:
        _local(next(model.parameters()).grad).view(-1)[0] = float("inf")
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    return float(scaler.get_scale() < scale)


def _fsdp2_against_sharded_gradscaler(name: str, backend: str, rank: int, world_size: int, tmp):
    """``name`` on FSDP2 params (no ``process_group``), clean steps and an inf in one rank's
    shard (``INJECTED``): every rank skips the same steps, skipped steps change nothing, and the
    skips, the scale and the params follow ``torch.optim`` + ``ShardedGradScaler`` on the same
    sharded model (Lion, which torch lacks: our own on the unsharded model)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.tensor import Shard

    expected = [float(step in INJECTED) for step in range(STEPS)]
    if name == "Lion":
        _follows_unsharded(name, backend, INJECTED, rank, (Shard(0),))
        return
    options = _options(name)
    with kernels_mode(backend), recorded_launches() as launched:
        model = _fsdp2_model()
        opt = getattr(scaledoptim, name)(model.parameters(), lr=1e-2, **options)
        opt.configure_scaling(init_scale=2.0**10, growth_interval=3)
        found = _train(model, opt, rank, range(STEPS))
    _assert_ran_on(backend, name, launched)

    reference = _fsdp2_model()
    ref_opt = getattr(torch.optim, name)(reference.parameters(), lr=1e-2, **options)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    ref_found = []
    for step in range(STEPS):
        ref_opt.zero_grad()
        ref_found.append(_scaler_step(scaler, reference, ref_opt, step, INJECTED.get(step) == rank))
    seen = _gathered(found)  # first, and the same verdict on both ranks
    assert seen[0] == seen[1]
    assert found == ref_found == expected
    assert opt.scale.item() == scaler.get_scale()
    for param, twin in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(_local(param), _local(twin), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- LAMB on FSDP2
def _fsdp2_lamb_against_unsharded(backend: str, rank: int, world_size: int, tmp) -> None:
    """LAMB on FSDP2 params (Shard(0), 17 rows: 9 and 8), an overflow in one rank's shard: its
    clipping and trust ratio read the whole tensors' norms, so every step follows the same LAMB
    on the unsharded model."""
    from torch.distributed.tensor import Shard

    _follows_unsharded("LAMB", backend, INJECTED, rank, (Shard(0),))


def _follows_unsharded(name, backend, overflow, shard_index, placements, **fully_shard_options):
    """``name`` on FSDP2 params (``fully_shard_options``) of ``placements``, with an inf in the
    shard ``shard_index`` on the steps of ``overflow`` (step -> the shard that overflows): the
    skips, the scale state, the params and the state (DTensors of the param's placements)
    follow the same optimizer on the unsharded model."""
    from torch.distributed.tensor import DTensor

    options = LAMB_OPTIONS if name == "LAMB" else {"weight_decay": 0.1}
    with kernels_mode(backend), recorded_launches() as launched:
        model = _fsdp2_model(**fully_shard_options)
        opt = _scaled(getattr(scaledoptim, name)(model.parameters(), lr=1e-2, **options))
        found = _train(model, opt, shard_index, range(STEPS), overflow)
    _assert_ran_on(backend, name, launched)
    reference = make_model()
    with kernels_mode("torch"):
        ref_opt = _scaled(getattr(scaledoptim, name)(reference.parameters(), lr=1e-2, **options))
        ref_found = _train(reference, ref_opt, 0, range(STEPS), dict.fromkeys(overflow, 0))
    assert found == ref_found == [float(step in overflow) for step in range(STEPS)]
    assert_bit_identical(_scale_state(opt), _scale_state(ref_opt))
    for param in model.parameters():
        assert param.placements == placements
        for value in opt.state[param].values():
            if value.dim():
                assert isinstance(value, DTensor) and value.placements == placements
    got, want = _everything(opt, _full)[:-3], _everything(ref_opt)[:-3]
    for value, twin in zip(got, want):
        torch.testing.assert_close(value, twin, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- FSDP2 mixed precision
def _fsdp2_policy_against_sharded_gradscaler(
    param_dtype: torch.dtype, backend: str, rank: int, world_size: int, tmp
) -> None:
    """MixedPrecisionPolicy(param_dtype=fp16/bf16, reduce_dtype=fp32): fp32 sharded params and
    grads, so the step is the fp32 one; against torch.optim.AdamW + ShardedGradScaler (which
    all-reduces its found_inf too) on the same sharded model, an overflow on one rank."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    overflow = {1: 1, 3: 0}

    def run(make_opt, step_fn):
        model = _fsdp2_model(mp_policy=policy)
        opt = make_opt(model.parameters())
        found = []
        for step in range(5):
            opt.zero_grad()
            found.append(step_fn(model, opt, step))
        return model, found

    def ours(model, opt, step):
        scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
        if overflow.get(step) == rank:
            _local(next(model.parameters()).grad).view(-1)[0] = float("inf")
        _, found_inf, S = opt.unscale_and_step(grads_scaled_by=opt.scale)
        return found_inf.item(), S.item()

    scaler = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2)

    def torchs(model, opt, step):
        skipped = _scaler_step(scaler, model, opt, step, overflow.get(step) == rank)
        return skipped, scaler.get_scale()

    with kernels_mode(backend):
        model, found = run(
            lambda params: scaledoptim.AdamW(params, lr=1e-2).configure_scaling(
                init_scale=2.0**10, growth_interval=2
            ),
            ours,
        )
    reference, ref_found = run(lambda params: torch.optim.AdamW(params, lr=1e-2), torchs)
    assert found == ref_found
    assert [f for f, _ in found] == [float(step in overflow) for step in range(5)]
    for param, twin in zip(model.parameters(), reference.parameters()):
        assert param.dtype == torch.float32
        torch.testing.assert_close(_local(param), _local(twin), rtol=1e-5, atol=1e-6)


def _fsdp2_fp16_params_with_masters(backend: str, rank: int, world_size: int, tmp) -> None:
    """fp16 sharded params with master_weights=True: fp32 masters per shard, DTensors of the
    param's placements; every rank skips an overflow on one; the params follow the same
    optimizer on the unsharded fp16 model within fp16 rounding."""
    from torch.distributed.tensor import DTensor

    overflow = {1: 1, 3: 0}
    with kernels_mode(backend):
        model = _fsdp2_model()
        model.half()
        opt = scaledoptim.AdamW(model.parameters(), lr=1e-2, master_weights=True)
        opt.configure_scaling(init_scale=2.0**10, growth_interval=2)
        found = []
        for step in range(5):
            opt.zero_grad()
            scaledoptim.scale_outputs(loss_of(model, step), opt.scale).backward()
            if overflow.get(step) == rank:
                _local(next(model.parameters()).grad).view(-1)[0] = float("inf")
            _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
            found.append(found_inf.item())
    seen = _gathered(found)  # first, and the same verdict on both ranks
    assert seen[0] == seen[1]
    assert found == [float(step in overflow) for step in range(5)]
    for param in model.parameters():
        assert param.dtype == torch.float16
        for value in opt.state[param].values():
            if value.dim():
                assert isinstance(value, DTensor) and value.placements == param.placements


# ---------------------------------------------------------------- HSDP: a 2-D mesh, world 4
def _hsdp_against_unsharded(name: str, backend: str, rank: int, world_size: int, tmp) -> None:
    """``fully_shard`` on a (2, 2) mesh: params (Replicate(), Shard(0)); an overflow in one
    shard (in both its replicas, as FSDP's all-reduce over the replicas leaves it): all 4 ranks
    skip it; params, state and scale follow the same optimizer on the unsharded model (LAMB's
    norms summed over the shard dimension only)."""
    from torch.distributed.tensor import Replicate, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    overflow = {1: 1, 2: 0, 6: 1}  # step -> the shard that overflows
    placements = (Replicate(), Shard(0))
    _follows_unsharded(name, backend, overflow, mesh.get_local_rank("shard"), placements, mesh=mesh)


HSDP_SCENARIOS = {
    f"hsdp-{name}-{backend}": functools.partial(_hsdp_against_unsharded, name, backend)
    for name in ("AdamW", "LAMB")
    for backend in BACKENDS
}


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
    **{
        f"tp-{name}-{backend}": functools.partial(_tp_against_gradscaler, name, backend)
        for name in OPTIMIZERS
        for backend in BACKENDS
    },
    **{f"fsdp2-LAMB-{b}": functools.partial(_fsdp2_lamb_against_unsharded, b) for b in BACKENDS},
    **{
        f"fsdp2-{name}-{backend}": functools.partial(
            _fsdp2_against_sharded_gradscaler, name, backend
        )
        for name in OPTIMIZERS
        if name != "LAMB"
        for backend in BACKENDS
    },
    **{
        f"dcp-sharded-LAMB-{backend}": functools.partial(_dcp_resume, backend, False, name="LAMB")
        for backend in BACKENDS
    },
    **{
        f"fsdp2-policy-{str(dtype)[6:]}-{backend}": functools.partial(
            _fsdp2_policy_against_sharded_gradscaler, dtype, backend
        )
        for dtype in (torch.float16, torch.bfloat16)
        for backend in BACKENDS
    },
    **{
        f"fsdp2-fp16-masters-{b}": functools.partial(_fsdp2_fp16_params_with_masters, b)
        for b in BACKENDS
    },
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


@pytest.fixture(scope="module")
def world_of_4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    return run_world(4, HSDP_SCENARIOS, pathlib.Path(tmp_path_factory.mktemp("hsdp")))


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("scenario", HSDP_SCENARIOS)
def test_hsdp_scenario(world_of_4, scenario) -> None:
    failure = world_of_4[scenario]
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
    checkpoint = tmp / f"dcp-sharded-{backend}"
    assert (checkpoint / "full-values.pt").exists(), outcomes[f"dcp-sharded-{backend}"]
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
