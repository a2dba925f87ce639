"""Plumbing shared by the fused optimizers: state dtype, the step loop and the choice of backend."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import torch

from .. import kernels
from .._checks import check_param_grads
from ..kernels.launcher import is_dense
from ..optimizer import Optimizer
from . import _native


def state_dtype(param: torch.Tensor) -> torch.dtype:
    """Optimizer state is at least fp32: 16-bit moments underflow (``(1 - beta2) * g**2``)."""
    return torch.promote_types(param.dtype, torch.float32)


def backend_for(device: torch.device) -> ModuleType:
    """The module whose ``adam_``/``sgd_`` run the update on ``device``.

    CUDA tensors take our kernels (``cuda/``) when CuPy is installed, torch's fused ops
    otherwise; CPU tensors take torch's fused ops, or our kernels through the CPU emulator when
    ``SCALEDOPTIM_KERNELS=emulate`` is set (a test and kernel-author tool).
    """
    if kernels.emulation_requested() or (device.type == "cuda" and _cupy_installed()):
        return kernels
    return _native


def _cupy_installed() -> bool:
    return importlib.util.find_spec("cupy") is not None


class FusedOptimizer(Optimizer):
    r"""Base of the optimizers whose update is one multi-tensor op that reads ``found_inf`` on
    device, so skipping an overflowed step needs no host sync (Note [found_inf contract]).

    A subclass validates its hyper-parameters, initialises per-param state in
    :meth:`_init_state` and calls its backend op in :meth:`_update_group`.
    """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`scaledoptim.Optimizer.load_state_dict`, keeping state fp32 for 16-bit params.

        torch would cast loaded moments to the param's dtype (and lose bits that a bit-exact
        resume needs), so the per-param state is cast here instead: floating state to
        ``state_dtype(param)``, everything on the param's device.
        """
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
            raise ValueError("Corrupt optimizer state_dict: it needs a 'state' dict")
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            raise ValueError(
                "loaded state dict has a different number of parameter groups than the optimizer"
            )
        saved_ids = [i for g in saved_groups for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        if len(saved_ids) != len(params):
            raise ValueError("loaded state dict contains a parameter group that doesn't match")
        by_id = dict(zip(saved_ids, params))
        loaded = {
            by_id[i]: {key: _cast_state(by_id[i], key, value) for key, value in s.items()}
            for i, s in state_dict["state"].items()
            if i in by_id
        }
        super().load_state_dict({**state_dict, "state": {}})
        self.state.update(loaded)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Performs a single optimization step (no skipping: see :meth:`unscale_and_step`).

        Args:
            closure: optional, re-evaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update(found_inf=None)
        return loss

    def unscale_and_step(
        self,
        closure: Callable[[Any], Any] | None = None,
        grads_scaled_by: torch.Tensor | float | None = None,
    ) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
        r"""As :meth:`scaledoptim.Optimizer.unscale_and_step`.

        On our CUDA kernels (and their emulator) the no-closure form reads the grads twice and
        writes them never: a read-only inf/nan check, then the update, which unscales in
        registers. The grads are therefore left *scaled* afterwards; call :meth:`unscale` and
        :meth:`step_after_unscale` when you need them unscaled (to clip them, say). On torch's
        fused ops (CPU) the grads are unscaled in place first, which is faster there.
        """
        if (
            closure is not None
            or grads_scaled_by is None
            or backend_for(self._params_device()) is not kernels
        ):
            return super().unscale_and_step(closure, grads_scaled_by)
        scale, grads = self._begin_unscale(grads_scaled_by)
        found_inf = self._no_overflow()
        # The check walks storage flat; a (rare) strided grad is checked through a dense copy.
        kernels.non_finite_check_([g if is_dense(g) else g.contiguous() for g in grads], found_inf)
        inv_scale = scale.double().reciprocal().float()  # before the scale moves, in place
        found_inf, next_scale = self._finish_unscale(scale, found_inf, pending_inv_scale=inv_scale)
        self.step_after_unscale()
        return None, found_inf, next_scale

    def _begin_unscale(
        self, grads_scaled_by: torch.Tensor | float | None
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        # Refuse params the update cannot take before unscale() touches grads or the scale.
        _check_dense(p for g in self.param_groups for p in g["params"] if p.grad is not None)
        return super()._begin_unscale(grads_scaled_by)

    def _step_skipping_if(self, found_inf: torch.Tensor) -> None:
        # unscale() checked these grads moments ago: skip the per-param checks on the hot path.
        self._update(found_inf, self._scaling().pending_inv_scale, grads_checked=True)

    @torch.no_grad()
    def _update(
        self,
        found_inf: torch.Tensor | None,
        inv_scale: torch.Tensor | None = None,
        grads_checked: bool = False,
    ) -> None:
        work = [(g, *self._params_and_grads(g, grads_checked)) for g in self.param_groups]
        for group, params, grads in work:  # every check before the first update
            if params:
                states = [self._state_of(p, group) for p in params]
                backend = backend_for(params[0].device)
                # Only our kernels unscale in registers; torch's fused ops get unscaled grads.
                scaling = {"found_inf": found_inf}
                if backend is kernels:
                    scaling["inv_scale"] = inv_scale
                self._update_group(group, params, grads, states, backend, scaling)

    @staticmethod
    def _params_and_grads(
        group: dict[str, Any], grads_checked: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The group's params that have grads, and their grads in the param's memory layout.

        Fused updates walk param, grad and state storage in lockstep (torch 2.13's CPU fused
        AdamW silently mixes up elements of a transposed grad), so a grad whose strides differ
        from its param's is copied into the param's layout first.
        """
        params = [p for p in group["params"] if p.grad is not None]
        if params and not grads_checked:
            check_param_grads(params, params[0].device)
            _check_dense(params)
        grads = [
            p.grad
            if p.grad.stride() == p.stride()
            else torch.empty_like(p, dtype=p.grad.dtype).copy_(p.grad)
            for p in params
        ]
        return params, grads

    def _state_of(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[param]
        if "step" not in state:
            # A state loaded from torch.optim.SGD has buffers but no counter: it has stepped.
            taken = 1.0 if state else 0.0
            state["step"] = torch.full((), taken, dtype=torch.float32, device=param.device)
        if len(state) == 1:
            self._init_state(param, state, group)
        return state

    def _zeros_like_state(self, param: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(param, dtype=state_dtype(param), memory_format=torch.preserve_format)

    def _init_state(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        raise NotImplementedError  # abstract: every fused optimizer defines its state

    def _update_group(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict[str, Any]],
        backend: ModuleType,
        scaling: dict[str, torch.Tensor | None],
    ) -> None:
        """Calls ``backend``'s update op on one group; ``scaling`` holds its found_inf/inv_scale."""
        raise NotImplementedError  # abstract: every fused optimizer calls its backend op


def check_hyperparameter(name: str, value: Any, low: float = 0.0, high: float | None = None) -> None:
    """``ValueError(f"Invalid {name}: {value}")`` unless ``low <= value (< high)``, torch's style."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a Python float, not a tensor (got {value!r})")
    if not (low <= value and (high is None or value < high)):
        raise ValueError(f"Invalid {name}: {value}")


def reject_differentiable(differentiable: bool) -> None:
    if differentiable:
        raise ValueError(
            "differentiable=True is not supported by scaledoptim's fused optimizers; use the "
            "torch.optim class (scaledoptim.with_scaling(torch.optim.X) keeps the protocol)"
        )


def _check_dense(params: Iterable[torch.Tensor]) -> None:
    for param in params:
        if not param.is_contiguous() and not is_dense(param):
            raise RuntimeError(
                f"A param of shape {tuple(param.shape)} is a strided view, which fused "
                "optimizers cannot update in place; make the parameter contiguous"
            )


def _cast_state(param: torch.Tensor, key: str, value: Any) -> Any:
    # Always a copy: the loaded optimizer must not alias (and then advance) the caller's tensors.
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        return value.to(dtype=torch.float32, device=param.device, copy=True)
    if value.is_floating_point():
        if value.shape != param.shape:
            raise ValueError(
                f"Corrupt optimizer state_dict: state {key!r} has shape {tuple(value.shape)} but "
                f"its param has shape {tuple(param.shape)}; was it saved for another model?"
            )
        return value.to(dtype=state_dtype(param), device=param.device, copy=True)
    return value.to(device=param.device, copy=True)

