"""Refuse ``torch.utils.checkpoint`` called inside a scaledoptim region on edited ops.

Note [checkpoint recomputation]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's checkpoint records torch's autocast state when the
checkpointed function runs and restores it when backward recomputes the function, but not
scaledoptim's region: the recomputation runs the edited ops with torch's policies. With
``use_reentrant=False`` backward then fails (``CheckpointError``, the saved tensors' dtypes
differ); with ``use_reentrant=True`` it silently differentiates another function.
``scaledoptim.amp.checkpoint`` carries the region over. When an edited op runs inside torch's
checkpoint under a region entered *outside* the checkpointed function, the kernel refuses,
naming that fix. A region entered inside the checkpointed function is entered again by the
recomputation and needs nothing.

The check costs two C calls per edited op in a region; it walks the Python stack only when
a checkpoint may be running: saved-tensor hooks were pushed since the region was entered
(non-reentrant checkpoint pushes its own), or grad mode went off (the reentrant one runs
the function under ``no_grad``). The walk goes from the op up to the frame that entered the
region; torch's ``checkpoint`` function on the way means the region is outside it.
"""

from __future__ import annotations

import inspect
import sys
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .regions import Entry

_codes: tuple[Any, Any] | None = None


def _checkpoint_codes() -> tuple[Any, Any]:
    global _codes
    if _codes is None:
        import torch.utils.checkpoint as torch_checkpoint

        _codes = (
            inspect.unwrap(torch_checkpoint.checkpoint).__code__,
            torch_checkpoint.CheckpointFunction.forward.__code__,
        )
    return _codes


def refuse_torch_checkpoint(entry: Entry, op_name: str) -> None:
    """Raise if ``op_name`` runs in torch's checkpoint inside the region ``entry``.

    Raises:
        RuntimeError: the checkpoint will recompute the op in backward without the region
            (Note [checkpoint recomputation]).
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    hooks_pushed = hooks is not None and (entry.hooks is None or hooks[0] is not entry.hooks[0])
    if not hooks_pushed and not (entry.grad_enabled and not torch.is_grad_enabled()):
        return
    checkpoint_code, reentrant_forward_code = _checkpoint_codes()
    frame: Any = sys._getframe(1)
    reentrant_ctx = None
    while frame is not None and frame is not entry.frame:
        code = frame.f_code
        if code is reentrant_forward_code:
            reentrant_ctx = frame.f_locals.get("ctx")
        elif code is checkpoint_code:
            if reentrant_ctx is not None:
                # Recomputed only if the checkpoint is in the graph: an input needs grad.
                recorded = any(getattr(reentrant_ctx, "needs_input_grad", (True,)))
            else:
                # The non-reentrant checkpoint pushes its hooks only when grad is enabled.
                recorded = hooks is not None
            if recorded:
                raise RuntimeError(_message(op_name, reentrant_ctx is not None))
            reentrant_ctx = None
        frame = frame.f_back


def _message(op_name: str, reentrant: bool) -> str:
    consequence = (
        "backward would silently compute the gradients of a different function"
        if reentrant
        else "backward would fail with a CheckpointError"
    )
    return (
        f"{op_name} has an edited autocast policy and runs inside torch.utils.checkpoint, "
        "which was called inside a scaledoptim.amp.autocast region: the checkpoint restores "
        "torch.autocast's state when backward recomputes the function, not scaledoptim's "
        f"policies, so {consequence}. Call scaledoptim.amp.checkpoint(function, *args, ...) "
        "instead (it takes torch.utils.checkpoint.checkpoint's arguments and recomputes under "
        "the same region and policies), or enter the scaledoptim.amp.autocast region inside "
        "the checkpointed function."
    )
