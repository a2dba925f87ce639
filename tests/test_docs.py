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


# Columns of a code block that a 1280 px wide page shows whole, with both sidebars of the
# site's theme (82 in headless Chromium's monospace font; 2 to spare for other fonts).
CODE_COLUMNS = 80


def test_docs_code_blocks_fit_a_1280_px_page() -> None:
    too_wide = [
        f"{page.relative_to(DOCS)}: {line}"
        for page in sorted(DOCS.rglob("*.md"))
        for block in re.findall(r"^ *```[^\n]*\n(.*?)^ *```", page.read_text(), flags=re.S | re.M)
        for line in block.splitlines()
        if len(line) > CODE_COLUMNS
    ]
    assert not too_wide, "code lines a 1280 px page cuts (wrap them):\n" + "\n".join(too_wide)


README = DOCS.parent / "README.md"


def test_the_readme_claims_table_names_tests_that_exist() -> None:
    table = README.read_text().split("## Claims and the tests that check them")[1].split("\n## ")[0]
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", table)
    assert len(named) >= 8, table
    for path, name in named:
        source = (DOCS.parent / path).read_text()
        assert re.search(rf"^def {name}\(", source, flags=re.M), f"{path} has no {name}"
    assert "`.ci/wheel_smoke.sh`" in table and (DOCS.parent / ".ci" / "wheel_smoke.sh").exists()
