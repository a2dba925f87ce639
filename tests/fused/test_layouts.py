"""Memory layouts: transposed grads, channels_last params, strided views, on both update paths.

The layout tests run every generic config of every fused row against the row's reference.
"""

from __future__ import annotations

import pytest
import torch

import scaledoptim
from scaledoptim.testing.optim_db import Config, OptimInfo, rows
from tests.support.cases import Cases
from tests.support.references import reference_optimizer

pytestmark = pytest.mark.usefixtures("kernel_backend")

ROWS = [pytest.param(info, id=info.name) for info in rows(fused=True)]


def _step_pair(info: OptimInfo, config: Config, param_data: torch.Tensor, grad: torch.Tensor):
    ours = torch.nn.Parameter(param_data.clone())
    ref = torch.nn.Parameter(param_data.detach().clone().contiguous())
    ours.grad, ref.grad = grad, grad.contiguous()
    info.make([ours], config).unscale_and_step(grads_scaled_by=1.0)
    reference_optimizer(info, [ref], config).step()
    return ours, ref


@pytest.mark.parametrize("info", ROWS)
def test_transposed_grad_is_applied_element_for_element(info) -> None:
    """Each generic config of the row (one item per row and backend, each failing one named)."""
    cases = Cases()
    for config in info.generic_configs:
        with cases.case(config.name):
            ours, ref = _step_pair(info, config, torch.randn(5, 7), torch.randn(7, 5).t())
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    cases.assert_all_passed()


@pytest.mark.parametrize("info", ROWS)
def test_channels_last_params_step_like_contiguous_ones(info) -> None:
    """Each generic config of the row (one item per row and backend, each failing one named)."""
    cases = Cases()
    for config in info.generic_configs:
        with cases.case(config.name):
            data = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
            grad = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
            ours, ref = _step_pair(info, config, data, grad)
            assert ours.is_contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    cases.assert_all_passed()


def test_a_strided_view_param_is_refused_before_anything_changes() -> None:
    base = torch.randn(4, 6)
    view = torch.nn.Parameter(base[:, ::2])
    dense = torch.nn.Parameter(torch.randn(3))
    view.grad, dense.grad = torch.ones_like(view), torch.ones(3)
    before = dense.detach().clone()
    # Lion has no torch.optim implementation to take it (SGD's takes it: tests/optim/).
    opt = scaledoptim.Lion([{"params": [dense]}, {"params": [view]}], lr=0.1)
    with pytest.raises(RuntimeError, match="make the parameter contiguous"):
        opt.step()
    assert torch.equal(dense, before)
    scale_before = opt.scale.clone()
    for call in (opt.unscale, opt.unscale_and_step):
        with pytest.raises(RuntimeError, match="make the parameter contiguous"):
            call(grads_scaled_by=opt.scale)
    assert torch.equal(dense, before) and torch.equal(dense.grad, torch.ones(3))
    assert torch.equal(opt.scale, scale_before)
