"""Every ```python block of every docs page runs as written, so the docs cannot rot."""

from __future__ import annotations

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
BLOCKS = [
    pytest.param(code, id=f"{page.relative_to(DOCS)}[{i}]")
    for page in sorted(DOCS.rglob("*.md"))
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))
]


@pytest.mark.parametrize("code", BLOCKS)
def test_docs_code_block_runs(code: str, request) -> None:
    exec(compile(code, request.node.callspec.id, "exec"), {"__name__": "docs"})
