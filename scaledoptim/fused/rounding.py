"""The param rounding options of every fused optimizer: ``master_weights`` (an fp32 master copy
of each 16-bit param in state) and ``stochastic_rounding`` (bf16 params rounded stochastically
from a counter-based hash), validated, and their state (Note [param rounding] in cuda/; the
torch form of the rounding is ``scaledoptim.torch_ops.stochastic_round_``).

Note [param edits under master weights]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``master_weights`` the update reads the fp32 master and stores the param rounded from it, so
an edit of the param between steps (weight clipping, max-norm, a Lookahead or DiLoCo outer step,
re-initialising a layer, ``model.load_state_dict``) would be undone by the next step. A careful
user expects the param they wrote to be the one trained, as with any torch optimizer, so the
master follows the param: after each step the plan records every such param's version counter
and data pointer (:class:`MasterWatch`; two list passes in C, only for these params); the
next step, finding either moved (an in-place edit through the param, ``p.copy_``, ``p.set_``,
``p.data = t``, ``model.load_state_dict``), first copies into the master each element whose
param differs from the master rounded to the param's dtype (``resync_masters_``), so the master
keeps its extra bits wherever the edit changed nothing. On device, no host sync, before the
update; a skipped step still takes the edit.

Not seen: edits through ``p.data`` in place (``p.data.clamp_()``), which bypass the version
counter as they bypass autograd: edit the param itself under ``torch.no_grad()``, or delete
``opt.state[p]["master_param"]`` to restart the master from the param. A master loaded by
``load_state_dict`` or copied with the optimizer is the truth until the first step records its
param.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeGuard

import torch
from torch import Tensor

from ..torch_ops import initial_seed

__all__ = [
    "MASTER_KEY",
    "SEED_KEY",
    "MasterWatch",
    "check_rounding_options",
    "check_rounding_params",
    "is_master_of",
    "resync_masters_",
    "stage_rounding_state",
]

# The descriptors' getters, called directly: C-level map() over the params, no attribute lookup.
_DATA_PTR = Tensor.data_ptr
_VERSION: Callable[[Tensor], int] = vars(torch._C.TensorBase)["_version"].__get__

MASTER_KEY = "master_param"
SEED_KEY = "sr_seed"


def check_rounding_options(options: dict[str, Any], supported: bool) -> None:
    """Validates ``master_weights``/``stochastic_rounding`` of a group (both default False).

    Args:
        supported: whether the optimizer's kernel takes the rounding lists.
    """
    master, stochastic = (
        options.get("master_weights", False),
        options.get("stochastic_rounding", False),
    )
    for name, value in (("master_weights", master), ("stochastic_rounding", stochastic)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if master and stochastic:
        raise ValueError(
            "master_weights=True and stochastic_rounding=True are exclusive: an fp32 master "
            "makes rounding the param irrelevant to training; pick one"
        )
    if (master or stochastic) and not supported:
        raise ValueError(
            "this optimizer's kernel has no master_params/sr_seeds lists (Note [param "
            "rounding] in cuda/multi_tensor_apply.cuh), so it cannot take master_weights or "
            "stochastic_rounding; add them to the kernel or leave both False"
        )


def check_rounding_params(group: dict[str, Any]) -> None:
    """``stochastic_rounding`` needs bfloat16 params: fp16's range makes unbiased rounding of
    tiny updates a loss-scaling problem, and fp32 needs no help."""
    if not group.get("stochastic_rounding", False):
        return
    for param in group["params"]:
        if param.dtype != torch.bfloat16:
            raise ValueError(
                f"stochastic_rounding=True needs bfloat16 params, but a param of shape "
                f"{tuple(param.shape)} is {param.dtype}; convert the model (model.bfloat16()), "
                "put other params in a group with stochastic_rounding=False, or use "
                "master_weights=True for float16"
            )


def stage_rounding_state(
    param: Tensor, state: dict[str, Any], group: dict[str, Any], index: int
) -> tuple[Tensor | None, Tensor | None, dict[str, Any]]:
    """The param's master (``None`` when off; an fp32 param is its own master) and seed (``None``
    when off), and the state entries to change: created ones, and ``None`` for a master left
    over from a step without ``master_weights`` (it would be stale when turned on again)."""
    changes: dict[str, Any] = {}
    master = seed = None
    if group.get("master_weights", False):
        master = state.get(MASTER_KEY)
        if param.dtype in (torch.float32, torch.float64):
            master = param
        elif not is_master_of(master, param):
            # Created from the param on its first step; a loaded one keeps its bits in the
            # param's layout and device. Detached: the plan may run with grad mode on, and state
            # must not record (or keep alive) the param's autograd graph.
            _check_master(master, param)
            master = torch.empty_like(param, dtype=torch.float32).copy_(
                param.detach() if master is None else master.detach()
            )
            changes[MASTER_KEY] = master
    elif MASTER_KEY in state:
        changes[MASTER_KEY] = None
    if group.get("stochastic_rounding", False):
        seed = state.get(SEED_KEY)
        if not (
            isinstance(seed, Tensor)
            and seed.dtype == torch.int32
            and seed.shape == ()
            and seed.device == param.device
        ):
            seed = _as_seed(seed, index, param)
            changes[SEED_KEY] = seed
    return master, seed, changes


def is_master_of(master: Any, param: Tensor) -> TypeGuard[Tensor]:
    """Whether ``master`` can serve as the fp32 master of the 16-bit ``param`` as it is."""
    return (
        param.dtype in (torch.float16, torch.bfloat16)
        and isinstance(master, Tensor)
        and master.dtype == torch.float32
        and master.shape == param.shape
        and master.stride() == param.stride()
        and master.device == param.device
    )


def resync_masters_(params: list[Tensor], masters: list[Tensor]) -> None:
    """Copies into each master every element of its param that differs from the master rounded
    to the param's dtype (Note [param edits under master weights]); on device, sync-free."""
    for param, master in zip(params, masters):
        edited = param.detach()
        master.copy_(torch.where(master.to(param.dtype) == edited, master, edited.float()))


def _check_master(master: Any, param: Tensor) -> None:
    if master is None or (
        isinstance(master, Tensor) and master.shape == param.shape and master.is_floating_point()
    ):
        return
    raise ValueError(
        f"Corrupt optimizer state: {MASTER_KEY!r} of a param of shape {tuple(param.shape)} is "
        f"{master!r}; it must be a floating tensor of the param's shape. Load a state_dict saved "
        "for this model, or delete the entry (del opt.state[p]['master_param']) to restart it "
        "from the param"
    )


def _as_seed(value: Any, index: int, param: Tensor) -> Tensor:
    if value is None:
        return initial_seed(index).to(param.device)
    if (
        isinstance(value, Tensor)
        and value.numel() == 1
        and not value.is_floating_point()
        and not value.is_complex()
    ):
        return value.detach().reshape(()).to(dtype=torch.int32, device=param.device, copy=True)
    raise TypeError(
        f"Corrupt optimizer state: {SEED_KEY!r} of a param of shape {tuple(param.shape)} is "
        f"{value!r}; it must be a one-element integer tensor. Load a state_dict saved by this "
        "optimizer, or delete the entry (del opt.state[p]['sr_seed']) to re-derive it"
    )


class MasterWatch:
    """The 16-bit params of ``master_weights`` groups that have an fp32 master, their masters,
    and (once a step committed) each param's version counter and data pointer after it: Note
    [param edits under master weights]."""

    def __init__(self, params: list[Tensor], masters: list[Tensor]) -> None:
        self.params = params
        self.masters = masters
        self.versions: list[int] | None = None
        self.pointers: list[int] | None = None
        # Where the params were when this step was planned: a commit does not move them.
        self._planned_pointers: list[int] | None = None

    @staticmethod
    def of(optimizer: Any, new_state: dict[Tensor, dict[str, Any]]) -> MasterWatch | None:
        """Every param with a master after the step ``new_state`` creates, with or without a
        grad (an edit is followed whether or not the param is stepped)."""
        params, masters = [], []
        for group in optimizer.param_groups:
            if group.get("master_weights", False) is not True:
                continue
            for param in group["params"]:
                state = new_state.get(param) or optimizer.state.get(param, {})
                master = state.get(MASTER_KEY) if isinstance(state, dict) else None
                if is_master_of(master, param):
                    params.append(param)
                    masters.append(master)
        return MasterWatch(params, masters) if params else None

    def edited(self, optimizer: Any) -> list[int]:
        """The indices of the params written by someone else since the optimizer's last step
        (their version counter or data pointer moved); none for a param it never recorded (a
        loaded or copied state: its master is the truth)."""
        pointers = self._planned_pointers = list(map(_DATA_PTR, self.params))
        last = optimizer._master_watch
        if last is None or last.versions is None or last.pointers is None:
            return []
        versions = list(map(_VERSION, self.params))
        recorded: list[tuple[int, int] | None]
        if last is self:  # the steady state: the same params, compared in C
            if versions == last.versions and pointers == last.pointers:
                return []
            recorded = list(zip(last.versions, last.pointers))
        else:  # the previous plan watched other params (the holder keeps their ids unique)
            known = dict(zip(map(id, last.params), zip(last.versions, last.pointers)))
            recorded = [known.get(id(p)) for p in self.params]
        return [
            i
            for i, (now, then) in enumerate(zip(zip(versions, pointers), recorded))
            if then is not None and now != then
        ]

    def resync_(self, edited: list[int]) -> None:
        """Copies the edits of the params at ``edited`` into their masters (resync_masters_)."""
        resync_masters_([self.params[i] for i in edited], [self.masters[i] for i in edited])

    def record(self, optimizer: Any) -> None:
        """Records the params as the step that just committed left them (torch's ops move
        their version counters; our kernels write through pointers and do not)."""
        self.versions = list(map(_VERSION, self.params))
        self.pointers = self._planned_pointers or list(map(_DATA_PTR, self.params))
        optimizer._master_watch = self
