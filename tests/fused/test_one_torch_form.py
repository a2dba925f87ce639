"""Each optimizer without a torch op that takes found_inf writes its torch form once
(``Update.torch_form_``), and the torch-native backend's two drivers run that one function
(Note [one torch form] in fused/backends/in_place.py): on the lists after a host read of
the skip, or on working copies of exactly what it writes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import scaledoptim
from scaledoptim.fused.backends.torch_native import decide_skips_on_device


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch) -> None:
    monkeypatch.delenv("SCALEDOPTIM_KERNELS", raising=False)  # a CPU's default: torch's ops


def _recording(cls: type[scaledoptim.FusedOptimizer]) -> type[scaledoptim.FusedOptimizer]:
    class Recording(cls):  # type: ignore[valid-type, misc]
        calls: list[list[list[torch.Tensor]]]

        def torch_form_(self, group: dict[str, Any], tensor_lists: list[list[Any]]) -> None:
            self.calls.append([list(ts) for ts in tensor_lists])
            super().torch_form_(group, tensor_lists)

    return Recording


def _step(opt: scaledoptim.FusedOptimizer, params: list[torch.nn.Parameter], on_device: bool):
    S = opt.scale
    for p in params:
        p.grad = torch.randn(p.shape) * S
    opt.calls = []  # type: ignore[attr-defined]
    if on_device:
        with decide_skips_on_device():
            opt.unscale_and_step(grads_scaled_by=S)
    else:
        opt.unscale_and_step(grads_scaled_by=S)
    return opt.calls  # type: ignore[attr-defined]


def test_the_host_driver_runs_the_form_on_the_lists_themselves() -> None:
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 1000)]
    opt = _recording(scaledoptim.RMSprop)(params, lr=1e-2, momentum=0.9, centered=True)
    (call,) = _step(opt, params, on_device=False)  # one batch: two small tensors
    state = [opt.state[p] for p in params]
    assert all(a is b for a, b in zip(call[0], params))
    assert all(a is s["square_avg"] for a, s in zip(call[2], state))
    assert call[-1] == []  # batched, an elementwise form gets no counters: they are advanced
    assert all(s["step"].item() == 1.0 for s in state)


def test_the_sync_free_driver_runs_the_form_on_copies_of_what_it_writes_only() -> None:
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 1000)]
    opt = _recording(scaledoptim.LAMB)(params, lr=1e-2)
    before = [p.detach().clone() for p in params]
    _step(opt, params, on_device=False)  # the state exists
    (call,) = _step(opt, params, on_device=True)
    state = [opt.state[p] for p in params]
    # params and moments: working copies, copied back
    assert not any(a is b for a, b in zip(call[0], params))
    assert not any(a is s["exp_avg"] for a, s in zip(call[2], state))
    assert all(torch.equal(a, b) for a, b in zip(call[0], params))
    # what it only reads, as it is: grads, the kernels' per-chunk scratch, the counters
    assert all(a is p.grad for a, p in zip(call[1], params))
    scratch = opt._norm_scratch
    assert scratch is not None and all(a is scratch[p][0] for a, p in zip(call[4], params))
    assert all(a is s["step"] for a, s in zip(call[-1], state))
    assert all(s["step"].item() == 2.0 for s in state)
    assert not any(map(torch.equal, params, before))


@pytest.mark.parametrize("in_place", [False, True])
def test_a_fused_optimizer_without_its_torch_form_is_refused_with_the_fix(in_place) -> None:
    class NoForm(scaledoptim.FusedOptimizer):
        kernel = scaledoptim.SGD.kernel
        rounds = True
        torch_form_in_place = in_place

        def state_keys(self, group: dict[str, Any]) -> tuple[str | None, ...]:
            return ()

        def check_options(self, options: dict[str, Any]) -> None:
            pass

        def kernel_args(self, group: dict[str, Any], found_inf: Any, inv_scale: Any) -> Any:
            raise AssertionError("not reached")

    with pytest.raises(TypeError, match=r"NoForm defines no torch form: define torch_update"):
        NoForm([torch.nn.Parameter(torch.zeros(2))], {})
