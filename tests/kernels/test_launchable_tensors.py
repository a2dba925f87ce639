"""See Note [launchable tensors]: no kernel launch receives a pointer the launcher did not validate.

Every tensor subclass torch ships that can reach an optimizer, and tensors without storage, are
refused by the one gate (``check_launchable``) before a pointer is read; the fused optimizers
route subclass params to torch's ops instead (stepped like plain ones), and the step cache
re-plans rather than repoint a table to a null pointer. The DTensor cases, which need a process
group, are in tests/distributed/test_dist_dtensor_params.py.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.two_tensor import TwoTensor

import scaledoptim
from scaledoptim.kernels import NON_FINITE_CHECK, prepare_launch
from scaledoptim.kernels.launcher import check_launchable
from tests.support.training import assert_bit_identical

OPTIMIZERS = ("AdamW", "Adam", "SGD", "Adagrad", "RMSprop", "Lion", "LAMB")


def _fake() -> torch.Tensor:
    with FakeTensorMode():
        return torch.randn(6)


# Tensors a kernel must never get a pointer of, and the words its refusal names.
UNLAUNCHABLE = {
    "TwoTensor": (lambda: TwoTensor(torch.randn(6), torch.randn(6)), "TwoTensor"),
    "FakeTensor": (_fake, "FakeTensor"),
    "meta tensor": (lambda: torch.randn(6, device="meta"), "meta tensor"),
    "functional tensor": (lambda: torch._to_functional_tensor(torch.randn(6)), "functional"),
}


@pytest.mark.parametrize("kind", UNLAUNCHABLE)
@pytest.mark.parametrize("position", [0, 2])
def test_the_gate_refuses_what_a_kernel_cannot_read(kind, position):
    make, named = UNLAUNCHABLE[kind]
    tensors = [torch.randn(6) for _ in range(3)]
    tensors[position] = make()
    with pytest.raises(TypeError, match=rf"tensors\[{position}\].*{named}"):
        check_launchable(NON_FINITE_CHECK, [tensors])
    with pytest.raises(TypeError, match=named):  # and through the launcher itself
        prepare_launch(NON_FINITE_CHECK, [tensors])


def test_the_gate_takes_plain_tensors_params_and_empty_tensors():
    check_launchable(
        NON_FINITE_CHECK, [[torch.randn(6), torch.nn.Parameter(torch.randn(2)), torch.empty(0)]]
    )


def test_repoint_refuses_a_null_pointer_and_changes_no_table():
    grads = [torch.randn(6), torch.randn(40)]
    launch = prepare_launch(NON_FINITE_CHECK, [grads]).detached()
    tables = [bytes(planned.table) for _, planned in launch.plans]
    with pytest.raises(ValueError, match="null data pointer"):
        launch.repoint(0, [grads[0].data_ptr(), 0])
    assert [bytes(planned.table) for _, planned in launch.plans] == tables
    moved = [g.clone() for g in grads]
    launch.repoint(0, [g.data_ptr() for g in moved])  # a real move still repoints
    slots = launch.plans[0][1].table.ptrs[0]
    assert ctypes.c_void_p(slots[0]).value == moved[0].data_ptr()


@pytest.mark.parametrize("backend", ["torch", "emulate"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_wrapper_subclass_params_step_like_plain_ones(monkeypatch, backend, name):
    """A __torch_dispatch__ wrapper (TwoTensor: every op on both halves) takes torch's ops on
    either backend: each half steps exactly as a plain param does on the torch backend."""
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", backend)
    generator = torch.Generator().manual_seed(0)
    weight, grad = torch.randn(5, 4, generator=generator), torch.randn(5, 4, generator=generator)
    wrapped = torch.nn.Parameter(TwoTensor(weight.clone(), weight.clone()))
    opt = getattr(scaledoptim, name)([wrapped], lr=0.01)
    for _ in range(3):
        wrapped.grad = TwoTensor(grad.clone(), grad.clone())
        opt.unscale_and_step(grads_scaled_by=1.0)
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "torch")
    plain = torch.nn.Parameter(weight.clone())
    reference = getattr(scaledoptim, name)([plain], lr=0.01)
    for _ in range(3):
        plain.grad = grad.clone()
        reference.unscale_and_step(grads_scaled_by=1.0)
    assert_bit_identical([wrapped.a, wrapped.b], [plain.detach(), plain.detach()])


@pytest.mark.parametrize("kind", ["meta tensor", "functional tensor"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_storage_less_params_are_refused_on_the_kernel_path_before_anything_changes(
    monkeypatch, kind, name
):
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "emulate")
    make, named = UNLAUNCHABLE[kind]
    param = torch.nn.Parameter(make())
    param.grad = torch.ones_like(param)
    opt = getattr(scaledoptim, name)([param], lr=0.01)
    state = dict(opt.state[param])  # Adagrad's is made in __init__, as torch's
    scale = opt.scale.clone()
    with pytest.raises(TypeError, match=named):
        opt.unscale_and_step(grads_scaled_by=1.0)
    assert opt.state[param].keys() == state.keys()
    assert all(opt.state[param][k] is v for k, v in state.items())
    if kind != "meta tensor":  # a meta tensor has no values to compare
        assert_bit_identical([scale, *state.values()], [opt.scale, *opt.state[param].values()])


def test_the_step_cache_replans_instead_of_repointing_to_a_null_grad(monkeypatch):
    monkeypatch.setenv("SCALEDOPTIM_KERNELS", "emulate")
    param = torch.nn.Parameter(torch.randn(6))
    opt = scaledoptim.AdamW([param], lr=0.01)
    for _ in range(3):  # the third step runs from the cache
        param.grad = torch.randn(6)
        opt.unscale_and_step(grads_scaled_by=1.0)
    assert opt._step_cache is not None
    before = [param.detach().clone(), *(v.clone() for v in opt.state[param].values())]
    param.grad = TwoTensor(torch.randn(6), torch.randn(6))  # new storage, data_ptr() == 0
    with pytest.raises(TypeError, match="TwoTensor"):
        opt.unscale_and_step(grads_scaled_by=1.0)
    assert_bit_identical(before, [param.detach(), *opt.state[param].values()])
