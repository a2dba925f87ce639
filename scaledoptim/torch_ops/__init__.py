"""Torch-op helpers every layer shares; this package imports only torch, a module per job.

* :func:`unscale_in_place_` and :func:`unscale_dense_`: ``g *= inv_scale`` with the inf/nan
  check of the unscaled values, on device (Note [overflow after unscaling]);
  :class:`UnscaledBefore`: what they wrote before a step failed, for its retry.
* :func:`advance_steps_`: step counters advanced unless the step is skipped, on device (one op
  for :class:`PackedSteps`, Note [packed counters]); :func:`saved_counters` and
  :func:`restore_counters_`: their values kept across an update that may fail.
* :func:`copy_unless_skipped_`: a copy gated on ``found_inf``, on device.
* :data:`HOST_READS`: whether a tensor may be read on the host (Note [host skip]);
  :func:`skip_on_host`: a step's skip read there; :data:`LOW_PRECISION`: the 16-bit float
  dtypes.
* :func:`elementwise_batches`, :func:`batches`, :class:`Pieces` and :func:`scalars`: the
  batches and 0-dim hyper-parameters of the in-place CPU forms and of the working copies of
  16-bit params.
* :func:`stochastic_round_`, :class:`StochasticRounding` and :func:`initial_seed`: the
  counter-based hash of stochastic rounding, the same integer arithmetic as ``so_sr_noise`` in
  ``cuda/dtypes.cuh`` (Note [stochastic rounding]), so both backends round to the same bits.
* :class:`MeshSums`: per-tensor sums over whole DTensors, each shard's partial summed over the
  mesh (Note [sums over the mesh]); :func:`local_tensors`: each DTensor's local shard.
* :func:`refuse_during_capture`: the CUDA-graph capture guard.
"""

from __future__ import annotations

from .batches import (
    BATCH,
    Pieces,
    batches,
    elementwise_batches,
    scalars,
    storage_flat,
)
from .capture import refuse_during_capture
from .rounding import SR_CHUNK, StochasticRounding, initial_seed, stochastic_round_
from .sharded import MeshSums, local_tensors
from .skip import (
    HOST_READS,
    LOW_PRECISION,
    PackedSteps,
    UnscaledBefore,
    advance_steps_,
    copy_unless_skipped_,
    restore_counters_,
    saved_counters,
    skip_on_host,
    unscale_dense_,
    unscale_in_place_,
)

__all__ = [
    "BATCH",
    "HOST_READS",
    "LOW_PRECISION",
    "SR_CHUNK",
    "MeshSums",
    "PackedSteps",
    "Pieces",
    "StochasticRounding",
    "UnscaledBefore",
    "advance_steps_",
    "batches",
    "copy_unless_skipped_",
    "elementwise_batches",
    "initial_seed",
    "local_tensors",
    "refuse_during_capture",
    "restore_counters_",
    "saved_counters",
    "scalars",
    "skip_on_host",
    "stochastic_round_",
    "storage_flat",
    "unscale_dense_",
    "unscale_in_place_",
]
