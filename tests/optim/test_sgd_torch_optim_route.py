"""SGD's momentum buffer on the params that take torch.optim's own implementation (Note
[torch.optim route]): ours exist from the start and stay dense, torch's start at a param's first
step (as a sparse grad's clone for a sparse grad). Against torch.optim.SGD on both backends: a
Nesterov step over sparse grads, and a buffer loaded with a step count of 0 (torch's SGD saves
no count: it reads whatever buffer it is given)."""

from __future__ import annotations

import warnings

import pytest
import torch

import scaledoptim
from tests.support.references import kernels_mode

BACKENDS = ("torch", "emulate")


def _embedding_pair() -> tuple[torch.nn.Embedding, torch.nn.Embedding]:
    torch.manual_seed(0)
    ours = torch.nn.Embedding(10, 4, sparse=True)
    theirs = torch.nn.Embedding(10, 4, sparse=True)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _backward(module: torch.nn.Module, step: int) -> None:
    module.zero_grad()
    (module(torch.tensor([step, step + 1, 3, 3])) * (step + 1)).sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", [
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.9, nesterov=True, maximize=True),
    dict(momentum=0.9),
], ids=["nesterov", "nesterov-maximize", "momentum"])
def test_sparse_grads_take_torch_optims_momentum_steps(backend, config):
    ours_module, theirs_module = _embedding_pair()
    with kernels_mode(backend), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's sparse-invariant note
        ours = scaledoptim.SGD(ours_module.parameters(), lr=0.1, **config)
        theirs = torch.optim.SGD(theirs_module.parameters(), lr=0.1, **config)
        for step in range(3):
            _backward(ours_module, step)
            _backward(theirs_module, step)
            ours.unscale_and_step(grads_scaled_by=None)
            theirs.step()
    torch.testing.assert_close(ours_module.weight, theirs_module.weight, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["complex", "sparse grad"])
def test_a_buffer_loaded_with_a_step_count_of_0_is_read_as_torch_optim_reads_it(backend, kind):
    """Without dampening (torch reads the buffer; ours did too on our kernels and torch forms,
    but not on torch.optim's route, which started it from the grad)."""
    torch.manual_seed(1)
    if kind == "complex":
        param = torch.nn.Parameter(torch.randn(5, dtype=torch.complex64))
        grad = torch.randn(5, dtype=torch.complex64)
    else:
        param = torch.nn.Parameter(torch.randn(5))
        grad = torch.tensor([0.0, 2.0, 0.0, -1.0, 0.5]).to_sparse()
    loaded = torch.randn(5, dtype=param.dtype) * 10
    theirs_param = torch.nn.Parameter(param.detach().clone())
    with kernels_mode(backend), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = scaledoptim.SGD([param], lr=0.1, momentum=0.9)
        state = ours.state_dict()
        state["state"][0] = {"momentum_buffer": loaded.clone(), "step": torch.tensor(0.0)}
        ours.load_state_dict(state)
        theirs = torch.optim.SGD([theirs_param], lr=0.1, momentum=0.9)
        theirs.state[theirs_param]["momentum_buffer"] = loaded.clone()
        param.grad, theirs_param.grad = grad.clone(), grad.clone()
        ours.unscale_and_step(grads_scaled_by=None)
        theirs.step()
    torch.testing.assert_close(param, theirs_param, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        ours.state[param]["momentum_buffer"], theirs.state[theirs_param]["momentum_buffer"]
    )
