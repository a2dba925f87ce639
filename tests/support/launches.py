"""A row's update launched on our kernels as the kernel backend launches it, from the class's
:class:`~scaledoptim.fused.update.Update` hooks, for the tests that need launch-level control
(any found_inf flag, misaligned state, the rounding lists, AddressSanitizer, CUDA graphs).

The tensor lists are the engine's: ``[params, grads, *state lists (state_keys), *scratch lists
(scratch_lists), (master_params, sr_seeds,) steps]``, the state staged as a first step stages it.
A launch is the grad reduction (if any), then ``kernels_before`` and ``kernel`` with
``kernel_args``, then the step epilogue over the counters: all validated before any runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from scaledoptim import kernels
from scaledoptim.fused import FusedOptimizer
from scaledoptim.fused.state import stage_state
from scaledoptim.testing.optim_db import Config, OptimInfo, Tolerance
from tests.support.references import assert_param_close, assert_state_close, reference_step
from tests.support.tensors import assert_bytes_unchanged, clones

__all__ = ["RowUpdate", "check_parity", "recorded_launches", "row_update"]


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[str]]:
    """The names of the kernels launched inside, in order (every launch goes through
    ``PreparedLaunch.run``); patched by hand, as a spawned rank has no monkeypatch."""
    launched: list[str] = []
    run = kernels.PreparedLaunch.run

    def recording(self: kernels.PreparedLaunch, *args: Any, **kwargs: Any) -> None:
        launched.append(self.kernel.name)
        run(self, *args, **kwargs)

    kernels.PreparedLaunch.run = recording  # type: ignore[method-assign]
    try:
        yield launched
    finally:
        kernels.PreparedLaunch.run = run  # type: ignore[method-assign]


@dataclasses.dataclass
class RowUpdate:
    """One group's update of a row's optimizer over given params and grads."""

    opt: FusedOptimizer
    group: dict[str, Any]
    lists: list[list[Tensor]]
    keys: tuple[str | None, ...]
    n_scratch: int

    @property
    def params(self) -> list[Tensor]:
        return self.lists[0]

    @property
    def grads(self) -> list[Tensor]:
        return self.lists[1]

    @property
    def steps(self) -> list[Tensor]:
        return self.lists[-1]

    @property
    def state(self) -> list[list[Tensor]]:
        """The state lists, one per state key (empty for a key the options turn off)."""
        return self.lists[2 : 2 + len(self.keys)]

    @property
    def scratch(self) -> list[list[Tensor]]:
        return self.lists[2 + len(self.keys) : 2 + len(self.keys) + self.n_scratch]

    @property
    def persistent(self) -> list[list[Tensor]]:
        """The lists a skipped step leaves bit for bit as they were: params, state, the rounding
        lists and the counters; not grads (inputs), nor scratch, which every launch zeroes
        before the kernels run (as the optimizer's step does), skipped or not."""
        kept = 2 + len(self.keys)
        return [self.params, *self.state, *self.lists[kept + self.n_scratch :]]

    @property
    def tensors(self) -> list[Tensor]:
        """Every tensor of every list."""
        return [t for ts in self.lists for t in ts]

    def state_dicts(self) -> list[dict[str, Tensor]]:
        """Each param's state as the optimizer would hold it: its state entries and ``step``."""
        named = [(key, ts) for key, ts in zip(self.keys, self.state) if key is not None]
        return [
            {**{key: ts[i] for key, ts in named}, "step": step} for i, step in enumerate(self.steps)
        ]

    def launch(self, found_inf: Tensor | None, inv_scale: Tensor | None) -> None:
        """Launches the update as the kernel backend does (``None``: a null pointer)."""
        opt, lists = self.opt, self.lists
        device = lists[0][0].device
        reduction = opt.grad_reduction(self.grads)
        reduce = (
            kernels.prepare_launch(reduction.kernel, reduction.tensor_lists(self.grads))
            if reduction is not None
            else None
        )
        updates = [kernels.prepare_launch(k, lists) for k in (*opt.kernels_before, opt.kernel)]
        epilogue = kernels.prepare_launch(kernels.STEP_EPILOGUE, [self.steps])
        found = kernels.scalar_pointer(found_inf, "found_inf", device)
        inv = kernels.scalar_pointer(inv_scale, "inv_scale", device)
        if reduction is not None and reduce is not None:
            reduction.out.zero_()
            reduce.run(reduction.kernel_args(found, inv))
        scratch = [t for ts in self.scratch for t in ts]
        if scratch:
            torch._foreach_zero_(scratch)
        args = opt.kernel_args(self.group, found, inv)
        for update in updates:
            update.run(args)
        epilogue.run(kernels.StepEpilogueArgs(found_inf=found))  # See Note [step counters]


def row_update(
    info: OptimInfo,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    config: Config | None = None,
    *,
    master_params: Sequence[Tensor] = (),
    sr_seeds: Sequence[Tensor] = (),
    **changes: Any,
) -> RowUpdate:
    """The update of the row's optimizer (``config`` with ``changes``) over ``params`` (any
    dense tensors: sizes, dtypes, storage offsets) and ``grads`` (any of our dtypes each), its
    state created as a first step creates it, with the rounding lists given."""
    opt = info.make(list(params), config, **changes)
    assert isinstance(opt, FusedOptimizer)
    group = opt.param_groups[0]
    keys = opt.state_keys(group)
    state: list[list[Tensor]] = [[] for _ in keys]
    steps = []
    for param in params:
        tensors, step, replacement = stage_state(param, opt.state.get(param, {}), keys)
        if replacement is not None:
            opt.state[param] = replacement
        filled = iter(tensors)
        for key, state_list in zip(keys, state):
            if key is not None:
                state_list.append(next(filled))
        steps.append(step)
    scratch = opt.scratch_lists(group, list(params))
    rounding = (
        kernels.rounding_lists(master_params, sr_seeds) if info.rounding else []
    )  # See Note [param rounding]
    lists = [list(params), list(grads), *state, *scratch, *rounding, steps]
    assert len(lists) == opt.kernel.n_lists, (info.name, [len(ts) for ts in lists])
    return RowUpdate(opt, group, lists, keys, len(scratch))


def check_parity(
    info: OptimInfo,
    config: Config,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    inv_scale: float | None,
    n_steps: int = 3,
    seed: int = 0,
    tolerance: Tolerance | None = None,
    **changes: Any,
) -> None:
    """Runs ``n_steps`` steps of the row's update on our kernels, each on fresh gradients, against
    its reference started from the update's current state (on CPU copies): params, state,
    counters advanced by one, grads never written.

    Note [fp32 and fp64 references]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A row without a torch.optim class is held to its own torch form in float64, and each param
    element may match the same torch form in float32 instead. Our kernels compute in fp32 by
    design (cuda/multi_tensor_apply.cuh); where fp32 and fp64 part by more than one rounding,
    neither is wrong: Lion takes the sign of ``lerp(m, g, 1 - beta1)``, and where that cancels
    exactly (16-bit grads make exact ties: m = g / 4 with beta1 = 0.8), the sign is rounding noise
    in either precision, so the param moves by +lr or -lr (2-8 ulp of fp16, 2 of 400k elements at
    the GPU tests' sizes). The fp32 torch form is the kernels' spec: on a GPU Lion equals it bit
    for bit.
    """
    generator = torch.Generator().manual_seed(seed)
    update = row_update(info, params, grads, config, **changes)
    tolerance = tolerance or info.tolerance
    device = params[0].device if params else torch.device("cpu")
    scale = torch.tensor(inv_scale, device=device) if inv_scale is not None else None
    for i in range(n_steps):
        for g in grads:  # fresh gradients every step
            g.copy_(torch.randn(g.shape, generator=generator).to(g.dtype))
        grads_before = clones(grads)
        dtype = info.reference_dtype or torch.float32
        unscaled = [g.to(dtype) * (inv_scale if inv_scale is not None else 1.0) for g in grads]
        expected_params, expected_state = reference_step(
            info, params, unscaled, update.state_dicts(), config, **changes
        )
        in_fp32 = (
            reference_step(
                info, params, [g.float() for g in unscaled], update.state_dicts(), config,
                dtype=torch.float32, **changes,
            )[0]
            if dtype == torch.float64
            else [None] * len(params)
        )
        update.launch(torch.zeros((), device=device), scale)
        for actual, expected in zip(update.state_dicts(), expected_state, strict=True):
            for key, value in actual.items():
                if key != "step":
                    assert_state_close(
                        value.cpu(), expected[key], tolerance.state_rtol, tolerance.state_atol
                    )
        assert all(s.item() == i + 1 for s in update.steps)
        for actual, expected, also in zip(params, expected_params, in_fp32):
            assert_param_close(
                actual.cpu(), expected, tolerance.param_rtol, tolerance.param_atol, also
            )
        assert_bytes_unchanged(grads_before, grads)  # update kernels never write grads
