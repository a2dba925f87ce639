"""The torch-native backend: each optimizer's torch form, sync-free on any device: its
``Update.torch_update`` over torch's fused ops, or its ``Update.torch_form_`` through one of two
drivers (on a CPU, the skip read on the host; or working copies copied back unless skipped), on
the route each group takes (Note [route table] in route_table.py; what runs each step is in
routes.py); here, the backend.

torch's ``_fused_adam(w)_`` / ``_fused_sgd_`` read ``found_inf`` on device and skip the whole
update when it is 1.0 (Note [found_inf contract] in cuda/common.cuh), but they need params,
grads and state of one dtype and they do not advance step counters. So this backend runs 16-bit
params through fp32 working copies (state and math are fp32, the param is rounded once), which
also routes around torch 2.13's CPU ``_fused_sgd_`` leaving bf16/fp16 params of 16 or more
elements unchanged (``tests/fused/test_torch_kernels.py`` shows it); an elementwise update's
copies are made a batch of about ``BATCH`` elements at a time (Note [working copies by batch] in
working_copies.py). Counters are each torch form's business.

Grads are unscaled in place in a pass of their own, which serves every group and the fp32
copies of 16-bit grads at once, and which the torch forms without a ``grad_scale`` argument
(RMSprop, Lion, LAMB) need; except on a CPU, where the forms that take one (torch's fused
Adam(W), SGD and Adagrad) unscale in their own read of the grads (Note [unscale in the update
on a CPU]), and for 16-bit grads of updates whose copies are made by batches, which are checked
by batches and unscaled where they are copied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor

from ...torch_ops import HOST_READS
from ..update import GradReduction, Group, TensorLists, Update
from .base import Backend, PreparedUpdate
from .routes import TorchCheck, TorchEpilogue, TorchReduction, TorchUpdate

__all__ = ["TORCH_NATIVE", "TorchNativeBackend", "TorchUpdate", "decide_skips_on_device"]

# Note [tensor subclasses]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Params that are tensor subclasses (DTensor under FSDP2 or tensor parallel, ...) take this
# backend (Note [launchable tensors] in kernels/launcher.py) but for DTensors of an elementwise
# update, which the plan hands both backends as their local tensors (Note [DTensor steps on our
# kernels] in fused/sharded.py). Other updates (LAMB's per-tensor norms) take the DTensors and
# step their local shards too, their sums over whole tensors added up over the mesh (Note [sums
# over the mesh] in torch_ops/sharded.py); their grads are checked through their local tensors,
# and the plan agrees on ``found_inf`` (and the clip's sum of squares) over the meshes, on
# device, so every rank of a mesh sees an overflow in any shard and skips with the others, with
# or without ``process_group``, and plain params may stand beside them. What is left (a
# ``Partial`` DTensor, another subclass) runs torch's ops on the tensors as they are: an
# elementwise update on their local tensors (``local_tensors``: a DTensor's shard, any other
# subclass itself), whose check DTensor all-reduces over the mesh before it reaches the plain
# ``found_inf`` (tests/distributed/test_dist_sharded.py, an inf in one rank's shard of FSDP2
# params on both backends).


class TorchNativeBackend(Backend):
    """Updates through ``Update.torch_update`` on fp32 working copies."""

    name = "torch"
    folds_unscale = False
    applies_scale_update = False

    @property
    def host_skip(self) -> bool:
        """Whether, on a CPU, the torch forms read ``found_inf`` and skip on the host (the
        default: a host read is free there); ``False``: they decide on device everywhere, as on
        a GPU. The switch of Note [host skip] in torch_ops/skip.py."""
        return HOST_READS.on_cpu

    @host_skip.setter
    def host_skip(self, value: bool) -> None:
        HOST_READS.on_cpu = value

    def prepare_unscale(
        self, grad_lists: list[list[Tensor]], updates: list[PreparedUpdate]
    ) -> TorchCheck:
        return TorchCheck(grad_lists, updates)

    def prepare(
        self, update: Update, group: Group, lists: TensorLists, scratch: list[Tensor]
    ) -> TorchUpdate:
        return TorchUpdate(update, group, lists)

    def prepare_reduction(
        self, reduction: GradReduction, grad_lists: list[list[Tensor]]
    ) -> TorchReduction:
        return TorchReduction(reduction)

    def prepare_epilogue(self, steps: list[Tensor]) -> TorchEpilogue:
        return TorchEpilogue()


TORCH_NATIVE = TorchNativeBackend()


@contextlib.contextmanager
def decide_skips_on_device() -> Iterator[None]:
    """Inside the block the torch forms take their sync-free forms on a CPU too: the torch-native
    engine's ``host_skip`` is off."""
    # See Note [host skip] in torch_ops/skip.py: how the suite and the doctor check the GPU's form.
    saved = TORCH_NATIVE.host_skip
    TORCH_NATIVE.host_skip = False
    try:
        yield
    finally:
        TORCH_NATIVE.host_skip = saved
