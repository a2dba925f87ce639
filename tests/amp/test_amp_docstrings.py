"""The docstring examples of scaledoptim.amp run as written (docs pages: tests/test_docs.py)."""

from __future__ import annotations

import doctest

import pytest

import scaledoptim.amp.activation_checkpoint
import scaledoptim.amp.context
import scaledoptim.amp.decorators
import scaledoptim.amp.registry


@pytest.mark.parametrize(
    "module",
    [
        scaledoptim.amp.activation_checkpoint,
        scaledoptim.amp.context,
        scaledoptim.amp.decorators,
        scaledoptim.amp.registry,
    ],
)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
