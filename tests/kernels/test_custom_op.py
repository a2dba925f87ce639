"""Launches as the custom op ``scaledoptim::multi_tensor_launch`` (Note [launch op]): the op is
well formed, compiled launches match eager bit for bit with no graph break, and device scalars
computed in the compiled function are read when the op runs."""

from __future__ import annotations

import ctypes

import pytest
import torch

import scaledoptim
from scaledoptim import kernels
from scaledoptim.kernels import library
from scaledoptim.testing.optim_db import row
from tests.support.launches import RowUpdate, row_update

BACKENDS = ("eager", "aot_eager", "inductor")
ADAMW = row("AdamW")


def adamw_update(amsgrad: bool = False) -> RowUpdate:
    """AdamW's update (its kernel's lists and the optimizer for its args) over two params."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(70, generator=generator), torch.randn(3, 5, generator=generator)]
    grads = [torch.randn(p.shape, generator=generator) for p in params]
    return row_update(ADAMW, params, grads, amsgrad=amsgrad)


def adamw_lists(amsgrad: bool = False) -> list[list[torch.Tensor]]:
    return adamw_update(amsgrad).lists


def adamw_args(lr: float, amsgrad: bool = False) -> scaledoptim.optim.adam.AdamArgs:
    update = adamw_update(amsgrad)
    update.group["lr"] = lr
    args = update.opt.kernel_args(update.group, None, None)
    assert isinstance(args, scaledoptim.optim.adam.AdamArgs)
    return args


def assert_lists_equal(actual, expected) -> None:
    for a_list, e_list in zip(actual, expected, strict=True):
        for a, e in zip(a_list, e_list, strict=True):
            assert torch.equal(a, e)


def test_opcheck() -> None:
    lists = adamw_lists(amsgrad=True)
    found = torch.zeros(())
    inputs = library.op_inputs(
        scaledoptim.optim.adam.ADAM_KERNEL,
        lists,
        adamw_args(1e-2, amsgrad=True),
        {"found_inf": found},
    )
    torch.library.opcheck(torch.ops.scaledoptim.multi_tensor_launch.default, inputs)
    grads = [torch.tensor([1.0, float("inf")]), torch.ones(3)]
    inputs = library.op_inputs(
        kernels.NON_FINITE_CHECK, [grads], kernels.NonFiniteCheckArgs(), {"found_inf": found}
    )
    torch.library.opcheck(torch.ops.scaledoptim.multi_tensor_launch.default, inputs)
    library.launch_op(
        kernels.NON_FINITE_CHECK, [grads], kernels.NonFiniteCheckArgs(), {"found_inf": found}
    )
    assert found.item() == 1.0  # written through the pointer of a pointer tensor


def launch_adamw(lists, args) -> None:
    kernels.launch(scaledoptim.optim.adam.ADAM_KERNEL, lists, args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_launch_matches_eager_bit_for_bit(backend) -> None:
    torch._dynamo.reset()
    eager, compiled = adamw_lists(), adamw_lists()
    step = torch.compile(launch_adamw, backend=backend, fullgraph=True)
    for lr in (1e-2, 1e-2, 3e-2):  # a changed lr is a guarded constant: the graph recompiles
        launch_adamw(eager, adamw_args(lr))
        step(compiled, adamw_args(lr))
    assert not torch.equal(eager[0][0], adamw_lists()[0][0])  # the launches did step
    assert_lists_equal(compiled, eager)


def test_a_compiled_launch_has_no_graph_break() -> None:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(launch_adamw)(adamw_lists(), adamw_args(1e-2))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    assert "multi_tensor_launch" in str(explained.graphs[0].code)


def launch_unless_non_finite(lists, x, args) -> None:
    found = x.isinf().any().float()  # exists only inside the graph: no pointer at trace time
    library.launch_op(
        scaledoptim.optim.adam.ADAM_KERNEL, lists, args, {"found_inf": found, "inv_scale": None}
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_found_inf_computed_in_the_graph_is_read_when_the_op_runs(backend) -> None:
    torch._dynamo.reset()
    lists, expected = adamw_lists(), adamw_lists()
    step = torch.compile(launch_unless_non_finite, backend=backend, fullgraph=True)
    args = adamw_args(1e-2)
    with torch._dynamo.config.patch(error_on_recompile=True):  # one graph for both outcomes
        step(lists, torch.tensor([1.0, float("inf")]), args)
        assert_lists_equal(lists, expected)  # skipped: nothing changed
        step(lists, torch.tensor([1.0, 2.0]), args)
    launch_adamw(expected, args)
    assert_lists_equal(lists, expected)


def test_eager_launch_does_not_go_through_the_op(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("the eager launch went through the op")

    monkeypatch.setattr(library, "launch_op", fail)
    lists, before = adamw_lists(), adamw_lists()
    kernels.launch(scaledoptim.optim.adam.ADAM_KERNEL, lists, adamw_args(1e-2))
    assert not torch.equal(lists[0][0], before[0][0])


def test_bad_pointer_field_names_the_fields_and_changes_nothing() -> None:
    lists, before = adamw_lists(), adamw_lists()
    with pytest.raises(
        ValueError,
        match=r"'lr' is not a pointer field of AdamArgs; pass one of \['found_inf', 'inv_scale'\]",
    ):
        library.launch_op(
            scaledoptim.optim.adam.ADAM_KERNEL, lists, adamw_args(1e-2), {"lr": torch.zeros(())}
        )
    wrong = kernels.NonFiniteCheckArgs()
    with pytest.raises(TypeError, match="adam_kernel takes args of type AdamArgs, got NonFin"):
        library.launch_op(scaledoptim.optim.adam.ADAM_KERNEL, lists, wrong)
    assert_lists_equal(lists, before)


def test_a_bad_pointer_tensor_is_refused_when_the_op_runs_and_changes_nothing() -> None:
    lists, before = adamw_lists(), adamw_lists()
    with pytest.raises(ValueError, match="found_inf must be a one-element float32 tensor"):
        library.launch_op(
            scaledoptim.optim.adam.ADAM_KERNEL,
            lists,
            adamw_args(1e-2),
            {"found_inf": torch.zeros(2)},
        )
    assert_lists_equal(lists, before)


def test_unknown_kernel_key_says_how_to_register_it() -> None:
    with pytest.raises(KeyError, match="define its MultiTensorKernel"):
        library.registered_kernel("nothing@000000000000")
    builtin = scaledoptim.optim.sgd.SGD_KERNEL
    assert library.registered_kernel(library.kernel_key(builtin)) is builtin


def test_integer_fields_keep_every_bit() -> None:
    class Wide(ctypes.Structure):
        _fields_ = [
            ("seed", ctypes.c_uint64),
            ("offset", ctypes.c_int64),
            ("flag", ctypes.c_bool),
            ("x", ctypes.c_double),
        ]

    kernel = kernels.MultiTensorKernel(kernels.CUDA_SOURCE_DIR / "none.cu", "wide", ("t",), Wide)
    args = Wide(seed=2**64 - 3, offset=-(2**62), flag=True, x=0.1)
    key, _, _, ints, floats, _, _ = library.op_inputs(kernel, [[]], args)
    assert all(type(value) is int for value in ints)  # the op's int[]
    rebuilt = Wide(**dict(zip(("seed", "offset", "flag"), ints)), x=floats[0])
    assert bytes(rebuilt) == bytes(args)
    assert library.registered_kernel(key) is kernel
