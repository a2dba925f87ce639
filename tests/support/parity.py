"""The parity table's rows and the one check every row runs (tests/parity/test_parity_table.py).

A :class:`ParityRow` is one optimizer config on one param dtype, backend, tensor kind and step
kind, checked against one reference. :func:`check_row` runs three steps of our optimizer
through the loss-scaling protocol and, beside it, the reference driven as a user drives
torch.optim: ``torch.amp.GradScaler`` (``scale`` → ``unscale_`` → ``clip_grad_norm_`` →
``step`` → ``update``) over a :class:`Shadow` of the params. After every step the scale is
GradScaler's, a skipped step changed nothing (bit for bit), and the params and the state are the
reference's: fp32 to the row's tolerance, 16-bit within one ulp of the reference rounded once,
master weights to fp32 tolerance.

The reference restarts every step from our params (their masters, with master weights) and
state: a 16-bit param rounded every step is compared with one rounding of the reference, and an
fp32 state is held to one step's roundings, not to the drift of two trajectories apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from scaledoptim.doctor.sync_free import no_host_reads
from scaledoptim.testing.optim_db import Config, OptimInfo, Tolerance
from tests.support.outside_references import OutsideConfig
from tests.support.references import assert_param_close, kernels_mode, torch_ops

__all__ = [
    "BACKENDS", "PARAM_DTYPES", "REFERENCES", "STEP_KINDS", "TENSOR_KINDS", "ParityRow",
    "Shadow", "check_row",
]

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
#: name: (the params' dtypes, the grads' dtypes, the optimizer's rounding options); the i-th
#: param and grad take the i-th dtype, cyclically.
DtypeCycle = tuple[torch.dtype, ...]
PARAM_DTYPES: dict[str, tuple[DtypeCycle, DtypeCycle, dict[str, bool]]] = {
    "fp32": ((F32,), (F32,), {}),
    "fp32-bf16grads": ((F32,), (BF16,), {}),
    "fp32-fp16grads": ((F32,), (F16,), {}),
    "fp16+master": ((F16,), (F16,), {"master_weights": True}),
    "fp16-fp32grads": ((F16,), (F32,), {}),
    "bf16": ((BF16,), (BF16,), {}),
    "bf16-fp32grads": ((BF16,), (F32,), {}),
    "bf16+sr": ((BF16,), (BF16,), {"stochastic_rounding": True}),
    "mixed": ((F32, BF16, F16), (BF16, F32, F16), {}),
}
#: ``emulate``: our CUDA kernels in the CPU emulator; ``torch``: the torch forms, skipping on
#: the host as they do on a CPU; ``sync-free``: the torch forms as every other device runs them
#: (skips decided on device, no host read: ``no_host_reads``).
BACKENDS = ("emulate", "torch", "sync-free")
#: ``contiguous``: sizes across chunk boundaries; ``views``: transposed, misaligned (storage
#: offset 1) and gapped views; ``zero-size``: empty params among others; ``dtensor``: DTensor
#: params over a world of one (their local shards stepped).
TENSOR_KINDS = ("contiguous", "views", "zero-size", "dtensor")
#: What happens at the middle of three steps: nothing, an inf/nan grad, clipping that binds
#: (the step's ``max_grad_norm`` below the norm), clipping that does not, clipping that binds
#: and an inf/nan grad (a non-finite norm).
STEP_KINDS = ("clean", "overflow", "clip-binding", "clip-loose", "clip-overflow")
#: ``torch.optim`` (the class in fp32), ``float64`` (that class, or our own torch form, in
#: float64), the outside implementations of tests/support/outside_references.py.
REFERENCES = ("torch.optim", "float64", "lion-pytorch", "pytorch_optimizer")

INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 2
STEPS = 3
MIDDLE = 1
#: The tolerance of an fp32 step against an outside implementation (other roundings: lerp
#: against mul + add, eps in their trust ratio and clip, norms summed in another order).
OUTSIDE_TOLERANCE = Tolerance(param_rtol=1e-5, param_atol=1e-6, state_rtol=1e-5, state_atol=1e-6)


@dataclasses.dataclass(frozen=True)
class ParityRow:
    """One row: ``config`` of ``info`` on a param dtype, backend, tensor kind and step kind,
    through ``form`` (``unscale_and_step``; ``split``: ``unscale``, the user's
    ``clip_grad_norm_``, ``step_after_unscale``, with fp32 grads as the reference's; ``step``:
    unscaled grads, the user's ``clip_grad_norm_`` and a plain ``step()``, no overflow),
    against ``reference`` (``outside``: the outside configuration, for an outside reference)."""

    info: OptimInfo
    config: Config
    dtype: str
    backend: str
    tensors: str
    steps: str
    reference: str
    form: str = "unscale_and_step"
    outside: OutsideConfig | None = None

    def __str__(self) -> str:
        return "-".join((self.info.name, self.config.name, self.dtype, self.backend,
                         self.tensors, self.steps, self.reference, self.form))


# ----------------------------------------------------------------------------------- tensors
def _values(kind: str, generator: torch.Generator, chunk: int) -> list[Tensor]:
    """fp32 values of the params of a tensor kind (views made later, in the param dtype)."""
    shapes = {
        "contiguous": [(1,), (5,), (chunk + 1,), (3 * chunk + 7,)],
        "views": [(6, 5), (chunk + 3,), (4, 10)],
        "zero-size": [(0,), (7,), (0, 3), (2 * chunk + 1,)],
        "dtensor": [(6, 5), (chunk + 9,)],
    }[kind]
    # Norms below 10 (pytorch_optimizer's Lamb clamps the weight norm there).
    return [torch.randn(shape, generator=generator) * 0.3 for shape in shapes]


def _cycled(dtypes: tuple[torch.dtype, ...], count: int) -> list[torch.dtype]:
    return [dtypes[i % len(dtypes)] for i in range(count)]


def _as_params(
    kind: str, values: list[Tensor], dtypes: tuple[torch.dtype, ...], gaps: bool = True
) -> list[Tensor]:
    """Params of a tensor kind holding ``values``; ``gaps=False`` leaves the view with gaps out."""
    values = [v.to(dtype) for v, dtype in zip(values, _cycled(dtypes, len(values)))]
    if kind == "views":
        transposed = values[0].t().contiguous().t()  # a (6, 5) param with strides (1, 6)
        storage = torch.empty(values[1].numel() + 1, dtype=values[1].dtype)
        misaligned = storage[1:]
        misaligned.copy_(values[1])
        gapped = torch.empty(4, 20, dtype=values[2].dtype)[:, ::2]  # torch.optim's route
        gapped.copy_(values[2])
        values = [transposed, misaligned, gapped] if gaps else [transposed, misaligned]
    if kind == "dtensor":
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        mesh = init_device_mesh("cpu", (1,))
        return [torch.nn.Parameter(distribute_tensor(v, mesh, [Shard(0)])) for v in values]
    return [torch.nn.Parameter(v) for v in values]


def full(t: Tensor) -> Tensor:
    """A DTensor's whole tensor, any other tensor as it is, detached."""
    full_tensor = getattr(t, "full_tensor", None)
    return (full_tensor() if full_tensor is not None else t).detach()


def _set_grad(param: Tensor, value: Tensor) -> None:
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value, param.device_mesh, param.placements)
    if value.dtype != param.dtype:
        param.grad_dtype = value.dtype  # mixed precision: grads in another dtype than params
    param.grad = value


# --------------------------------------------------------------------------------- reference
class Shadow(torch.optim.Optimizer):
    """The reference, as GradScaler sees an optimizer: fp32 mirrors of our params (GradScaler
    unscales and clips their grads), stepped by ``inner``, an optimizer over copies in
    ``dtype``. Each step first sets the copies, and the state the reference keeps, to ours
    (``source``: each param's value and state), then steps them on the mirrors' grads."""

    def __init__(
        self,
        make_inner: Callable[[list[Tensor]], torch.optim.Optimizer],
        shapes: Sequence[torch.Size],
        dtype: torch.dtype,
        source: Callable[[], list[tuple[Tensor, dict[str, Any]]]],
        own_form: bool,
    ) -> None:
        mirrors = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
        super().__init__(mirrors, {})
        self.mirrors = mirrors
        self.copies = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes]
        self.inner = make_inner(self.copies)
        self.source = source
        self.own_form = own_form

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for copy, (value, state), mirror in zip(self.copies, self.source(), self.mirrors):
            copy.copy_(value)
            copy.grad = mirror.grad.to(copy.dtype)
            theirs = self.inner.state.get(copy, {})
            for key, kept in theirs.items():
                if key in state and isinstance(kept, Tensor):
                    kept.copy_(full(state[key]).to(kept.dtype))
            if "step" in state and "step" in self.inner.param_groups[0]:
                self.inner.param_groups[0]["step"] = int(full(state["step"]))  # a group count
        with torch_ops() if self.own_form else contextlib.nullcontext():
            self.inner.step()


def _without_rounding(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in ("master_weights", "stochastic_rounding")}


def _shadows(row: ParityRow, kwargs: dict[str, Any], shapes: list[torch.Size],
             source: Callable[[], list[tuple[Tensor, dict[str, Any]]]]) -> list[Shadow]:
    """The reference (first) and, for a float64 one, the same in fp32, which each element may
    match instead (Note [fp32 and fp64 references] in tests/support/launches.py: our kernels
    compute in fp32 by design)."""
    info, plain = row.info, _without_rounding(kwargs)
    if row.outside is not None:
        return [Shadow(row.outside.theirs, shapes, torch.float64, source, own_form=False)]
    if row.reference == "torch.optim":
        assert info.reference is not None
        return [Shadow(lambda ps: info.reference(ps, **plain), shapes, F32, source, False)]
    cls = info.reference or info.cls
    own = info.reference is None
    return [Shadow(lambda ps: cls(ps, **plain), shapes, dtype, source, own)
            for dtype in (torch.float64, F32)]


# ------------------------------------------------------------------------------------ checks
def _snapshot(params: list[Tensor], opt: torch.optim.Optimizer) -> list[Tensor]:
    tensors = [full(p).clone() for p in params]
    for p in params:
        tensors += [full(v).clone() for v in opt.state.get(p, {}).values()
                    if isinstance(v, Tensor)]
    loss_scale = opt.state_dict()["loss_scale"]
    return [*tensors, loss_scale["scale"], loss_scale["growth_tracker"],
            loss_scale["hysteresis_tracker"]]


def _assert_bit_identical(before: list[Tensor], after: list[Tensor], what: str) -> None:
    assert len(before) == len(after), what
    for b, a in zip(before, after):
        assert b.dtype == a.dtype and torch.equal(b.reshape(-1).view(torch.uint8),
                                                  a.reshape(-1).view(torch.uint8)), what


def _state_key_matches(
    ours: Tensor, theirs: Tensor, also: Tensor | None, tolerance: Tolerance, what: str
) -> None:
    """Each element close to ``theirs``, or to ``also`` (an fp32 twin of a float64 reference):
    relatively, and absolutely to ``state_rtol`` of the tensor's largest magnitude (an element
    that cancels keeps the rounding error of the terms it cancels: torch's fused CPU ops and our
    kernels fuse other multiply-adds)."""
    actual = full(ours).double()
    close = torch.zeros_like(actual, dtype=torch.bool)
    for expected in (theirs, also):
        if expected is not None:
            expected = full(expected).double()
            largest = float(expected.abs().max()) if expected.numel() else 0.0
            atol = max(tolerance.state_atol, tolerance.state_rtol * largest)
            close |= torch.isclose(actual, expected, tolerance.state_rtol, atol)
    if not close.all():
        worst = int((~close).reshape(-1).nonzero()[0])
        raise AssertionError(f"{what}: element {worst}: {actual.reshape(-1)[worst].item()!r} vs "
                             f"{full(theirs).reshape(-1)[worst].item()!r}")


@contextlib.contextmanager
def _backend(name: str) -> Iterator[None]:
    with kernels_mode("emulate" if name == "emulate" else "torch"):
        yield


def check_row(row: ParityRow, chunk: int) -> None:
    """Three steps of ``row`` against its reference (see the module's docstring)."""
    info = row.info
    param_dtypes, grad_dtypes, options = PARAM_DTYPES[row.dtype]
    kwargs = {**(row.outside.ours if row.outside else row.config.kwargs), **options}
    generator = torch.Generator().manual_seed(zlib.crc32(str(row).encode()))
    values = _values(row.tensors, generator, chunk)
    # Views with gaps take torch.optim's route, where there is one (else they are refused), which
    # reads found_inf on the host as GradScaler does: not on the sync-free backend.
    gaps = info.reference is not None and row.backend != "sync-free"
    params = _as_params(row.tensors, values, param_dtypes, gaps)
    tolerance = OUTSIDE_TOLERANCE if row.outside else info.tolerance
    master = options.get("master_weights", False)
    with _backend(row.backend):
        opt = info.cls(params, **kwargs)
        opt.configure_scaling(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)

        def source() -> list[tuple[Tensor, dict[str, Any]]]:
            states = [opt.state.get(p, {}) for p in params]
            if master and all("master_param" in state for state in states):
                return [(full(s["master_param"]).float(), s) for s in states]
            return [(full(p).float(), s) for p, s in zip(params, states)]

        shapes = [full(p).shape for p in params]
        shadows = _shadows(row, kwargs, shapes, source)
        scalers = [torch.amp.GradScaler("cpu", init_scale=INIT_SCALE,
                                        growth_interval=GROWTH_INTERVAL) for _ in shadows]
        for scaler in scalers:
            scaler.scale(torch.zeros(()))  # GradScaler creates its scale at its first scale()
        for step in range(STEPS):
            _one_step(row, opt, params, shadows, scalers, step, _cycled(grad_dtypes, len(params)),
                      generator, tolerance, master)


def _one_step(row: ParityRow, opt: Any, params: list[Tensor], shadows: list[Shadow],
              scalers: list[torch.amp.GradScaler], step: int, grad_dtypes: list[torch.dtype],
              generator: torch.Generator, tolerance: Tolerance, master: bool) -> None:
    form = row.form
    scale = opt.scale.item() if form != "step" else 1.0
    overflow = row.steps in ("overflow", "clip-overflow") and step == MIDDLE
    clip = {"clip-binding": 0.02, "clip-loose": 1e4, "clip-overflow": 0.02}.get(row.steps)
    norms = []
    # Unscaled grads of another size at every step (LAMB's clip and Lion's sign see the
    # ratio), scaled exactly (a power of two) into the grads' dtype. A binding clip sees grads
    # whose norm is a few hundredths, where clip_grad_norm_'s 1e-6 shows in the coefficient.
    size = (1 + step) * (2e-3 if clip == 0.02 else 1.0)
    grads = [(torch.randn(full(p).shape, generator=generator) * size).to(dtype)
             for p, dtype in zip(params, grad_dtypes)]
    scaled = [(g.float() * scale).to(g.dtype) for g in grads]
    if overflow:  # one element of one grad, anywhere: inf, -inf or nan
        poisoned = [g for g in scaled if g.numel()]
        grad = poisoned[int(torch.randint(len(poisoned), (), generator=generator))]
        where = int(torch.randint(grad.numel(), (), generator=generator))
        bad = (float("inf"), float("-inf"), float("nan"))[zlib.crc32(str(row).encode()) % 3]
        grad.view(-1)[where] = bad
    for param, grad in zip(params, scaled):
        _set_grad(param, grad.clone())
    for shadow, scaler in zip(shadows, scalers):
        for mirror, grad in zip(shadow.mirrors, scaled):
            mirror.grad = grad.float()
        if form == "step":  # no scaling: torch.optim's own step
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(shadow.mirrors, clip)
            shadow.step()
            continue
        scaler.unscale_(shadow)
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(shadow.mirrors, clip))
        scaler.step(shadow)
        scaler.update()
    before = _snapshot(params, opt)
    found_inf = torch.zeros(())
    watch = no_host_reads() if row.backend == "sync-free" and step else contextlib.nullcontext()
    if form == "unscale_and_step":
        with watch:
            _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale, max_grad_norm=clip)
    elif form == "split":
        with watch:
            found_inf, _ = opt.unscale(grads_scaled_by=opt.scale)
    if form != "unscale_and_step":  # the user's clip_grad_norm_, then a step
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        with watch:
            opt.step() if form == "step" else opt.step_after_unscale()
    where = f"{row} step {step}"
    assert found_inf.item() == float(overflow), where
    assert opt.scale.item() == scalers[0].get_scale(), f"{where}: the scale"
    if form == "unscale_and_step" and clip is not None:  # the pre-clip norm clip_grad_norm_ saw
        if overflow:
            assert not torch.isfinite(opt.grad_norm), f"{where}: the norm"
        else:
            torch.testing.assert_close(opt.grad_norm, norms[0].float(), rtol=1e-6, atol=0,
                                       msg=f"{where}: the norm")
    if overflow:
        _assert_bit_identical(before[:-3], _snapshot(params, opt)[:-3], f"{where}: skipped")
        return
    _compare(row, opt, params, shadows, tolerance, master, where)


def _compare(row: ParityRow, opt: Any, params: list[Tensor], shadows: list[Shadow],
             tolerance: Tolerance, master: bool, where: str) -> None:
    reference, *also = shadows
    for i, param in enumerate(params):
        expected = reference.copies[i].detach()
        other = also[0].copies[i].detach() if also else None
        state = opt.state[param]
        if master:
            assert_param_close(full(state["master_param"]), expected.float(),
                               tolerance.param_rtol, tolerance.param_atol,
                               None if other is None else other.float())
            expected = expected.float().to(param.dtype)
            other = None if other is None else other.float().to(param.dtype)
        assert_param_close(full(param), expected.float(), tolerance.param_rtol,
                           tolerance.param_atol, None if other is None else other.float())
        theirs = reference.inner.state.get(reference.copies[i], {})
        twin = also[0].inner.state.get(also[0].copies[i], {}) if also else {}
        for key, value in theirs.items():
            if key in state and isinstance(value, Tensor) and key != "step":
                _state_key_matches(state[key], value, twin.get(key), tolerance,
                                   f"{where}: state {key!r}")
        taken = _taken_steps(reference, reference.copies[i])
        if taken is not None:
            assert float(full(state["step"])) == taken, f"{where}: the step counter"


def _taken_steps(shadow: Shadow, copy: Tensor) -> float | None:
    state = shadow.inner.state.get(copy, {})
    if "step" in state:
        return float(state["step"])
    group_step = shadow.inner.param_groups[0].get("step")  # pytorch_optimizer counts per group
    return None if group_step is None else float(group_step)
