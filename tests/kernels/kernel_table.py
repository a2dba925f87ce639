"""KERNEL_CASES: one row per kernel of ``scaledoptim.kernels.BUILTIN_KERNELS``. The row drives
the emulated parity (test_emulated_parity.py), found_inf (test_emulated_found_inf.py),
AddressSanitizer (test_emulator_sanitizer.py), NVRTC (test_nvrtc.py) and GPU
(tests/gpu/test_gpu_fused_kernels.py) tests, so a new kernel is one row here plus, for an update
kernel, its ``reference_xxx`` in kernel_reference.py.

An update kernel's lists are ``params, grads, *state, steps`` (``kernel.lists`` starts with
"params", "grads" and ends with "steps"): it unscales grads by ``inv_scale``, skips everything
when ``found_inf`` is non-zero, and is followed by STEP_EPILOGUE (Note [step counters]), as the
optimizer launches it.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import strategies as st
from torch import Tensor

from scaledoptim import kernels
from tests.kernels.kernel_reference import (
    adam_options,
    assert_bytes_unchanged,
    assert_param_close,
    assert_state_close,
    reference_adam,
    reference_sgd,
    sgd_options,
    snapshot,
)

#: ``make_lists(params, grads, options, generator)``: every tensor list of the kernel, in order.
MakeLists = Callable[
    [Sequence[Tensor], Sequence[Tensor], dict, torch.Generator], list[list[Tensor]]
]
#: ``reference(params, grads, state, steps, inv_scale, options) -> (fp32 params, state)``.
Reference = Callable[..., tuple[list[Tensor], list[list[Tensor]]]]


@dataclass(frozen=True)
class KernelCase:
    """One kernel as the tests see it.

    Args:
        kernel: the ``MultiTensorKernel``.
        make_lists: its tensor lists for ``params`` and ``grads`` (any sizes and dtypes, on
            their device) under ``options``; state as the optimizer creates it, steps zero.
        args: its args struct from ``(found_inf_pointer, inv_scale_pointer, **options)``.
        update: an update kernel (honours found_inf and inv_scale, is followed by the counters).
        defaults: every option ``args`` takes (update kernels).
        grid: the option combinations every generic test runs, each applied over ``defaults``.
        hyper: hypothesis strategies of the float options the property test varies.
        reference: the fp32 torch step (update kernels).
        functional: the public ``kernels.xxx_`` entry point, taking the lists positionally.
    """

    kernel: kernels.MultiTensorKernel
    make_lists: MakeLists
    args: Callable[..., ctypes.Structure]
    update: bool = False
    defaults: dict = field(default_factory=dict)
    grid: tuple[dict, ...] = ({},)
    hyper: dict[str, st.SearchStrategy] = field(default_factory=dict)
    reference: Reference | None = None
    functional: Callable[..., None] | None = None

    @property
    def name(self) -> str:
        return self.kernel.source.stem

    def options(self, **changes: float | bool) -> dict:
        return self.defaults | changes

    def all_options(self) -> list[dict]:
        return [self.options(**entry) for entry in self.grid]


def zero_steps(params: Sequence[Tensor]) -> list[Tensor]:
    return [torch.zeros((), device=p.device) for p in params]


def fp32_zeros(params: Sequence[Tensor]) -> list[Tensor]:
    return [torch.zeros_like(p, dtype=torch.float32) for p in params]


def adam_lists(params, grads, options, generator) -> list[list[Tensor]]:
    max_exp_avg_sqs = fp32_zeros(params) if options["amsgrad"] else []
    return [
        list(params),
        list(grads),
        fp32_zeros(params),
        fp32_zeros(params),
        max_exp_avg_sqs,
        zero_steps(params),
    ]


def sgd_lists(params, grads, options, generator) -> list[list[Tensor]]:
    # Garbage buffers: the first taken step must overwrite them with the gradient.
    buffers = (
        [torch.randn(p.shape, generator=generator).to(p.device) for p in params]
        if options["momentum"]
        else []
    )
    return [list(params), list(grads), buffers, zero_steps(params)]


def grid(**choices: Sequence) -> tuple[dict, ...]:
    """Every combination of ``choices``, as option dicts."""
    return tuple(dict(zip(choices, values)) for values in itertools.product(*choices.values()))


KERNEL_CASES: tuple[KernelCase, ...] = (
    KernelCase(
        kernels.NON_FINITE_CHECK,
        make_lists=lambda params, grads, options, generator: [list(grads)],
        args=lambda found_inf, inv_scale: kernels.NonFiniteCheckArgs(found_inf),
    ),
    KernelCase(
        kernels.STEP_EPILOGUE,
        make_lists=lambda params, grads, options, generator: [zero_steps(params)],
        args=lambda found_inf, inv_scale: kernels.StepEpilogueArgs(found_inf=found_inf),
    ),
    KernelCase(
        kernels.ADAM,
        make_lists=adam_lists,
        args=kernels.adam_args,
        update=True,
        defaults=adam_options(lr=1e-2),
        grid=grid(
            decoupled_weight_decay=(False, True),
            amsgrad=(False, True),
            maximize=(False, True),
            weight_decay=(0.0, 0.1),
        ),
        hyper={
            "lr": st.floats(1e-4, 1e-1),
            "beta1": st.floats(0.0, 0.99),
            "beta2": st.floats(0.9, 0.9999),
            "eps": st.floats(1e-10, 1e-3),
        },
        reference=reference_adam,
        functional=kernels.adam_,
    ),
    KernelCase(
        kernels.SGD,
        make_lists=sgd_lists,
        args=kernels.sgd_args,
        update=True,
        defaults=sgd_options(lr=0.05),
        grid=tuple(
            entry
            for entry in grid(
                momentum=(0.0, 0.9),
                dampening=(0.0, 0.3),
                nesterov=(False, True),
                weight_decay=(0.0, 0.1),
                maximize=(False, True),
            )
            # dampening and nesterov only act through momentum
            if not (entry["momentum"] == 0 and (entry["dampening"] or entry["nesterov"]))
        ),
        hyper={"lr": st.floats(1e-4, 1.0)},
        reference=reference_sgd,
        functional=kernels.sgd_,
    ),
)

UPDATE_CASES = tuple(case for case in KERNEL_CASES if case.update)


def case_id(case: KernelCase) -> str:
    return case.name


def options_id(options: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in options.items())


#: ``(case, options)`` for every update kernel and every option of its grid, as pytest params.
CASE_OPTIONS = [
    pytest.param(case, options, id=f"{case.name}-{options_id(entry)}")
    for case in UPDATE_CASES
    for entry, options in zip(case.grid, case.all_options())
]


def pointer(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def launch_case(
    case: KernelCase,
    lists: Sequence[Sequence[Tensor]],
    options: dict,
    found_inf: Tensor | None,
    inv_scale: Tensor | None,
) -> None:
    """Launches ``case.kernel`` on ``lists`` as the optimizer does: both launches of an update
    kernel (the update, then STEP_EPILOGUE advancing its last list) validated before either runs."""
    launch = kernels.prepare_launch(case.kernel, lists)
    advance = kernels.prepare_launch(kernels.STEP_EPILOGUE, [lists[-1]]) if case.update else None
    launch.run(case.args(pointer(found_inf), pointer(inv_scale), **options))
    if advance is not None:
        advance.run(kernels.StepEpilogueArgs(found_inf=pointer(found_inf)))


@dataclass(frozen=True)
class Tolerance:
    """Of a kernel's result against its fp32 reference (16-bit params: always one ulp)."""

    param_rtol: float = 1e-6
    param_atol: float = 1e-6
    state_rtol: float = 1e-6
    state_atol: float = 1e-7


def check_parity(
    case: KernelCase,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    options: dict,
    inv_scale: float | None,
    n_steps: int = 3,
    seed: int = 0,
    tolerance: Tolerance = Tolerance(),
) -> None:
    """Runs ``n_steps`` update steps of ``case``, each on fresh gradients, against its reference
    started from the kernel's current state (on CPU copies): params, state, counters advanced by
    one, grads never written."""
    generator = torch.Generator().manual_seed(seed)
    lists = case.make_lists(params, grads, options, generator)
    state, steps = lists[2:-1], lists[-1]
    device = params[0].device if params else torch.device("cpu")
    scale = torch.tensor(inv_scale, device=device) if inv_scale is not None else None
    for i in range(n_steps):
        for g in grads:  # fresh gradients every step
            g.copy_(torch.randn(g.shape, generator=generator).to(g.dtype))
        grads_before = snapshot(grads)
        expected_params, expected_state = case.reference(
            *([t.cpu() for t in ts] for ts in (params, grads)),
            [[t.cpu() for t in ts] for ts in state],
            [s.cpu() for s in steps],
            inv_scale,
            options,
        )
        launch_case(case, lists, options, torch.zeros((), device=device), scale)
        for actual_list, expected_list in zip(state, expected_state, strict=True):
            for actual, expected in zip(actual_list, expected_list, strict=True):
                assert_state_close(
                    actual.cpu(), expected, tolerance.state_rtol, tolerance.state_atol
                )
        assert all(s.item() == i + 1 for s in steps)
        for actual, expected in zip(params, expected_params):
            assert_param_close(actual.cpu(), expected, tolerance.param_rtol, tolerance.param_atol)
        assert_bytes_unchanged(grads_before, grads)  # update kernels never write grads
