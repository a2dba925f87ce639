"""KERNEL_CASES: one row per kernel of ``scaledoptim.kernels.builtin_kernels()``. The row drives
the emulated parity (test_emulated_parity.py), found_inf (test_emulated_found_inf.py),
AddressSanitizer (test_emulator_sanitizer.py), NVRTC (test_nvrtc.py) and GPU
(tests/gpu/test_gpu_fused_kernels.py) tests, so a new kernel is one row here plus, for an update
kernel, its ``reference_xxx`` in kernel_reference.py.

An update kernel's lists are ``params, grads, *state, [scratch,] master_params, sr_seeds,
steps`` (``kernel.lists`` starts with "params", "grads" and ends with "steps"; the rounding lists
of Note [param rounding] stay empty here, test_emulated_rounding.py fills them): it unscales
grads by ``inv_scale``, skips everything when ``found_inf`` is non-zero, and is followed by
STEP_EPILOGUE (Note [step counters]), as the optimizer launches it. An update of several
launches (LAMB: its norms first) gives them as ``prepare``.
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

import scaledoptim
from scaledoptim import kernels
from scaledoptim.kernels import ROUNDING_LISTS
from tests.kernels.kernel_checks import Tolerance, check_parity, launch_case  # noqa: F401 (re-exported)
from tests.kernels.kernel_lists import (
    GRAD_NORM_SQ,
    adagrad_lists,
    adam_lists,
    lamb_functional,
    lamb_lists,
    lion_lists,
    prepare_lamb,
    sgd_lists,
    with_rounding_lists,
    zero_steps,
)
from tests.kernels.kernel_reference import (
    DTYPES,
    adam_options,
    reference_adam,
    reference_sgd,
    sgd_options,
)
from tests.kernels.kernel_reference_more import (
    adagrad_options,
    lamb_options,
    lion_options,
    reference_adagrad,
    reference_lamb,
    reference_lion,
)

#: ``make_lists(params, grads, options, generator)``: every tensor list of the kernel, in order.
MakeLists = Callable[
    [Sequence[Tensor], Sequence[Tensor], dict, torch.Generator], list[list[Tensor]]
]
#: ``reference(params, grads, state, steps, inv_scale, options) -> (fp32 params, state)``.
Reference = Callable[..., tuple[list[Tensor], list[list[Tensor]]]]
#: ``prepare(lists) -> run(options, found_inf_pointer, inv_scale_pointer)``: validated launches.
Prepare = Callable[[Sequence[Sequence[Tensor]]], Callable[[dict, int | None, int | None], None]]


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
        n_state: how many lists after grads are state (the rest, up to the rounding lists,
            is scratch); ``None``: all of them.
        prepare: the update's launches when they are more than ``kernel`` with ``args``.
        tolerance: against the reference.
        mixed_param_dtypes: the param dtypes the hypothesis test mixes.
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
    n_state: int | None = None
    prepare: Prepare | None = None
    tolerance: Tolerance = field(default_factory=Tolerance)
    mixed_param_dtypes: tuple[torch.dtype, ...] = DTYPES

    @property
    def name(self) -> str:
        return self.kernel.source.stem

    def options(self, **changes: float | bool) -> dict:
        return self.defaults | changes

    def all_options(self) -> list[dict]:
        return [self.options(**entry) for entry in self.grid]

    def state(self, lists: Sequence[Sequence[Tensor]]) -> list[Sequence[Tensor]]:
        """The state lists among an update kernel's ``lists``."""
        end = -3 if self.kernel.lists[-3:-1] == ROUNDING_LISTS else -1
        return list(lists[2:end])[: self.n_state]


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
        scaledoptim.optim.adam.ADAM_KERNEL,
        make_lists=adam_lists,
        args=scaledoptim.optim.adam.adam_args,
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
        functional=with_rounding_lists(scaledoptim.optim.adam.adam_),
    ),
    KernelCase(
        scaledoptim.optim.sgd.SGD_KERNEL,
        make_lists=sgd_lists,
        args=scaledoptim.optim.sgd.sgd_args,
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
        functional=with_rounding_lists(scaledoptim.optim.sgd.sgd_),
    ),
    KernelCase(
        scaledoptim.optim.lion.LION_KERNEL,
        make_lists=lion_lists,
        args=scaledoptim.optim.lion.lion_args,
        update=True,
        defaults=lion_options(),
        grid=grid(maximize=(False, True), weight_decay=(0.0, 0.5)),
        hyper={
            "lr": st.floats(1e-4, 1e-1),
            "beta1": st.floats(0.0, 0.99),
            "beta2": st.floats(0.9, 0.999),
        },
        reference=reference_lion,
        functional=with_rounding_lists(scaledoptim.optim.lion.lion_),
    ),
    KernelCase(
        scaledoptim.optim.adagrad.ADAGRAD_KERNEL,
        make_lists=adagrad_lists,
        args=scaledoptim.optim.adagrad.adagrad_args,
        update=True,
        defaults=adagrad_options(),
        grid=grid(maximize=(False, True), weight_decay=(0.0, 0.1), lr_decay=(0.0, 0.05)),
        hyper={"lr": st.floats(1e-4, 1e-1), "eps": st.floats(1e-10, 1e-3)},
        reference=reference_adagrad,
        functional=with_rounding_lists(scaledoptim.optim.adagrad.adagrad_),
    ),
    KernelCase(
        scaledoptim.optim.lamb.LAMB_KERNEL,
        make_lists=lamb_lists,
        args=lambda found_inf, inv_scale, **options: scaledoptim.optim.lamb.lamb_args(
            found_inf, inv_scale, GRAD_NORM_SQ.data_ptr(), **options
        ),
        update=True,
        defaults=lamb_options(),
        grid=tuple(
            dict(
                weight_decay=w,
                adam_w_mode=a,
                grad_averaging=ga,
                use_nvlamb=n,
                max_grad_norm=c,
                bias_correction=b,
            )  # fmt: skip
            for w, a, ga, n, c, b in [
                (0.01, True, True, False, 1.0, True),
                (0.0, True, True, False, 1.0, True),  # no trust ratio
                (0.0, True, False, True, 0.5, True),
                (0.1, False, True, False, 0.0, False),  # L2, clipping off
                (0.1, True, True, True, 100.0, True),  # norm below the clip
            ]
        ),
        hyper={"lr": st.floats(1e-4, 1e-1)},
        reference=reference_lamb,
        functional=lamb_functional,
        n_state=2,
        prepare=prepare_lamb,
        # The trust ratio divides norms summed in another order than float64's.
        tolerance=Tolerance(param_rtol=2e-6, param_atol=2e-6, state_rtol=1e-5),
        # float64 reference: a 16-bit param that nearly cancels its update is off by more than
        # an ulp (the every-dtype test above holds them to one ulp at boundary sizes).
        mixed_param_dtypes=(torch.float32,),
    ),
    # LAMB's norm launches, as the ASan and NVRTC tests see them (the LAMB row runs them).
    KernelCase(
        scaledoptim.optim.lamb.LAMB_NORMS_KERNEL,
        make_lists=lambda params, grads, options, generator: lamb_lists(
            params, grads, options, generator
        ),
        args=lambda found_inf, inv_scale: scaledoptim.optim.lamb.lamb_args(
            found_inf, inv_scale, GRAD_NORM_SQ.data_ptr(), **lamb_options()
        ),
    ),
    KernelCase(
        scaledoptim.optim.lamb.LAMB_GRAD_NORM_KERNEL,
        make_lists=lambda params, grads, options, generator: [list(grads)],
        args=lambda found_inf, inv_scale: scaledoptim.optim.lamb.LambNormArgs(
            found_inf, inv_scale, GRAD_NORM_SQ.data_ptr()
        ),
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
