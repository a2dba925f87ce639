"""The doctor's output: the environment and the results as text, and the same as JSON."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections.abc import Sequence
from typing import Any

from .checks import CheckResult

__all__ = ["as_json", "environment_text", "result_line", "summary_line", "table_header"]

_MARKS = {"pass": "PASS", "fail": "FAIL", "skip": "skip"}
_NAME_WIDTH = 16
_DETAIL_WIDTH = 100


def environment_text(env: dict[str, str]) -> str:
    """One ``name: value`` line per entry, aligned."""
    width = max(map(len, env))
    return "\n".join(f"{name:<{width}}  {value}" for name, value in env.items())


def table_header() -> str:
    """The table's column titles and rule."""
    title = f"{'check':<{_NAME_WIDTH}}  result  {'time':>6}  detail"
    return f"{title}\n{'-' * (_NAME_WIDTH + 18 + 40)}"


def result_line(result: CheckResult) -> str:
    """A result as table row(s): the detail wraps under its column."""
    indent = " " * (_NAME_WIDTH + 18)
    detail = textwrap.fill(
        result.detail, _DETAIL_WIDTH, initial_indent=indent, subsequent_indent=indent
    ).lstrip()
    return (
        f"{result.name:<{_NAME_WIDTH}}  {_MARKS[result.status]:<6}  "
        f"{result.seconds:>5.1f}s  {detail}"
    )


def summary_line(results: Sequence[CheckResult]) -> str:
    """``N passed, M failed (names), K skipped``."""
    failed = [r.name for r in results if r.status == "fail"]
    counts = {s: sum(r.status == s for r in results) for s in _MARKS}
    line = f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped"
    return line + (f"; FAILED: {', '.join(failed)}" if failed else "")


def as_json(env: dict[str, str], results: Sequence[CheckResult]) -> str:
    """The report as JSON: ``{"environment": {...}, "checks": [{name, description, status,
    detail, seconds}], "passed"}``."""
    document: dict[str, Any] = {
        "environment": env,
        "checks": [dataclasses.asdict(r) for r in results],
        "passed": not any(r.status == "fail" for r in results),
    }
    return json.dumps(document, indent=2) + "\n"
