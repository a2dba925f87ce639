"""The one check of the refusal table (tests/refusals): a bad input to a public entry point
raises the exception a user can act on, with the words that name the problem and the fix, and
changes nothing: params, grads, optimizer state, the loss scale and its trackers stay bit for
bit; repaired, the same call works.

A :class:`Refusal` is one row: which entry point, the bad input, what it raises and says. Its
``call`` makes the input bad (or is the bad call itself) and calls the entry point; ``prepare``
runs before the snapshot (a pending ``unscale``, an extra param group); ``repair`` undoes the
bad input, after which the entry point must work again (``again``; ``repair=None``: the call
itself is the bad input).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.support.training import assert_bit_identical, snapshot

__all__ = ["NOOP", "Hook", "Refusal", "assert_refused"]

Hook = Callable[[torch.nn.Module, Any], Any]
NOOP: Hook = lambda model, opt: None  # noqa: E731


@dataclasses.dataclass(frozen=True)
class Refusal:
    """``entry`` given ``bad`` raises ``error`` whose message matches each of ``words``."""

    entry: str
    bad: str
    call: Hook
    error: type[BaseException]
    words: tuple[str, ...]
    prepare: Hook = NOOP
    repair: Hook | None = None
    #: What runs once repaired (``None``: ``call`` again).
    again: Hook | None = None
    #: The grads are as they were (``False``: a closure of the call computed new ones).
    grads_kept: bool = True
    #: Checked by each optimizer's own code (its state, its options): run on every fused row,
    #: not only on an Adam and an SGD.
    every_optimizer: bool = False

    def __str__(self) -> str:
        return f"{self.entry}: {self.bad}"


def _everything(model: torch.nn.Module, opt: Any, grads: bool = True) -> list[torch.Tensor]:
    """Params, state, scale and trackers (``snapshot``), and every dense grad."""
    if not grads:
        return [t for t in snapshot(opt) if not t.is_meta]
    dense = [
        p.grad.detach().clone()
        for group in opt.param_groups
        for p in group["params"]
        if p.grad is not None and not p.is_meta and not p.grad.is_sparse
    ]
    return [t for t in snapshot(opt) if not t.is_meta] + dense


def assert_refused(refusal: Refusal, model: torch.nn.Module, opt: Any, name: str = "") -> None:
    """``refusal`` on ``opt`` over ``model``: the error and its words, nothing changed, and,
    repaired, the same call works."""
    refusal.prepare(model, opt)
    before = _everything(model, opt, refusal.grads_kept)
    where = f"{name}: {refusal}"
    with pytest.raises(refusal.error) as raised:
        refusal.call(model, opt)
    message = str(raised.value)
    for words in refusal.words:
        assert re.search(words, message), f"{where}: {words!r} not in the message: {message}"
    if refusal.repair is not None:
        refusal.repair(model, opt)
    assert_bit_identical(before, _everything(model, opt, refusal.grads_kept))
    if refusal.repair is not None:
        params = [p.detach().clone() for p in model.parameters()]
        (refusal.again or refusal.call)(model, opt)  # usable again: the same call now works
        if refusal.entry == "unscale":
            opt.step_after_unscale()
        assert any(not torch.equal(b, p) for b, p in zip(params, model.parameters())), where

