"""torch's own optimizer table, run against scaledoptim's drop-ins side by side with torch.optim.

``torch.testing._internal.common_optimizers.optim_db`` (in the torch wheel) holds, per optimizer,
the constructor configs torch's generic suite runs (``optim_inputs_func``) and the inputs it must
refuse (``optim_error_inputs_func``). For every optimizer scaledoptim ships under torch's name,
every config, expanded with the flags the row supports (``foreach``, ``differentiable``,
``fused``: each on, the others off, as torch's suite expands them; ``foreach`` on the CPU too),
steps our class and torch's from the same params and grads, on both backends, in float32,
float64 and complex64: params and every state entry torch keeps agree to the dtype's tolerance,
and where torch raises ours raises the same exception type at the same point. Then the same for
params torch takes and our kernels cannot (sparse grads, views with gaps), for the loss-scaling
protocol on them, and for every error input.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import scaledoptim
from scaledoptim.testing import torch_optim_db
from scaledoptim.testing.torch_optim_db import TorchConfig
from tests.support.references import kernels_mode
from tests.support.torch_errors import assert_raises_as_torch_optim

#: torch's rows of the optimizers scaledoptim ships under torch's name (RMSprop once it lands).
ROWS = [info for info in torch_optim_db.rows() if hasattr(scaledoptim, info.name)]
CASES = torch_optim_db.configs(ROWS)
BASE_CASES = [case for case in CASES if not case.flagged]
DTYPES = [torch.float32, torch.float64, torch.complex64]
STEPS = 3
#: Our kernels in the emulator, and the torch forms. float64 and complex params take the same
#: route on either (neither reaches our kernels): they run on the torch forms only.
BACKENDS = ("torch", "emulate")


def _on_each_backend(check: Callable[[], None], backends: tuple[str, ...] = BACKENDS) -> None:
    """``check()`` on each backend; a failure names the backend."""
    for backend in backends:
        with kernels_mode(backend):
            try:
                check()
            except AssertionError as error:
                raise AssertionError(f"on the {backend} backend: {error}") from error


def test_the_drop_ins_are_all_covered() -> None:
    assert {"Adam", "AdamW", "SGD", "Adagrad", "LBFGS"} <= {info.name for info in ROWS}


def _ours(case: TorchConfig) -> type[torch.optim.Optimizer]:
    return getattr(scaledoptim, case.info.name)


# ------------------------------------------------------------------------- running both sides
def _leaves(
    dtype: torch.dtype, shapes: tuple[tuple[int, ...], ...], seed: int
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=dtype) for shape in shapes]


def _params(
    case: TorchConfig, values: list[torch.Tensor], views: Callable[[torch.Tensor], torch.Tensor]
):
    """Params holding ``values``: leaves, or, for a differentiable step (which updates its params
    in place under autograd), non-leaf clones of leaves, whose grads through the steps the test
    compares."""
    if case.differentiable:
        leaves = [v.clone().requires_grad_() for v in values]
        return leaves, [views(leaf.clone()) for leaf in leaves]
    params = [torch.nn.Parameter(views(v.clone())) for v in values]
    return params, params


def _grad(param: torch.Tensor, step: int, index: int, sparse: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + index)
    grad = torch.randn(param.shape, generator=generator, dtype=param.dtype)
    if sparse:
        grad[::2] = 0  # rows without a gradient, as an embedding's
        return grad.to_sparse()
    return grad


def _run(
    cls: type[torch.optim.Optimizer],
    case: TorchConfig,
    dtype: torch.dtype,
    *,
    views: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    shapes: tuple[tuple[int, ...], ...] = ((4, 3), (3,), (2, 5)),
    sparse: bool = False,
) -> tuple[str, Any]:
    """``("raised", (phase, type))`` or ``("stepped", (leaves, params, optimizer))``."""
    leaves, params = _params(case, _leaves(dtype, shapes, seed=0), views)
    kwargs = copy.deepcopy(case.kwargs)
    try:
        opt = cls(params, **kwargs)
    except Exception as error:
        return "raised", ("construction", type(error))
    for step in range(STEPS):
        closure = None
        if case.info.step_requires_closure:
            closure = _closure(opt, params, step)
        else:
            for index, param in enumerate(params):
                param.grad = _grad(param, step, index, sparse)
        before = _snapshot(opt)
        try:
            opt.step(closure)
        except Exception as error:
            if isinstance(opt, scaledoptim.Optimizer):  # plan, then commit: nothing changed
                _assert_bit_identical(before, _snapshot(opt))
            return "raised", ("step", type(error))
    return "stepped", (leaves, params, opt)


def _snapshot(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    params = [p for group in opt.param_groups for p in group["params"]]
    state = [
        v for p in params for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)
    ]
    return [t.detach().clone() for t in params + state]


def _assert_bit_identical(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    assert len(before) == len(after)
    for a, b in zip(before, after):
        assert torch.equal(_bits(a), _bits(b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.to_dense() if t.is_sparse else t
    return torch.view_as_real(t) if t.is_complex() else t


def _closure(opt: torch.optim.Optimizer, params: list[torch.Tensor], step: int):
    targets = _leaves(params[0].dtype, tuple(tuple(p.shape) for p in params), seed=step + 1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        with torch.enable_grad():
            loss = sum((p - t).abs().pow(2).sum() for p, t in zip(params, targets))
            loss.backward()
        return loss

    return closure


def _side_by_side(case: TorchConfig, dtype: torch.dtype, **options: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own deprecation and sparse-invariant notes
        expected = _run(case.torch_class, case, dtype, **options)
        actual = _run(_ours(case), case, dtype, **options)
    if expected[0] == "raised":
        assert actual[0] == "raised", f"torch raised {expected[1]}, scaledoptim stepped"
        assert actual[1] == expected[1]
        return
    assert actual[0] == "stepped", f"scaledoptim raised {actual[1]}, torch stepped"
    (ref_leaves, ref_params, ref_opt), (leaves, params, opt) = expected[1], actual[1]
    for ours, ref in zip(params, ref_params):
        torch.testing.assert_close(ours.detach(), ref.detach())
    _assert_state_matches(opt, ref_opt, params, ref_params)
    if case.differentiable:
        _assert_same_gradient(leaves, params, ref_leaves, ref_params)


def _assert_same_gradient(leaves, params, ref_leaves, ref_params) -> None:
    """The steps stayed differentiable, with torch's gradient (or torch's error)."""
    ref_grads, grads = _gradient(ref_params, ref_leaves), _gradient(params, leaves)
    if isinstance(ref_grads, type):  # torch's backward through its steps raised
        assert grads == ref_grads
        return
    assert not isinstance(grads, type), f"scaledoptim's backward raised {grads}"
    for ours, ref in zip(grads, ref_grads):
        torch.testing.assert_close(ours, ref)


def _gradient(params: list[torch.Tensor], leaves: list[torch.Tensor]) -> Any:
    """The gradient through the steps of the leaves the params started from, or the type of
    what backward raised (torch's amsgrad modifies a tensor autograd saved, over several steps)."""
    try:
        return torch.autograd.grad(sum(p.abs().sum() for p in params), leaves)
    except RuntimeError as error:
        return type(error)


def _assert_state_matches(opt, ref_opt, params, ref_params) -> None:
    """Every entry torch keeps, ours keeps with the same value (ours may keep more: SGD's step)."""
    for param, ref_param in zip(params, ref_params):
        ref_state, state = ref_opt.state[ref_param], opt.state[param]
        for key, expected in ref_state.items():
            actual = state[key]
            if isinstance(expected, torch.Tensor) and expected.is_sparse:
                expected = expected.to_dense()
            if isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor):
                actual = actual.to(expected.dtype)  # a float32 step counter for a float64 one
            torch.testing.assert_close(
                actual, expected, msg=lambda m, key=key: f"state {key!r}: {m}"
            )


# ------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_config_steps_as_torch_optim(case: TorchConfig) -> None:
    """float32 on both backends; float64 and complex64 (where torch takes them) once."""
    for dtype in DTYPES:
        if dtype.is_complex and not case.info.supports_complex:
            continue
        backends = BACKENDS if dtype == torch.float32 else BACKENDS[:1]
        _on_each_backend(lambda dtype=dtype: _side_by_side(case, dtype), backends)


@pytest.mark.parametrize("case", BASE_CASES, ids=str)
def test_views_with_gaps_step_as_torch_optim(case: TorchConfig) -> None:
    def check() -> None:
        _side_by_side(case, torch.float32, views=lambda t: t.t(), shapes=((3, 4), (6, 4)))
        _side_by_side(case, torch.float32, views=lambda t: t[:, ::2], shapes=((4, 6), (3, 4)))

    _on_each_backend(check)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.info.supports_sparse and not c.differentiable], ids=str
)
def test_sparse_grads_step_as_torch_optim(case: TorchConfig) -> None:
    _on_each_backend(lambda: _side_by_side(case, torch.float32, shapes=((6, 3), (4,)), sparse=True))


@pytest.mark.parametrize(
    "info, error_input",
    torch_optim_db.error_inputs(ROWS),
    ids=lambda x: x.name if hasattr(x, "optim_cls") else x.optimizer_error_input.desc,
)
def test_every_error_input_raises_as_torch_optim(info, error_input) -> None:
    assert_raises_as_torch_optim(getattr(scaledoptim, info.name), error_input)


def _with_tensor_options(case: TorchConfig) -> Iterator[TorchConfig]:
    """``case`` with each of its float options (``betas`` both) as a 0-dim tensor in turn,
    which torch.optim takes for all of them."""
    signature = inspect.signature(case.torch_class.__init__).parameters
    for name, parameter in signature.items():
        default = case.kwargs.get(name, parameter.default)
        if name != "betas" and (not isinstance(default, (int, float)) or isinstance(default, bool)):
            continue
        value = (
            tuple(map(torch.tensor, default)) if name == "betas" else torch.tensor(float(default))
        )
        yield TorchConfig(case.info, f"{case.desc} & tensor {name}", {**case.kwargs, name: value})


@pytest.mark.parametrize(
    "case", [c for c in BASE_CASES if issubclass(_ours(c), scaledoptim.FusedOptimizer)], ids=str
)
def test_every_float_option_may_be_a_tensor_as_in_torch_optim(case: TorchConfig) -> None:
    for tensor_case in _with_tensor_options(case):
        _on_each_backend(lambda tensor_case=tensor_case: _side_by_side(tensor_case, torch.float32))


@pytest.mark.parametrize(
    "info", [info for info in ROWS if "fused" in info.supported_impls], ids=lambda info: info.name
)
def test_fused_where_torch_has_no_fused_kernels_raises_at_step_as_torch_optim(info) -> None:
    for cls in (info.optim_cls, getattr(scaledoptim, info.name)):
        param = torch.nn.Parameter(torch.zeros(3, device="meta"))
        opt = cls([param], fused=True)
        param.grad = torch.zeros(3, device="meta")
        with pytest.raises(
            RuntimeError,
            match=r"`fused=True` requires all the params to be floating point Tensors of "
            r"supported devices: .* but torch.float32 and meta",
        ):
            opt.step()


# ---------------------------------------------- the loss-scaling protocol on torch.optim's route
#: Params torch.optim's own implementation takes inside our step (Note [torch.optim route]),
#: each beside an ordinary float32 param, which our fused path takes.
ROUTED_KINDS = ("complex", "view with gaps", "sparse grad", "differentiable")
FINITE, INF_IN_ROUTED, INF_IN_ORDINARY = "finite", "inf in the routed grad", "inf in the other grad"
SCHEDULE = (FINITE, INF_IN_ROUTED, FINITE, INF_IN_ORDINARY, FINITE)


def _routed_pair(case: TorchConfig, kind: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(leaves, params): a routed param of ``kind`` and an ordinary one."""
    dtype = torch.complex64 if kind == "complex" else torch.float32
    routed = torch.randn(4, 6, generator=torch.Generator().manual_seed(3), dtype=dtype)
    ordinary = torch.randn(5, generator=torch.Generator().manual_seed(4))
    if kind == "differentiable":
        leaves = [routed.requires_grad_(), ordinary.requires_grad_()]
        return leaves, [leaf.clone() for leaf in leaves]
    view = (lambda t: t[:, ::2]) if kind == "view with gaps" else (lambda t: t)
    params = [torch.nn.Parameter(view(routed)), torch.nn.Parameter(ordinary)]
    return params, params


def _protocol_grads(
    params: list[torch.Tensor], step: int, event: str, sparse: bool
) -> list[torch.Tensor]:
    grads = [_grad(p, step, i, sparse=sparse and i == 0) for i, p in enumerate(params)]
    poisoned = {INF_IN_ROUTED: 0, INF_IN_ORDINARY: 1}.get(event)
    if poisoned is not None:
        values = grads[poisoned]._values() if grads[poisoned].is_sparse else grads[poisoned]
        values.view(-1)[0] = float("inf")
    return grads


def _protocol_cases() -> Iterator[Any]:
    for case in BASE_CASES:
        if case.info.step_requires_closure:
            continue  # LBFGS: tests/protocol/test_with_scaling_torch_db.py
        for kind in ROUTED_KINDS:
            if (kind == "complex" and not case.info.supports_complex) or (
                # torch takes sparse grads without weight decay only
                kind == "sparse grad"
                and not (case.info.supports_sparse and not case.kwargs.get("weight_decay"))
            ):
                continue
            kwargs = {**case.kwargs, "differentiable": kind == "differentiable"}
            yield pytest.param(TorchConfig(case.info, case.desc, kwargs), kind, id=f"{case}-{kind}")


@pytest.mark.parametrize("case, kind", list(_protocol_cases()))
def test_routed_params_keep_the_loss_scaling_protocol(case: TorchConfig, kind: str) -> None:
    """Scaled grads are unscaled, an overflow in either param's grad skips both and backs the
    scale off, clean steps grow it, and the trajectory is torch.optim's on the unscaled grads:
    through ``unscale_and_step`` on the torch forms, through ``unscale`` +
    ``step_after_unscale`` on our kernels (each form on each backend elsewhere: the parity
    table)."""
    for form, backend in (("unscale_and_step", "torch"), ("split", "emulate")):
        with kernels_mode(backend):
            _routed_protocol(case, kind, form)


def _routed_protocol(case: TorchConfig, kind: str, form: str) -> None:
    sparse = kind == "sparse grad"
    leaves, params = _routed_pair(case, kind)
    ref_leaves, ref_params = _routed_pair(case, kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = case.torch_class(ref_params, **copy.deepcopy(case.kwargs))
        opt = _ours(case)(params, **copy.deepcopy(case.kwargs)).configure_scaling(
            init_scale=2.0**10, growth_interval=2
        )
        for step, event in enumerate(SCHEDULE):
            grads = _protocol_grads(params, step, event, sparse)
            scale = opt.scale.clone()
            for param, grad in zip(params, grads):
                param.grad = grad * scale
            before = _snapshot(opt)
            if form == "unscale_and_step":
                _, found_inf, _ = opt.unscale_and_step(grads_scaled_by=opt.scale)
            else:
                found_inf, _ = opt.unscale(grads_scaled_by=opt.scale)
                opt.step_after_unscale()
            if event == FINITE:
                for param, grad in zip(ref_params, grads):
                    param.grad = grad
                ref.step()
                assert found_inf.item() == 0.0
                continue
            assert found_inf.item() == 1.0
            _assert_bit_identical(before, _snapshot(opt))
            assert opt.scale.item() == scale.item() / 2
    assert opt.scale.item() == 2.0**10 / 4  # two backoffs; never two clean steps in a row
    for ours, expected in zip(params, ref_params):
        torch.testing.assert_close(ours.detach(), expected.detach())
    _assert_state_matches(opt, ref, params, ref_params)
    if kind == "differentiable":
        _assert_same_gradient(leaves, params, ref_leaves, ref_params)
