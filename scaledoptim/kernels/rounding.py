"""The two tensor lists every optimizer kernel takes for the param rounding options
(Note [param rounding] in cuda/multi_tensor_apply.cuh): fp32 masters and stochastic-rounding
seeds."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["ROUNDING_LISTS", "rounding_lists"]

#: The names of the rounding lists, just before ``steps`` in an optimizer kernel's lists
#: (Note [update kernel lists] in cuda/multi_tensor_apply.cuh).
ROUNDING_LISTS = ("master_params", "sr_seeds")


def rounding_lists(
    master_params: Sequence[Tensor], sr_seeds: Sequence[Tensor]
) -> list[list[Tensor]]:
    r"""The kernel's ``master_params`` and ``sr_seeds`` lists.

    Args:
        master_params: an fp32 tensor per param (an fp32 param may be its own master), or empty.
        sr_seeds: a 0-dim int32 seed per bf16 param, or empty. The kernel reads its bits, so
            it travels as a float32 view (the launcher takes float32 per-tensor lists).

    Raises:
        ValueError: both lists given (the options are exclusive), or a seed that is not a 0-dim
            int32 tensor.
    """
    if master_params and sr_seeds:
        raise ValueError(
            "master_params and sr_seeds are exclusive: pass fp32 masters (master_weights) or "
            "seeds (stochastic_rounding), not both"
        )
    for seed in sr_seeds:
        if seed.dtype != torch.int32 or seed.shape != ():
            raise ValueError(
                f"a stochastic-rounding seed must be a 0-dim int32 tensor, got {seed.dtype} of "
                f"shape {tuple(seed.shape)}"
            )
    return [list(master_params), [seed.view(torch.float32) for seed in sr_seeds]]
