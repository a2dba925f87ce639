"""The parity table: every fused optimizer's update against a reference, one row per check.

The axes: optimizer x config (every config of its optim_db row, the kernel sweep included) x
param dtype (fp32; fp32 params with bf16 grads; fp16 with master weights; fp16 with fp32 grads;
bf16; bf16 with stochastic rounding) x backend (our kernels in the emulator; the torch forms as a
CPU runs them; the torch forms as every other device runs them, sync-free) x tensor kind
(contiguous across chunk boundaries; transposed, misaligned and gapped views; zero-size;
DTensor local shards) x step kind (clean; an inf/nan grad; clipping that binds, and
``opt.grad_norm`` the norm ``clip_grad_norm_`` returns; clipping that does not; clipping and an
inf/nan grad) x form (``unscale_and_step``; ``unscale`` + ``step_after_unscale``). The rows cover
every config on the two CPU backends, and every pair of param dtype, tensor kind and step kind
for every optimizer on each of them (a pairwise covering, not the whole product); the sync-free
backend runs each optimizer's configs that the optimizer-level tests run.

Each row's reference, driven by ``torch.amp.GradScaler`` (+ ``clip_grad_norm_``) as a user
drives torch.optim (tests/support/parity.py): ``torch.optim.X`` in fp32 where torch has X, else
the optimizer's own torch form in float64; ``lion-pytorch`` and ``pytorch_optimizer``'s Lamb for
Lion and LAMB where they compute the same update (tests/support/outside_references.py: which
configurations, and where they differ); and a float64 row per optimizer and param dtype.

What only kernel-level tests see (block order, launch bounds, list layout, vector lanes, the
NVRTC arch list, AddressSanitizer) stays in tests/kernels.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from scaledoptim.kernels import launch_config
from scaledoptim.testing.optim_db import OptimInfo, rows
from tests.support.outside_references import OUTSIDE_CONFIGS
from tests.support.parity import (
    BACKENDS,
    PARAM_DTYPES,
    REFERENCES,
    STEP_KINDS,
    TENSOR_KINDS,
    ParityRow,
    check_row,
)
from tests.support.tensors import CHUNK, EMULATOR_THREADS

FUSED = rows(fused=True)
#: The backends every config runs on (the sync-free one runs the optimizer-level configs).
EVERY_CONFIG = ("emulate", "torch")


def _dtypes(info: OptimInfo) -> list[str]:
    """The param dtypes of ``info``: the rounding options only where it takes them."""
    return [name for name, (_, _, options) in PARAM_DTYPES.items() if info.rounding or not options]


def _pairwise(info: OptimInfo, offset: int) -> list[tuple[str, str, str]]:
    """(param dtype, tensor kind, step kind) triples holding every pair of any two of them."""
    kinds, steps = TENSOR_KINDS, STEP_KINDS
    return [
        (dtype, kind, steps[(d + k + offset) % len(steps)])
        for d, dtype in enumerate(_dtypes(info))
        for k, kind in enumerate(kinds)
    ]


def _form(i: int, dtype: str, steps: str) -> str:
    """The i-th form where it applies: those where the user calls clip_grad_norm_ where its
    grads are fp32 (as the reference's) or nothing is clipped; the split form without fp16
    grads (``unscale()`` refuses them, as GradScaler); a plain step() where no grad
    overflows."""
    grads = PARAM_DTYPES[dtype][1]
    forms = ["unscale_and_step"]
    if grads == (torch.float32,) or not steps.startswith("clip"):
        if torch.float16 not in grads:
            forms.append("split")
        if "overflow" not in steps:
            forms.append("step")
    return forms[i % len(forms)]


def _own_rows(info: OptimInfo) -> Iterator[ParityRow]:
    reference = "torch.optim" if info.reference is not None else "float64"
    for b, backend in enumerate(EVERY_CONFIG):
        triples = _pairwise(info, b)
        count = max(len(triples), len(info.configs))
        for i, (config, (dtype, kind, steps)) in enumerate(
            zip(itertools.islice(itertools.cycle(info.configs), count),
                itertools.islice(itertools.cycle(triples), count))
        ):
            yield ParityRow(info, config, dtype, backend, kind, steps, reference,
                            _form(i + b, dtype, steps))
    for i, config in enumerate(info.generic_configs):
        dtype, kind, steps = _pairwise(info, 2)[i * 5 % len(_pairwise(info, 2))]
        yield ParityRow(info, config, dtype, "sync-free", kind, steps, reference)
    if info.reference is not None:  # the float64 form of the torch.optim class
        for i, dtype in enumerate(_dtypes(info)):
            yield ParityRow(info, info.default, dtype, EVERY_CONFIG[i % 2],
                            TENSOR_KINDS[i % len(TENSOR_KINDS)],
                            STEP_KINDS[(i + 1) % len(STEP_KINDS)], "float64")


def _outside_rows() -> Iterator[ParityRow]:
    by_name = {info.name: info for info in FUSED}
    for c, outside in enumerate(OUTSIDE_CONFIGS):
        info = by_name[outside.optimizer]
        config = info.default
        for b, backend in enumerate(BACKENDS):
            dtype, kind, steps = _pairwise(info, c)[(3 * c + 7 * b) % len(_pairwise(info, c))]
            yield ParityRow(info, config, dtype, backend, kind, steps, outside.reference,
                            outside=outside)
        # Every outside configuration also on fp32 contiguous params, clean and overflowing.
        for steps in ("clean", "overflow"):
            yield ParityRow(info, config, "fp32", "emulate", "contiguous", steps,
                            outside.reference, outside=outside)


def _id(row: ParityRow) -> str:
    config = row.outside.name if row.outside else row.config.name
    return "-".join((row.info.name, config, row.dtype, row.backend, row.tensors, row.steps,
                     row.reference, row.form))


#: Rows that fail for a defect of the library this table found, and that is not fixed yet: each
#: is expected to fail (strictly: a fix turns it into an unexpected pass, to be removed here).
KNOWN_DEFECTS = (
    (lambda r: r.info.name == "LAMB" and r.tensors == "dtensor"
     and PARAM_DTYPES[r.dtype][0] != (torch.float32,),
     "refused (ValueError naming float32 sharded params): LAMB's torch form steps whole "
     "DTensors, and the rounding back into 16-bit params takes plain ops, which have no "
     "sharding strategy"),
)


def _param(row: ParityRow) -> object:
    for applies, reason in KNOWN_DEFECTS:
        if applies(row):
            mark = pytest.mark.xfail(strict=True, reason=reason, raises=ValueError)
            return pytest.param(row, marks=mark)
    return row


TABLE = list({  # each row once
    _id(row): row for row in (*(r for info in FUSED for r in _own_rows(info)), *_outside_rows())
}.values())


@pytest.fixture(autouse=True)
def small_launch_geometry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of CHUNK elements, so that the tensors cross every chunk boundary."""
    monkeypatch.setattr(launch_config, "chunk_size", CHUNK)
    monkeypatch.setattr(launch_config, "emulator_threads_per_block", EMULATOR_THREADS)


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    """A process group of this process alone (an in-process store: no port), for DTensors."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("row", [_param(row) for row in TABLE], ids=_id)
def test_row_matches_its_reference(row: ParityRow, request: pytest.FixtureRequest) -> None:
    if row.tensors == "dtensor":
        request.getfixturevalue("world_of_one")
    check_row(row, CHUNK)


def test_the_table_covers_every_axis() -> None:
    """Every config on both CPU backends; every optimizer with every param dtype, tensor kind,
    step kind, form and backend; the outside references against both of theirs."""
    seen = {(r.info.name, r.config.name, r.backend) for r in TABLE if r.outside is None}
    for info in FUSED:
        for config in info.configs:
            assert {(info.name, config.name, b) for b in EVERY_CONFIG} <= seen
        mine = [r for r in TABLE if r.info is info]
        for axis, values in (("dtype", _dtypes(info)), ("tensors", TENSOR_KINDS),
                             ("steps", STEP_KINDS), ("form", ("split", "unscale_and_step", "step")),
                             ("backend", BACKENDS)):
            assert {getattr(r, axis) for r in mine} >= set(values), (info.name, axis)
    assert {r.reference for r in TABLE} == set(REFERENCES)


@pytest.mark.parametrize("info", FUSED, ids=str)
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_drawn_hyperparameters_match_the_float64_form(info: OptimInfo, data) -> None:
    """Hyper-parameters drawn from the row's ranges (a formula error that a config's round
    values hide: eps next to a bias correction, a beta for another), on our kernels."""
    ranges = {
        key: (st.tuples(*(st.floats(*r) for r in bounds)) if isinstance(bounds[0], tuple)
              else st.floats(*bounds))
        for key, bounds in info.ranges.items()
    }
    changes = data.draw(st.fixed_dictionaries(ranges), label="hyperparameters")
    config = data.draw(st.sampled_from(info.configs), label="config")
    config = type(config)(config.name, {**config.kwargs, **changes})
    check_row(ParityRow(info, config, "fp32", "emulate", "contiguous", "clean", "float64"), CHUNK)
