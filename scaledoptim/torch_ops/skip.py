"""The skip of a step, on device or on the host: the unscale in place with its inf/nan check,
step counters (:class:`PackedSteps`), the copy gated on ``found_inf``, and where a tensor may be
read on the host (Note [host skip])."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import attrgetter

import torch
from torch import Tensor

__all__ = [
    "HOST_READS",
    "LOW_PRECISION",
    "HostReads",
    "PackedSteps",
    "UnscaledBefore",
    "advance_steps_",
    "copy_unless_skipped_",
    "restore_counters_",
    "saved_counters",
    "skip_on_host",
    "unscale_dense_",
    "unscale_in_place_",
]

#: The 16-bit float dtypes: their grads are unscaled into fp32, their params computed in fp32.
LOW_PRECISION = (torch.float16, torch.bfloat16)
_DTYPE = attrgetter("dtype")
_IS_SPARSE = attrgetter("is_sparse")
_IS_COMPLEX = attrgetter("is_complex")


def unscale_in_place_(
    grads: Sequence[Tensor],
    found_inf: Tensor,
    inv_scale: Tensor,
    unscaled: list[list[Tensor]] | None = None,
) -> None:
    """``g *= inv_scale`` for every grad, setting ``found_inf`` on inf/nan in what the update
    will read: the unscaled values (torch's op, grouped by dtype as it requires).

    torch's op checks the grads before multiplying, so they are checked again after where that
    can find more (Note [overflow after unscaling]). A sparse grad is unscaled through its
    values, as ``torch.amp.GradScaler`` does; an uncoalesced one is checked again coalesced,
    since values at one index sum when it is applied (GradScaler does so for fp16 grads only: a
    float32 or bfloat16 sum past the range would reach the params). A complex grad is unscaled
    as its real view.
    Reads ``inv_scale`` on the host where that is free (:data:`HOST_READS`).

    ``unscaled``, when given, gets the tensors of each of torch's unscales once it has written
    them; where it is an :class:`UnscaledBefore`, a grad a failed try unscaled is checked as it
    is, not unscaled again: the same ``found_inf`` (Note [atomic step] in protocol/steps.py).
    """
    host_reads = HOST_READS.free(inv_scale.device)
    if isinstance(unscaled, UnscaledBefore):
        grads = unscaled.check_unscaled_(grads, found_inf)
    dtypes = set(map(_DTYPE, grads))
    if len(dtypes) == 1 and not any(map(_IS_SPARSE, grads)) and not any(map(_IS_COMPLEX, dtypes)):
        # The common case, dense grads of one real dtype, without a Python step per grad.
        unscale_dense_(list(grads), found_inf, inv_scale, host_reads, unscaled)
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    uncoalesced: list[Tensor] = []
    for grad in grads:
        if grad.is_sparse:
            if not grad.is_coalesced():
                uncoalesced.append(grad)
        tensor = _written(grad)
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same_dtype in by_dtype.values():
        unscale_dense_(same_dtype, found_inf, inv_scale, host_reads, unscaled)
    for grad in uncoalesced:
        _check_non_finite_([grad.coalesce()._values()], found_inf)


def _written(grad: Tensor) -> Tensor:
    """The dense real tensor torch's unscale writes for ``grad``: a sparse grad's values, a
    complex one's real view."""
    tensor = grad._values() if grad.is_sparse else grad
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


class UnscaledBefore(list[list[Tensor]]):
    """What the in-place unscales of a step's failed try wrote (a list per call of torch's op),
    for its retry to append its own to (Note [atomic step] in protocol/steps.py)."""

    def __init__(self, before: Iterable[list[Tensor]]) -> None:
        super().__init__(before)
        self.before = frozenset(t.data_ptr() for tensors in self for t in tensors)

    def holds(self, grads: Iterable[Tensor]) -> bool:
        """Whether the failed try unscaled any of ``grads``."""
        return any(_written(g).data_ptr() in self.before for g in grads)

    def check_unscaled_(self, grads: Sequence[Tensor], found_inf: Tensor) -> list[Tensor]:
        """Checks the ``grads`` the failed try unscaled as they are into ``found_inf``; returns
        the others. Times one, a finite grad unscaled stays finite and an inf/nan one stays one:
        checked as :func:`unscale_in_place_` checks it, before and after the multiply."""
        held = [self.holds([g]) for g in grads]
        again = [g for g, h in zip(grads, held) if h]
        unscale_in_place_(again, found_inf, torch.ones_like(found_inf))
        return [g for g, h in zip(grads, held) if not h]


def unscale_dense_(
    tensors: list[Tensor],
    found_inf: Tensor,
    inv_scale: Tensor,
    host_reads: bool = False,
    unscaled: list[list[Tensor]] | None = None,
) -> None:
    """``t *= inv_scale`` for dense real ``tensors`` of one dtype, setting ``found_inf`` on
    inf/nan before the multiply, and after it where the product may overflow: at a scale below
    1, read on the host where ``host_reads`` says that is free (:data:`HOST_READS`' answer for
    its device), else always (Note [overflow after unscaling]). ``tensors`` are added to
    ``unscaled``, when given, once written (:func:`unscale_in_place_`)."""
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)
    if unscaled is not None:
        unscaled.append(tensors)
    # Not `inv_scale <= 1`: a scale that is not a number is checked too.
    if not host_reads or not inv_scale.item() <= 1.0:
        _check_non_finite_(tensors, found_inf)


# Note [overflow after unscaling]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's ``_amp_foreach_non_finite_check_and_unscale_`` checks each value before multiplying it
# by ``inv_scale``. At a scale below 1 (``inv_scale > 1``) a finite scaled value can unscale to
# inf (9.5e32 at 2**-20 in float32, far less in fp16), and the update would read that inf: an
# overflow the op does not see. At a scale of at least 1 it cannot happen: ``|g * inv_scale|
# <= |g|`` in any float dtype (the product is rounded, never past ``|g|``), so finite stays
# finite. The second pass that finds it (a read and a write of every grad) therefore runs only
# where the scale may be below 1: where ``inv_scale`` is read on the host for free (a CPU, Note
# [host skip]) only when it is; elsewhere (a GPU's sync-free step) always. Our kernels check the
# product they update with, in registers (cuda/non_finite_check.cu): no pass of its own there.


def _check_non_finite_(tensors: list[Tensor], found_inf: Tensor) -> None:
    """Sets ``found_inf`` on inf/nan in ``tensors`` (of one dtype), changing none of them (torch's
    op multiplies by one: the same values are written back)."""
    one = torch.ones((), dtype=torch.float32, device=found_inf.device)
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, one)


class PackedSteps(list[Tensor]):
    """A list of step counters that are the elements of one 1-D tensor, :attr:`flat`, in order
    (Note [packed counters]).

    Note [packed counters]
    ~~~~~~~~~~~~~~~~~~~~~~
    Every param of a fused optimizer has a 0-dim float32 ``state["step"]`` (torch's state name;
    the kernels read it, a skipped first step must not count). Advanced with a foreach op over
    2000 0-dim CPU tensors, they cost 3 ms a step, as much as torch's whole fused SGD step over
    2000x1k params: torch's CPU foreach ops loop over the tensors. So the full plan
    (``fused/plan.py``) makes a CPU group's counters views of one tensor, ``flat[i]``,
    and hands the update a ``PackedSteps``, which :func:`advance_steps_` advances with one
    ``add_`` of ``flat``. A list sliced or copied from it is a plain list and takes the foreach
    op: only the plan builds one, and the step cache replans when any state value moves (a
    counter replaced or loaded is new storage), so a ``PackedSteps`` is always exactly
    ``flat.unbind()``. The counters stay separate 0-dim tensors to everyone else (state_dict,
    the kernels' tables, torch.optim's implementations).
    """

    def __init__(self, flat: Tensor) -> None:
        super().__init__(flat.unbind())
        self.flat = flat


def advance_steps_(steps: list[Tensor], found_inf: Tensor | None) -> None:
    """Adds 1 to every step counter, or nothing when ``found_inf`` is set (on device)."""
    if not steps:
        return
    if isinstance(steps, PackedSteps):
        steps.flat.add_(1 if found_inf is None else 1 - found_inf)
    elif found_inf is None:
        torch._foreach_add_(steps, 1)
    else:
        # `alpha=` matches only the Tensor overload: without it Python's argument parser takes
        # the 0-dim tensor as the Scalar overload's number, an .item() (a sync on a GPU).
        torch._foreach_add_(steps, 1 - found_inf, alpha=1)


def saved_counters(steps: list[Tensor]) -> Tensor | None:
    """A copy of the step counters ``steps``, for :func:`restore_counters_` to put back
    (``None`` for none)."""
    if isinstance(steps, PackedSteps):
        return steps.flat.clone()
    return torch.stack(steps) if steps else None


def restore_counters_(steps: list[Tensor], saved: Tensor | None) -> None:
    """Puts back the counters :func:`saved_counters` copied from ``steps``."""
    if saved is None:
        return
    if isinstance(steps, PackedSteps):
        steps.flat.copy_(saved)
    else:
        torch._foreach_copy_(steps, list(saved.unbind()))


def copy_unless_skipped_(
    dst: Sequence[Tensor], src: Sequence[Tensor], found_inf: Tensor | None
) -> None:
    """``dst[i] = src[i]``, or nothing when ``found_inf`` is set (on device, no host read)."""
    if found_inf is None:
        torch._foreach_copy_(list(dst), list(src))
        return
    skip = found_inf > 0
    for d, s in zip(dst, src):
        d.copy_(torch.where(skip, d, s))


# Note [host skip]
# ~~~~~~~~~~~~~~~~
# The sync-free contract (found_inf stays on device, a skipped step is a no-op decided there)
# exists for CUDA streams: a host read waits for the GPU. A CPU tensor's value is already there,
# so on a CPU the torch forms read found_inf and skip on the host, and update in place with
# foreach ops; the sync-free way (the same form on working copies, then a `torch.where` + copy per
# list: see Note [one torch form] in fused/backends/in_place.py) stays for every other
# device, and for a step autograd records (a differentiable step). The unscale reads the scale
# there too, to skip a pass that cannot find anything (Note [overflow after unscaling]).
# Whether host reads are allowed is one switch, `HOST_READS`, here because every layer asks it:
# the protocol's unscale (`unscale_in_place_`) and the engine's torch forms (the torch-native
# backend's `host_skip` is this switch), which pass its answer to `skip_on_host` and
# `stochastic_round_`. The engine's `decide_skips_on_device()` turns it off, so that the CPU
# takes the sync-free forms too and the suite and the doctor can check them without a GPU
# (`no_host_reads` uses it), and so stochastic rounding's, which on a CPU only reads whether a
# chunk holds a NaN and makes a run's sizes a tensor.


class HostReads:
    """Whether a tensor's value may be read on the host (Note [host skip]): on a CPU, unless
    :attr:`on_cpu` is turned off (to run a GPU's sync-free forms on a CPU)."""

    def __init__(self) -> None:
        self.on_cpu = True

    def free(self, device: torch.device) -> bool:
        """Whether a tensor on ``device`` may be read on the host."""
        return self.on_cpu and device.type == "cpu"


#: The one switch of Note [host skip].
HOST_READS = HostReads()


def skip_on_host(found_inf: Tensor | None, host_reads: bool) -> bool | None:
    """Whether a step is skipped, read on the host where the caller says that is free
    (``host_reads``: :data:`HOST_READS`' answer for its device) and outside autograd, else
    ``None``: decide on device. Reads ``found_inf`` on the host only when ``host_reads``."""
    if not host_reads or torch.is_grad_enabled():
        return None
    return found_inf is not None and bool(found_inf.item())
