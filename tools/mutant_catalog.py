"""The planted defects of ``tools/mutants.py``: one :class:`Mutant` per defect the suite must catch.

A mutant is one or more exact text edits (a file, the text as it stands, its replacement), what
the defect is, and the test paths to run first (the directories or files most likely to catch
it; the rest of the suite runs only when they pass). An edit whose original text no longer
occurs exactly once in its file makes the mutant *stale*: after a refactor, update the text
(and keep the defect), or retire the mutant with a note of where its defect went.

Keep each defect realistic (a slip a person could make and a reviewer could miss), each layer
covered (kernels, torch forms, the scale, the protocol, loads, distributed, the cache, amp), and
the first paths small, so that a caught mutant costs seconds, not the suite.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Edit:
    """Replace ``original`` (which must occur exactly once in ``path``) by ``replacement``."""

    path: str
    original: str
    replacement: str


@dataclasses.dataclass(frozen=True)
class Mutant:
    """A planted defect: ``edits`` applied together, described by ``description``; ``first``
    are the test paths (directories or files) run before the rest of the suite."""

    name: str
    description: str
    edits: tuple[Edit, ...]
    first: tuple[str, ...]


def _one(name: str, description: str, path: str, original: str, replacement: str,
         *first: str) -> Mutant:
    return Mutant(name, description, (Edit(path, original, replacement),), first)


_PARITY = "tests/parity"
_REFUSALS = "tests/refusals"

CATALOG: tuple[Mutant, ...] = (
    # ---------------------------------------------------------------- kernel math (cuda/*.cu)
    _one(
        "adam-eps-inside-bias-correction",
        "Adam's eps added before dividing by sqrt(1 - beta2^t) instead of after",
        "cuda/adam.cu",
        "const float denom = sqrtf(second_moment) / s.bias_correction2_sqrt + a.eps;",
        "const float denom = (sqrtf(second_moment) + a.eps) / s.bias_correction2_sqrt;",
        _PARITY, "tests/kernels",
    ),
    _one(
        "adam-bias-correction2-without-sqrt",
        "Adam divides by 1 - beta2^t instead of its square root",
        "cuda/adam.cu",
        "s.bias_correction2_sqrt = sqrtf(-expm1f(step * a.log_beta2));",
        "s.bias_correction2_sqrt = -expm1f(step * a.log_beta2);",
        _PARITY, "tests/kernels",
    ),
    _one(
        "sgd-nesterov-swapped",
        "SGD's Nesterov step adds momentum * grad to the buffer instead of momentum * buffer "
        "to the grad",
        "cuda/sgd.cu",
        "g = a.nesterov ? fmaf(a.momentum, buf, g) : buf;",
        "g = a.nesterov ? fmaf(a.momentum, g, buf) : buf;",
        _PARITY, "tests/kernels",
    ),
    _one(
        "rmsprop-centered-ignored",
        "RMSprop's centered variant forgets to subtract the squared grad average",
        "cuda/rmsprop.cu",
        "avg = sqrtf(fmaf(-grad_avg, grad_avg, square_avg));",
        "avg = sqrtf(square_avg);",
        _PARITY, "tests/kernels",
    ),
    _one(
        "adagrad-lr-decay-off-by-one",
        "Adagrad decays the learning rate by the step number instead of the steps before it",
        "cuda/adagrad.cu",
        "const float clr = args.lr / (1.0f + (step.number - 1.0f) * args.lr_decay);",
        "const float clr = args.lr / (1.0f + step.number * args.lr_decay);",
        _PARITY, "tests/kernels",
    ),
    _one(
        "lamb-bias-correction2-beta1",
        "LAMB's second bias correction uses beta1",
        "cuda/lamb.cu",
        "s.bias_correction2 = a.bias_correction ? -expm1f(step * a.log_beta2) : 1.0f;",
        "s.bias_correction2 = a.bias_correction ? -expm1f(step * a.log_beta1) : 1.0f;",
        _PARITY, "tests/kernels",
    ),
    _one(
        "bf16-round-half-up",
        "the kernels' bf16 store rounds ties up instead of to even",
        "cuda/dtypes.cuh",
        "return static_cast<unsigned short>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);",
        "return static_cast<unsigned short>((bits + 0x8000u) >> 16);",
        "tests/kernels", _PARITY,
    ),
    _one(
        "fp16-round-half-up",
        "the emulated fp16 store rounds ties up instead of to even",
        "cuda/dtypes.cuh",
        "const unsigned rounded = abs + 0xfffu + ((abs >> 13) & 1u);",
        "const unsigned rounded = abs + 0x1000u;",
        "tests/kernels", _PARITY,
    ),
    _one(
        "stochastic-rounding-half-noise",
        "stochastic rounding draws 15 bits of noise: biased towards rounding down",
        "cuda/dtypes.cuh",
        "return so_fmix32(static_cast<unsigned>(index) ^ key) >> 16;",
        "return so_fmix32(static_cast<unsigned>(index) ^ key) >> 17;",
        "tests/kernels", "tests/fused", _PARITY,
    ),
    _one(
        "master-weights-not-stored",
        "with master weights, the update stores the param but not its fp32 master",
        "cuda/multi_tensor_apply.cuh",
        "  if (pr.master) store(pr.master, r, l);\n",
        "",
        _PARITY, "tests/fused", "tests/kernels",
    ),
    # ------------------------------------------------------------------- the skip on found_inf
    _one(
        "kernel-skip-only-above-one",
        "the update kernels skip only when found_inf > 1: a flag of 1.0 steps anyway",
        "cuda/common.cuh",
        "return found_inf != nullptr && *found_inf != 0.0f;",
        "return found_inf != nullptr && *found_inf > 1.0f;",
        "tests/kernels", _PARITY,
    ),
    _one(
        "host-skip-ignored",
        "a CPU torch form never reads found_inf: it steps on overflowed grads",
        "scaledoptim/torch_ops/skip.py",
        "return found_inf is not None and bool(found_inf.item())",
        "return False",
        "tests/fused", _PARITY,
    ),
    _one(
        "counters-advance-on-skip",
        "the packed step counters advance on a skipped step",
        "scaledoptim/torch_ops/skip.py",
        "steps.flat.add_(1 if found_inf is None else 1 - found_inf)",
        "steps.flat.add_(1)",
        "tests/fused", _PARITY,
    ),
    _one(
        "working-copies-always-copied",
        "the sync-free torch form copies its working copies back on a skipped step",
        "scaledoptim/torch_ops/skip.py",
        "        d.copy_(torch.where(skip, d, s))",
        "        d.copy_(s)",
        "tests/fused", _PARITY,
    ),
    # -------------------------------------------------------------------------- the loss scale
    _one(
        "kernel-growth-one-step-late",
        "the epilogue kernel grows the scale one clean step after growth_interval",
        "cuda/step_epilogue.cu",
        "const bool grow = !overflow && clean_steps >= a.growth_interval;",
        "const bool grow = !overflow && clean_steps > a.growth_interval;",
        "tests/scale", "tests/kernels", _PARITY,
    ),
    _one(
        "torch-growth-one-step-late",
        "LossScale's general path grows the scale one clean step after growth_interval",
        "scaledoptim/scale/loss_scale.py",
        "grow = ~overflow & (clean_steps >= c.tracked_growth_interval)",
        "grow = ~overflow & (clean_steps > c.tracked_growth_interval)",
        "tests/scale", "tests/protocol",
    ),
    _one(
        "kernel-backoff-below-min-scale",
        "the epilogue kernel backs off below min_scale",
        "cuda/step_epilogue.cu",
        "    if (next < a.min_scale) next = a.min_scale;\n",
        "",
        "tests/scale", "tests/kernels", "tests/protocol",
    ),
    _one(
        "torch-backoff-by-growth-factor",
        "LossScale's general path backs off by multiplying with the growth factor",
        "scaledoptim/scale/loss_scale.py",
        "backed_off = (wide * c.backoff_factor).float().clamp_(min=c.min_scale)",
        "backed_off = (wide * c.growth_factor).float().clamp_(min=c.min_scale)",
        "tests/scale", "tests/protocol",
    ),
    _one(
        "kernel-hysteresis-one-extra",
        "the epilogue kernel tolerates one overflow more than the hysteresis allows",
        "cuda/step_epilogue.cu",
        "const bool back_off = overflow && (a.force_backoff || hysteresis_left <= 0);",
        "const bool back_off = overflow && (a.force_backoff || hysteresis_left < 0);",
        "tests/scale", "tests/kernels", "tests/protocol",
    ),
    _one(
        "torch-hysteresis-never-counts",
        "LossScale's general path never writes the hysteresis tracker: it never backs off",
        "scaledoptim/scale/loss_scale.py",
        "        if c.hysteresis > 1:\n"
        "            self.hysteresis_tracker.copy_(hysteresis_left)\n",
        "",
        "tests/scale", "tests/protocol",
    ),
    _one(
        "forced-backoff-ignored",
        "a closure replay's forced backoff waits for the hysteresis like any overflow",
        "scaledoptim/scale/loss_scale.py",
        "back_off = overflow if force_backoff else overflow & (hysteresis_left <= 0)",
        "back_off = overflow & (hysteresis_left <= 0)",
        "tests/protocol", "tests/scale",
    ),
    # ------------------------------------------------------------------ unscaling and clipping
    _one(
        "kernel-ignores-inv-scale",
        "the fused update kernels read the grads without multiplying by inv_scale",
        "cuda/multi_tensor_apply.cuh",
        "math(rp[k], rg[k] * u.inv_scale, state.r[k]...);",
        "math(rp[k], rg[k], state.r[k]...);",
        "tests/kernels", _PARITY,
    ),
    _one(
        "check-before-unscaling",
        "the kernels' inf/nan check tests the scaled values: an overflow in the unscale at a "
        "scale below 1 is missed",
        "cuda/non_finite_check.cu",
        "for (int k = 0; k < kILP; ++k) seen |= !is_finite(r[k] * inv_scale);",
        "for (int k = 0; k < kILP; ++k) seen |= !is_finite(r[k]);",
        "tests/kernels", "tests/protocol", _PARITY,
    ),
    # (A float32 reciprocal instead of GradScaler's float64 one is no defect: it rounds to the
    # same float for every float32 scale, checked on two million of them.)
    # The step pipeline's check (the joint forms, a GradScaler's step) and its split unscale
    # each take the reciprocal of the scale the grads were scaled by: both divide by the wrong one.
    Mutant(
        "unscale-by-own-scale",
        "the unscale divides by the optimizer's own scale, not by the grads_scaled_by it is given",
        (
            Edit("scaledoptim/protocol/steps.py",
                 "inv_scale = scaled_by.double().reciprocal().float() if scaled_by is not None "
                 "else None",
                 "inv_scale = state.loss_scale.scale.double().reciprocal().float() "
                 "if scaled_by is not None else None"),
            Edit("scaledoptim/protocol/steps.py",
                 "unscale_in_place_(plan.grads, found_inf, "
                 "scaled_by.double().reciprocal().float())",
                 "unscale_in_place_(plan.grads, found_inf, "
                 "state.loss_scale.scale.double().reciprocal().float())"),
        ),
        ("tests/protocol", _PARITY),
    ),
    _one(
        "unscale-rechecks-nothing",
        "the in-place unscale does not check again after multiplying: an overflow in the "
        "unscale is missed",
        "scaledoptim/torch_ops/skip.py",
        "    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)\n"
        "    # Not `inv_scale <= 1`: a scale that is not a number is checked too.\n"
        "    if not host_reads or not inv_scale.item() <= 1.0:\n"
        "        _check_non_finite_(tensors, found_inf)\n",
        "    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)\n",
        "tests/protocol", "tests/fused", _PARITY,
    ),
    _one(
        "clip-coefficient-without-epsilon",
        "the clip coefficient divides by the norm without clip_grad_norm_'s 1e-6",
        "scaledoptim/protocol/clipping.py",
        "return torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)",
        "return torch.clamp(max_grad_norm / norm, max=1.0)",
        "tests/protocol", _PARITY,
    ),
    _one(
        "clip-coefficient-unclamped",
        "the clip coefficient is not clamped to 1: small grads are scaled up",
        "scaledoptim/protocol/clipping.py",
        "return torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)",
        "return max_grad_norm / (norm + 1e-6)",
        "tests/protocol", _PARITY,
    ),
    # --------------------------------------------------------- outside references (Lion, LAMB)
    Mutant(
        "lion-shared-beta-swap",
        "Lion's update direction interpolates with beta2 instead of beta1, in the kernel and "
        "in the torch form alike (a formula error only an outside reference sees)",
        (
            Edit("cuda/lion.cu", "const float c = torch_lerp(m, g, a.one_minus_beta1);",
                 "const float c = torch_lerp(m, g, a.one_minus_beta2);"),
            Edit("scaledoptim/optim/lion.py",
                 'c = torch._foreach_lerp(exp_avgs, grads, 1 - o["beta1"])',
                 'c = torch._foreach_lerp(exp_avgs, grads, 1 - o["beta2"])'),
        ),
        (_PARITY, "tests/optim"),
    ),
    Mutant(
        "lamb-shared-clip-by-squared-norm",
        "LAMB clips by the squared global grad norm instead of the norm, in the kernel and in "
        "the torch form alike (a formula error only an outside reference sees)",
        (
            Edit("cuda/lamb.cu", "const float norm = sqrtf(*a.grad_norm_sq);",
                 "const float norm = *a.grad_norm_sq;"),
            Edit("scaledoptim/optim/lamb.py",
                 'torch.clamp(grad_norm_sq.sqrt() / o["max_grad_norm"], min=1.0)',
                 'torch.clamp(grad_norm_sq / o["max_grad_norm"], min=1.0)'),
        ),
        (_PARITY, "tests/optim"),
    ),
    _one(
        "lamb-torch-form-eps-placement",
        "LAMB's torch form adds eps to sqrt(v) without the sqrt(1 - beta2^t) it is scaled by",
        "scaledoptim/optim/lamb.py",
        'self.epsilons = (o["eps"] * root_bc2).to(dtype)',
        'self.epsilons = torch.full_like(root_bc2, o["eps"]).to(dtype)',
        _PARITY, "tests/optim", "tests/fused",
    ),
    # --------------------------------------------------------------------------------- loads
    _one(
        "load-accepts-negative-tracker",
        "a loss_scale state with a negative growth or hysteresis tracker loads",
        "scaledoptim/scale/loss_scale.py",
        "if not 0 <= values[name] <= limit:",
        "if not values[name] <= limit:",
        "tests/scale", _REFUSALS, "tests/fused",
    ),
    _one(
        "checkpoint-forgets-growth-tracker",
        "a checkpoint saves a growth tracker of zero: a resumed run grows the scale late",
        "scaledoptim/scale/loss_scale.py",
        '"growth_tracker": self.growth_tracker.detach().clone(),',
        '"growth_tracker": torch.zeros_like(self.growth_tracker),',
        "tests/checkpoints", "tests/scale",
    ),
    _one(
        "load-accepts-negative-step",
        "an optimizer state_dict with a negative step count loads",
        "scaledoptim/fused/loading.py",
        'if number and not (step >= 0 and step != float("inf")):',
        'if number and not (step != float("inf")):',
        "tests/fused", _REFUSALS, "tests/optim",
    ),
    # ----------------------------------------------------------------------------- DTensors
    _one(
        "mesh-sums-not-reduced",
        "LAMB's per-tensor norms of DTensors sharded alike are not summed over the mesh",
        "scaledoptim/torch_ops/sharded.py",
        "                    torch.distributed.all_reduce(partials, group=group)\n",
        "                    pass\n",
        "tests/distributed",
    ),
    _one(
        "clip-norm-of-local-shards",
        "the clipping norm of DTensor grads is the local shard's, not the whole tensor's",
        "scaledoptim/protocol/clipping.py",
        "        total = full_tensor()\n",
        "        total = total.to_local()\n",
        "tests/distributed",
    ),
    _one(
        "found-inf-not-agreed",
        "found_inf is not all-reduced over the process group: ranks skip apart",
        "scaledoptim/scale/distributed.py",
        "    work = dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=process_group, "
        "async_op=True)\n    work.wait()\n",
        "    return\n",
        "tests/distributed",
    ),
    # ----------------------------------------------------------------------------- the cache
    _one(
        "cache-skips-param-pointers",
        "the step cache does not re-verify the params' data pointers",
        "scaledoptim/fused/plan.py",
        "            or list(map(_DATA_PTR, params)) != self.param_ptrs\n",
        "",
        # The test that fails on it first: elsewhere (test_master_weights_edits.py, the
        # hypothesis sequences of test_step_cache.py) the kernels write through a freed param's
        # stale pointer, and pytest dies by SIGABRT or SIGSEGV (reported broken, not caught).
        "tests/fused/test_step_cache_mutations.py", "tests/fused/test_step_cache.py",
    ),
    _one(
        "cache-skips-state-pointers",
        "the step cache does not re-verify where the optimizer state lives",
        "scaledoptim/fused/plan.py",
        "            if _state_pointers(optimizer.state) != self.state_ptrs:\n"
        "                return None\n",
        "",
        "tests/fused/test_step_cache.py", "tests/fused/test_step_cache_mutations.py",
    ),
    # --------------------------------------------------------------------------------- amp
    _one(
        "autocast-promote-to-lower",
        "an edited op with the promote policy casts to the region's lower precision",
        "scaledoptim/amp/cast_kernels.py",
        "            widest = torch.float32\n",
        "            widest = lower\n",
        "tests/amp",
    ),
    # ------------------------------------------------------------------- the GradScaler facade
    _one(
        "gradscaler-step-forgets-unscale-inf",
        "scaledoptim.GradScaler.step after unscale_ steps without the found_inf unscale_ found",
        "scaledoptim/protocol/gradscaler.py",
        "request = Request(pending=GradPass(found_inf))",
        "request = Request(pending=GradPass(torch.zeros_like(found_inf)))",
        "tests/protocol",
    ),
)
