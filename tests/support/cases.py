"""Many cheap, alike cases in one collected test: every case runs, and the test fails once,
naming each failing case with its message and line (what a parametrization would report, for
one item instead of one per case).

::

    cases = Cases()
    for cls in CLASSES:
        with cases.case(f"{cls.__name__}"):
            ...  # asserts, pytest.raises
    cases.assert_all_passed()
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator

import pytest

__all__ = ["Cases"]


class Cases:
    """Collects the failures of the cases run under :meth:`case`."""

    def __init__(self) -> None:
        self.ran = 0
        self.failures: list[str] = []

    @contextlib.contextmanager
    def case(self, name: str) -> Iterator[None]:
        """Runs the block as the case ``name``: a failure (an assert, a ``pytest.raises`` that saw
        nothing, any exception) is recorded and the next case runs; a skip still skips."""
        self.ran += 1
        try:
            yield
        except (Exception, pytest.fail.Exception) as error:
            # The innermost line of the test's own file (its block, or a helper it calls).
            tb = traceback.extract_tb(error.__traceback__)
            frames = [f for f in tb if f.filename != __file__]
            where = next((f for f in reversed(frames) if f.filename == frames[0].filename), None)
            message = "".join(traceback.format_exception_only(type(error), error)).strip()
            line = f" (line {where.lineno})" if where else ""
            self.failures.append(f"[{name}]{line} {message}")

    def assert_all_passed(self) -> None:
        """Fails naming every failing case; fails too when no case ran (an empty loop is no
        check)."""
        assert self.ran, "no case ran"
        assert not self.failures, f"{len(self.failures)} of {self.ran} cases failed:\n" + (
            "\n".join(self.failures)
        )
