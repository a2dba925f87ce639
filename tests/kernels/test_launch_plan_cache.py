"""The launcher's table cache tells tensor lists apart: the same tensors in other lists (an
option that turns a state list on and another off) get tables of their own.

On a GPU this is the common case, not a contrived one: the caching allocator hands the next
optimizer (or the next test's) tensors the addresses the last one freed, in the same order, so
RMSprop with momentum after RMSprop centered without momentum found the centered table (grad_avg
where momentum_buffer belongs) and left momentum_buffer at 0 where torch.optim had 10
(tests/gpu, on an H200)."""

from __future__ import annotations

import torch

from scaledoptim import kernels
from scaledoptim.optim.rmsprop import RMSPROP_KERNEL

LISTS = RMSPROP_KERNEL.lists
BUFFERS, GRAD_AVGS = LISTS.index("momentum_buffers"), LISTS.index("grad_avgs")


def _rmsprop_lists(buffers: list[torch.Tensor], grad_avgs: list[torch.Tensor]) -> list[list]:
    params, grads, square_avgs = ([torch.zeros(5)] for _ in range(3))
    lists: list[list] = [params, grads, square_avgs, buffers, grad_avgs, [], [], [torch.zeros(())]]
    assert len(lists) == RMSPROP_KERNEL.n_lists
    return lists


def _table_pointers(launch: kernels.PreparedLaunch, list_index: int) -> list[int]:
    ((_, planned),) = launch.plans
    return [planned.table.ptrs[list_index][slot] or 0 for slot in range(len(planned.slot_tensors))]


def test_the_same_tensors_moved_to_another_list_get_their_own_table() -> None:
    state = torch.zeros(5)
    centered = _rmsprop_lists(buffers=[], grad_avgs=[state])
    with_momentum = [*centered[:BUFFERS], [state], [], *centered[GRAD_AVGS + 1 :]]
    first = kernels.prepare_launch(RMSPROP_KERNEL, centered)
    second = kernels.prepare_launch(RMSPROP_KERNEL, with_momentum)
    assert _table_pointers(first, GRAD_AVGS) == [state.data_ptr()]
    assert _table_pointers(first, BUFFERS) == [0]
    assert _table_pointers(second, BUFFERS) == [state.data_ptr()]
    assert _table_pointers(second, GRAD_AVGS) == [0]
