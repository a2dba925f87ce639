"""What runs at each step of the torch-native backend: each group's update on its route, and the
check of the grads before them, both chosen once when the plan is prepared (Note [route table]
in route_table.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from itertools import chain
from typing import cast

import torch
from torch import Tensor

from ...kernels import PLAIN_TENSOR_TYPES, is_dense
from ...protocol.clipping import sum_of_squares
from ...scale import ScaleUpdate
from ...torch_ops import (
    HOST_READS,
    LOW_PRECISION,
    UnscaledBefore,
    advance_steps_,
    local_tensors,
    skip_on_host,
    stochastic_round_,
    unscale_dense_,
    unscale_in_place_,
)
from ..update import GradReduction, Group, ScaledTorchUpdate, TensorLists, Update
from .base import PreparedUpdate
from .in_place import update_in_place_, update_on_working_copies_
from .route_table import Check, Form, GroupFacts, Route, Working, choose_check, choose_route
from .working_copies import UnscaledCheck, WorkingCopies

__all__ = ["TorchCheck", "TorchEpilogue", "TorchReduction", "TorchUpdate"]


class TorchUpdate:
    """One group's update on its route (Note [route table])."""

    #: Whether this is torch.optim's implementation (the torch.optim backend's subclass).
    torch_optim = False

    def __init__(self, update: Update, group: Group, lists: TensorLists) -> None:
        self.update = update
        self.group = group
        params, grads, *state_lists, steps = lists
        masters: list[Tensor] = []
        seeds: list[Tensor] = []
        if update.rounds:  # See Note [param rounding]
            *state_lists, masters, seeds = state_lists
        # See Note [tensor subclasses] in torch_native.py: the subclass params the plan hands an
        # elementwise update as they are run on their local tensors.
        self.local = update.elementwise and any(type(p) not in PLAIN_TENSOR_TYPES for p in params)
        if self.local:
            params, grads, masters, seeds = map(local_tensors, (params, grads, masters, seeds))
            state_lists = [local_tensors(state) for state in state_lists]
        self.params, self.masters, self.seeds, self.steps = params, masters, seeds, steps
        self.state_lists = state_lists
        # The step cache keeps the dtypes and layouts as planned (Note [step cache]).
        on_tensors = not masters and all(
            p.dtype not in LOW_PRECISION and g.dtype == p.dtype for p, g in zip(params, grads)
        )
        self.facts = GroupFacts(
            torch_optim=self.torch_optim,
            fused_op=not update.torch_form_in_place,
            host_reads=bool(params) and HOST_READS.free(params[0].device),
            on_tensors=on_tensors,
            copies_by_batch=not on_tensors
            and not self.torch_optim  # its counters are kept its way
            and bool(params)
            and params[0].device.type == "cpu"
            and update.elementwise
            and WorkingCopies.fits(params, grads, masters, state_lists),
        )
        self.copies: WorkingCopies | None = None
        if self.facts.copies_by_batch:
            scaled_form = None  # where the update can unscale the grads in its own read
            if update.torch_update_takes_grad_scale:
                scaled_form = partial(cast(ScaledTorchUpdate, update).torch_update, group)
            self.copies = WorkingCopies(
                params, grads, masters, state_lists, seeds, steps, scaled_form
            )
        self._choose(self.facts)

    def _choose(self, facts: GroupFacts) -> None:
        self.facts = facts
        self.route = choose_route(facts)
        self._switch = HOST_READS.on_cpu
        # The route's functions, unbound: a bound method kept on the instance would be a
        # reference cycle, and the state it holds would outlive a load_state_dict until a
        # collection.
        self._copies = _COPIES[self.route.working]
        self._form = _FORMS[self.route.form]

    def takes_grad_scale(self) -> bool:
        """Whether it can take grads still scaled (Note [unscale in the update on a CPU]):
        torch's fused op, taking a ``grad_scale``, on the group's own plain fp32 tensors."""
        return (
            self.route == Route(Working.TENSORS, Form.FUSED_OP)
            and self.update.torch_update_takes_grad_scale
            and not self.local
        )

    def __call__(
        self, found_inf: Tensor | None, inv_scale: Tensor | None, grads: list[Tensor]
    ) -> None:
        if HOST_READS.on_cpu != self._switch:  # See Note [route table]: the one fact that moves
            params = self.params
            host_reads = bool(params) and HOST_READS.free(params[0].device)
            self._choose(dataclasses.replace(self.facts, host_reads=host_reads))
        if self.local:
            grads = local_tensors(grads)
        if self._copies is None:  # the form on the group's tensors
            lists = [self.params, grads, *self.state_lists, self.steps]
            self._form(self, lists, found_inf, inv_scale)
            return
        self._copies(self, found_inf, inv_scale, grads)

    def repoint(self, pointers: list[int]) -> None:
        pass  # it holds no grads

    # ---------------------------------------------------------------- fp32 working copies
    def _on_copies_by_batch(
        self, found_inf: Tensor | None, inv_scale: Tensor | None, grads: list[Tensor]
    ) -> None:
        # Grads left scaled by UnscaledCheck where inv_scale is set (Note [working copies by
        # batch]).
        assert self.copies is not None
        self.copies(partial(self._form, self), found_inf, grads, inv_scale, self.facts.host_reads)

    def _on_whole_copies(
        self, found_inf: Tensor | None, inv_scale: Tensor | None, grads: list[Tensor]
    ) -> None:
        params = self.params
        # See Note [param rounding]: with masters the update runs on them in place.
        work = self.masters or [p.float() if p.dtype in LOW_PRECISION else p for p in params]
        work_grads = [g if g.dtype == w.dtype else g.to(w.dtype) for g, w in zip(grads, work)]
        self._form(self, [work, work_grads, *self.state_lists, self.steps], found_inf, None)
        if self.seeds:  # the counters now count this step, as the kernels' `*step + 1`
            # The rounding writes a param's storage in order: a view with gaps gets its values
            # through a dense copy (rounded in the order of its working copy's elements).
            out = [
                p if is_dense(p) else torch.empty_like(w, dtype=p.dtype)
                for p, w in zip(params, work)
            ]
            stochastic_round_(out, work, self.seeds, self.steps, on_host=self.facts.host_reads)
            for param, rounded_value in zip(params, out):
                if rounded_value is not param:
                    param.copy_(rounded_value)
            return
        rounded = [(p, w) for p, w in zip(params, work) if p is not w]
        if not rounded:
            return
        # A differentiable step: autograd records copy_, not the foreach op.
        if torch.is_grad_enabled():
            for param, value in rounded:
                param.copy_(value)
        else:
            torch._foreach_copy_([p for p, _ in rounded], [w for _, w in rounded])

    # ---------------------------------------------------------------- the forms
    def _torch_optim_form(
        self, lists: TensorLists, found_inf: Tensor | None, inv_scale: Tensor | None = None
    ) -> None:
        self.update.torch_optim_update(self.group, lists, found_inf)

    def _fused_op(
        self, lists: TensorLists, found_inf: Tensor | None, inv_scale: Tensor | None = None
    ) -> None:
        if inv_scale is None:
            self.update.torch_update(self.group, lists, found_inf)
            return
        # Grads left scaled for it: Note [unscale in the update on a CPU].
        scaled = cast(ScaledTorchUpdate, self.update)
        scaled.torch_update(self.group, lists, found_inf, grad_scale=inv_scale.reciprocal())

    def _in_place(
        self, lists: TensorLists, found_inf: Tensor | None, inv_scale: Tensor | None = None
    ) -> None:
        if not lists[0]:
            return
        skip = skip_on_host(found_inf, host_reads=True)
        if skip:
            return
        if skip is None:  # a step autograd records: decided on device
            self._on_clones(lists, found_inf)
            return
        advance_steps_(lists[-1], None)  # the step is taken: the form reads the new count
        update_in_place_(self.update, self.group, lists, batched=True)

    def _on_clones(
        self, lists: TensorLists, found_inf: Tensor | None, inv_scale: Tensor | None = None
    ) -> None:
        if not lists[0]:
            return
        if found_inf is None and not torch.is_grad_enabled():  # taken: no clones needed
            advance_steps_(lists[-1], None)
            update_in_place_(self.update, self.group, lists, batched=False)
            return
        update_on_working_copies_(self.update, self.group, lists, found_inf)


#: The routes' functions, unbound (see ``TorchUpdate._choose``); on the group's tensors, none.
_COPIES: dict[
    Working, Callable[[TorchUpdate, Tensor | None, Tensor | None, list[Tensor]], None] | None
] = {
    Working.TENSORS: None,
    Working.COPIES_BY_BATCH: TorchUpdate._on_copies_by_batch,
    Working.WHOLE_COPIES: TorchUpdate._on_whole_copies,
}
_FORMS: dict[Form, Callable[[TorchUpdate, TensorLists, Tensor | None, Tensor | None], None]] = {
    Form.TORCH_OPTIM: TorchUpdate._torch_optim_form,
    Form.FUSED_OP: TorchUpdate._fused_op,
    Form.IN_PLACE: TorchUpdate._in_place,
    Form.ON_CLONES: TorchUpdate._on_clones,
}


# Note [unscale in the update on a CPU]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Unscaled in a pass of their own, then clipped in place, fp32 grads are read and written twice
# before the update reads them: on a CPU, where a step is bound by memory traffic, that made a
# clipping step cost more than GradScaler + ``clip_grad_norm_`` + torch's fused AdamW. So when a
# step clips (``max_grad_norm``) and every update of it takes a ``grad_scale``
# (``Update.torch_update_takes_grad_scale``: torch's fused Adam(W), SGD and Adagrad) over float32
# params and grads, on a CPU (Note [host skip] in torch_ops/skip.py), the check reads the scaled
# grads once, read-only, for the 2-norm the clip needs (one ``_foreach_norm``), and leaves them
# scaled; the update divides them by ``S / coef`` (Note
# [clipping in the step] in protocol/clipping.py) and, as torch's fused ops do, leaves them unscaled
# and clipped. ``found_inf`` is set on device, no host read, when the unscaled norm (the scaled one
# times ``inv_scale``) is not below ``_FOLD_NORM_LIMIT``: an inf or nan anywhere makes it
# non-finite, and below the limit no unscaled element can overflow, at a scale below 1 too. One case
# differs from GradScaler, which checks the elements: finite grads whose scaled norm is past
# float32's range (about 1.8e19) count as an overflow, so the step is skipped and the scale backs
# off until the norm fits. That is why a step that does not clip keeps the element check (unscale in
# place): at a large scale, as after a long run of clean steps, the scaled norm of finite grads may
# pass the range, and a step without clipping must skip exactly where GradScaler does. The unscaled
# norm is the scaled one times ``inv_scale``: with a scale that is a power of 2, the same float as
# the norm of the unscaled grads. Other devices and the sync-free form keep the unscale in place.
_FOLD_NORM_LIMIT = 1e37  # an unscaled grad norm below it: no unscaled element can overflow


class TorchCheck:
    """The check of a step's grads, on the route of Note [route table]: unscaled in place (and
    so checked: ``checked`` saves nothing here), or checked only where the updates unscale them
    in their own read (Note [unscale in the update on a CPU], Note [working copies by batch])."""

    def __init__(self, grad_lists: list[list[Tensor]], updates: list[PreparedUpdate]) -> None:
        grads = list(chain.from_iterable(grad_lists))
        torch_updates = [u for u in updates if isinstance(u, TorchUpdate)]
        every = bool(updates) and len(torch_updates) == len(updates)
        # Dense float32 grads only (the common case) take torch's op with no per-grad Python;
        # the step cache keeps the grads' dtypes and layout as planned (Note [step cache]).
        self.float32 = all(g.dtype == torch.float32 and g.layout == torch.strided for g in grads)
        self.fused_op = every and all(u.takes_grad_scale() for u in torch_updates)
        self.by_batch = every and all(
            u.copies is not None and u.copies.convert_grads for u in torch_updates
        )
        # See Note [tensor subclasses]: DTensor grads of an update that is not elementwise are
        # checked through their local tensors (the plan agrees over their meshes).
        self.local = any(not u.update.elementwise for u in torch_updates) and any(
            type(g) not in PLAIN_TENSOR_TYPES for g in grads
        )
        self.device = grads[0].device if grads else None
        self.by_batches = UnscaledCheck(grads) if self.by_batch and not self.float32 else None
        self._choose()

    def _choose(self) -> None:
        self._switch = HOST_READS.on_cpu
        self.host_reads = self.device is not None and HOST_READS.free(self.device)
        #: The check of a step that does not clip, and of one that does.
        self.checks = [
            choose_check(self.float32, self.fused_op, self.by_batch, self.host_reads, clipping)
            for clipping in (False, True)
        ]

    def __call__(
        self,
        found_inf: Tensor,
        inv_scale: Tensor,
        checked: frozenset[int],
        grad_lists: list[list[Tensor]],
        norm_sq: Tensor | None = None,
        unscaled: list[list[Tensor]] | None = None,
    ) -> Tensor | None:
        if HOST_READS.on_cpu != self._switch:  # See Note [route table]: the one fact that moves
            self._choose()
        check = self.checks[norm_sq is not None]
        if isinstance(unscaled, UnscaledBefore):  # See Note [atomic step]: a retry
            mine = list(chain.from_iterable(grad_lists))
            if unscaled.holds(local_tensors(mine) if self.local else mine):
                check = Check.INTO_FP32  # the failed try unscaled some of them in place
        if check is Check.INTO_FP32:
            # 16-bit grads are unscaled into fp32 copies, which the update then reads: unscaled in
            # 16 bits, a small true grad flushes to zero, and at a scale below 1 a large one
            # overflows after torch's check.
            for same_group in grad_lists:
                for i, grad in enumerate(same_group):
                    if grad.dtype in LOW_PRECISION:
                        same_group[i] = grad.float()
        grads = grad_lists[0] if len(grad_lists) == 1 else list(chain.from_iterable(grad_lists))
        if self.local:
            grads = local_tensors(grads)
        if not grads:
            return None
        if check is Check.BY_NORM:  # See Note [unscale in the update on a CPU]
            assert norm_sq is not None
            _check_by_norm(grads, found_inf, inv_scale, norm_sq)
            return inv_scale  # the updates unscale
        if check is Check.BY_BATCH:  # See Note [working copies by batch]
            assert self.by_batches is not None
            self.by_batches(grads, found_inf, inv_scale, self.host_reads)
            return inv_scale  # the copies unscale
        if check is Check.UNSCALED_IN_PLACE:
            # See Note [overflow after unscaling]: the second pass only at a scale below 1
            unscale_dense_(grads, found_inf, inv_scale, self.host_reads, unscaled)
        else:
            unscale_in_place_(grads, found_inf, inv_scale, unscaled)
        if norm_sq is not None:  # See Note [clipping in the step]: of the unscaled grads
            norm_sq.add_(sum_of_squares(grads))
        return None

    def repoint(self, pointers: list[int]) -> None:
        pass  # it holds no grads


def _check_by_norm(
    grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor, norm_sq: Tensor
) -> None:
    """Sets ``found_inf`` (on device) unless the unscaled 2-norm of the scaled ``grads``, read
    once, is below ``_FOLD_NORM_LIMIT``, and adds its square to ``norm_sq`` (Note [unscale in
    the update on a CPU])."""
    # sqrt(x ** 2) == x exactly (Note [clipping in the step]): the norm clip_grad_norm_ computes
    norm = sum_of_squares(grads).sqrt() * inv_scale
    torch.maximum(found_inf, (norm < _FOLD_NORM_LIMIT).logical_not().float(), out=found_inf)
    norm_sq.add_(norm.square())


class TorchReduction:
    """A reduction's torch form over the step's grads as the unscale left them."""

    def __init__(self, reduction: GradReduction) -> None:
        self.reduction = reduction

    def __call__(
        self, found_inf: Tensor | None, inv_scale: Tensor | None, grad_lists: list[list[Tensor]]
    ) -> None:
        self.reduction.out.zero_()
        grads = list(chain.from_iterable(grad_lists))
        if inv_scale is not None:  # left scaled for updates that unscale in their own read
            grads = [g.float() if g.dtype in LOW_PRECISION else g for g in grads]
            grads = list(torch._foreach_mul(grads, inv_scale))
        self.reduction.torch_form(grads)

    def repoint(self, pointers: list[int]) -> None:
        pass  # it holds no grads


class TorchEpilogue:
    """The torch forms advanced the counters; a scale update arrives only if deferred."""

    def __call__(self, found_inf: Tensor | None, scale_update: ScaleUpdate | None) -> None:
        if scale_update is not None:
            scale_update.apply()
