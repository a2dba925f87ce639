"""The public launcher: chunking across launches, table reuse, validation, a custom kernel."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from scaledoptim import kernels
from scaledoptim.kernels import launcher
from scaledoptim.kernels.config import launch_config
from scaledoptim.kernels.emulator import emulator_library
from scaledoptim.kernels.table import MAX_CHUNKS, max_tensors, plan_launches, table_type
from scaledoptim.optim.adam import ADAM_KERNEL, AdamOptions, adam_args
from scaledoptim.optim.sgd import SGD_KERNEL, SgdOptions, sgd_args

SCALE_SOURCE = Path(__file__).parent / "data" / "scale.cu"


class ScaleArgs(ctypes.Structure):
    _fields_ = [("factor", ctypes.c_float)]


SCALE = kernels.MultiTensorKernel(
    SCALE_SOURCE, "scale_kernel", ("tensors",), ScaleArgs, dtype_lists=(0,)
)


def test_plan_covers_every_chunk_once_across_tables():
    sizes = [0, 5, 4 * (MAX_CHUNKS + 3), 1, 9] + [1] * (2 * max_tensors(2))
    pointers = [(1000 + i, 0) for i in range(len(sizes))]
    launches = plan_launches(pointers, sizes, n_lists=2, chunk_size=4)
    seen = []
    for planned in launches:
        table = planned.table
        assert 0 < planned.n_chunks <= MAX_CHUNKS
        for b in range(planned.n_chunks):
            slot = table.chunk_tensor[b]
            tensor = table.ptrs[0][slot] - 1000
            assert table.sizes[slot] == sizes[tensor] and not table.ptrs[1][slot]  # null list
            seen.append((tensor, table.chunk_index[b]))
    expected = [(i, c) for i, n in enumerate(sizes) for c in range(-(-n // 4))]
    assert sorted(seen) == expected


@pytest.mark.parametrize("kernel", (*kernels.builtin_kernels(), SCALE), ids=lambda k: k.name)
def test_ctypes_tables_match_the_cuda_structs(kernel):
    library = emulator_library(kernel)
    for name in kernel.instantiations():
        library.entry(name)  # raises when sizeof differs between C++ and ctypes
    assert ctypes.sizeof(table_type(kernel.n_lists)) + ctypes.sizeof(kernel.args_type) <= 4096


def test_more_tensors_than_one_table_holds():
    n = max_tensors(6) * 2 + 3
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(i % 7, generator=generator) for i in range(n)]
    grads = [torch.randn(p.shape, generator=generator) for p in params]
    m, v = ([torch.zeros_like(p) for p in params] for _ in range(2))
    steps = [torch.zeros(()) for _ in params]
    expected = [p - 0.1 * torch.sign(g) for p, g in zip(params, grads)]  # Adam's first step
    options = AdamOptions(lr=0.1, eps=0.0, weight_decay=0.0, decoupled_weight_decay=True)
    args = adam_args(None, None, options)
    kernels.launch(ADAM_KERNEL, [params, grads, m, v, [], [], [], steps], args)
    kernels.launch(kernels.STEP_EPILOGUE, [steps], kernels.StepEpilogueArgs(found_inf=None))
    for p, e in zip(params, expected):
        torch.testing.assert_close(p, e, rtol=1e-6, atol=1e-6)
    assert all(s.item() == 1 for s in steps)
    found_inf = torch.zeros(())
    grads[-1].view(-1)[-1] = float("inf")
    kernels.non_finite_check_(grads, found_inf)
    assert found_inf.item() == 1


def test_custom_kernel_through_the_public_launcher():
    xs = [torch.randn(n).to(d) for n in (0, 1, 67, 300) for d in (torch.float32, torch.bfloat16)]
    expected = [(x.float() * 3).to(x.dtype) for x in xs]
    kernels.launch(SCALE, [xs], ScaleArgs(3.0))
    for x, e in zip(xs, expected):
        assert torch.equal(x, e)


def test_a_transposed_tensor_is_dense_and_walked_flat():
    x = torch.randn(5, 7).t()
    expected = x * 3
    kernels.launch(SCALE, [[x]], ScaleArgs(3.0))
    assert torch.equal(x, expected)


def test_table_is_reused_while_pointers_are_unchanged(monkeypatch):
    xs = [torch.randn(10), torch.randn(100)]
    launcher._plans.clear()
    builds = []
    build = launcher._build_plans
    monkeypatch.setattr(launcher, "_build_plans", lambda *a: builds.append(1) or build(*a))
    for _ in range(3):
        kernels.launch(SCALE, [xs], ScaleArgs(1.0))
    assert len(builds) == 1
    kernels.launch(SCALE, [[xs[0], torch.randn(100)]], ScaleArgs(1.0))  # a new pointer: new table
    assert len(builds) == 2


def test_invalid_tensor_lists_are_rejected_with_the_fix():
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match="not dense"):
        kernels.launch(SCALE, [[x[:, ::2]]], ScaleArgs(1.0))
    with pytest.raises(TypeError, match=r"dtype torch\.float64"):
        kernels.launch(SCALE, [[x.double()]], ScaleArgs(1.0))
    with pytest.raises(ValueError, match="takes 1 tensor lists"):
        kernels.launch(SCALE, [[x], [x]], ScaleArgs(1.0))
    with pytest.raises(TypeError, match="ScaleArgs"):
        kernels.launch(SCALE, [[x]], kernels.NonFiniteCheckArgs())
    with pytest.raises(ValueError, match="has 2 tensors but params has 1"):
        args = sgd_args(None, None, SgdOptions(lr=0.1))
        kernels.launch(SGD_KERNEL, [[x], [x, x], [], [], [], [torch.zeros(())]], args)
    with pytest.raises(ValueError, match="found_inf must be a one-element float32"):
        kernels.non_finite_check_([x], torch.zeros((), dtype=torch.float64))


def _two_lists() -> list[list[torch.Tensor]]:
    """Two dtypes interleaved (two instantiations, non-adjacent indices), tensors spanning
    tables, an empty one."""
    dtypes = [torch.bfloat16 if i % 3 == 0 else torch.float32 for i in range(400)]
    sizes = [(1, 3 * launch_config.chunk_size + 1, 0, 5)[i % 4] for i in range(400)]
    first = [torch.randn(n).to(d) for n, d in zip(sizes, dtypes)]
    return [first, [torch.randn(t.numel()).to(t.dtype) for t in first]]


TWO_LISTS = kernels.MultiTensorKernel(
    SCALE_SOURCE, "scale_kernel", ("a", "b"), ScaleArgs, dtype_lists=(0, 1)
)


def _assert_tables_of(launch: launcher.PreparedLaunch, lists: list[list[torch.Tensor]]) -> None:
    fresh = launcher.prepare_launch(TWO_LISTS, lists)
    assert len(launch.plans) == len(fresh.plans) > 2
    for (name, planned), (fresh_name, fresh_planned) in zip(launch.plans, fresh.plans):
        assert name == fresh_name and planned.n_chunks == fresh_planned.n_chunks
        assert bytes(planned.table) == bytes(fresh_planned.table)


@pytest.mark.parametrize("list_index", [0, 1])
def test_a_repointed_launch_has_the_tables_of_one_prepared_for_the_new_tensors(list_index):
    # Every slot must get its own tensor's new pointer.
    old, new = _two_lists(), _two_lists()
    new[1 - list_index] = old[1 - list_index]
    kernel = TWO_LISTS
    repointed = launcher.prepare_launch(kernel, old).detached()
    repointed.repoint(list_index, [t.data_ptr() for t in new[list_index]])
    _assert_tables_of(repointed, new)
    # The cache's shared tables are untouched, and only a detached launch may be repointed.
    shared = launcher.prepare_launch(kernel, old)
    assert shared.plans[0][1].table.ptrs[list_index][0] == old[list_index][0].data_ptr()
    with pytest.raises(RuntimeError, match="detached"):
        shared.repoint(list_index, [t.data_ptr() for t in new[list_index]])


def test_repoints_of_one_launch_in_turn_each_list_and_again_match_fresh_tables():
    # A launch repointed at every step keeps what picks each list's pointers from the last
    # repoint of that list: each later one, of either list, must still land in its own slots.
    tensors = [_two_lists(), _two_lists(), _two_lists()]
    launch = launcher.prepare_launch(TWO_LISTS, tensors[0]).detached()
    lists = list(tensors[0])
    for list_index, source in [(1, 1), (0, 2), (1, 0), (0, 1), (1, 2)]:
        lists[list_index] = tensors[source][list_index]
        launch.repoint(list_index, [t.data_ptr() for t in lists[list_index]])
        _assert_tables_of(launch, lists)
