"""Autocast on the dispatcher, with cast policies you can edit.

``scaledoptim.amp.autocast`` is :class:`torch.autocast` plus per-op policies that can be
changed for any aten op or custom ``torch.library`` op. Ops keep torch's own C++ autocast
kernels unless their policy is edited; plain ``torch.autocast`` regions are never affected.
Edited policies hold in code compiled with ``torch.compile`` and, through ``checkpoint``, in
the recomputation of checkpointed functions. See ``docs/autocast.md``.
"""

from __future__ import annotations

from .activation_checkpoint import checkpoint
from .cache import cache_stats
from .context import autocast
from .decorators import custom_bwd, custom_fwd, float32
from .policies import DEFAULT_POLICIES, POLICY_NAMES
from .registry import edited_policies, get_policy, reset_policy, set_policy

__all__ = [
    "DEFAULT_POLICIES",
    "POLICY_NAMES",
    "autocast",
    "cache_stats",
    "checkpoint",
    "custom_bwd",
    "custom_fwd",
    "edited_policies",
    "float32",
    "get_policy",
    "reset_policy",
    "set_policy",
]
