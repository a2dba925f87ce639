"""docs/optimizer_pages.py, the mkdocs hook that derives the optimizers' pages, loaded from its
file (the docs folder is no package) for the tests that check what it derives."""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[2]


def optimizer_pages_hook() -> ModuleType:
    """The hook module, executed anew."""
    path = ROOT / "docs" / "optimizer_pages.py"
    spec = importlib.util.spec_from_file_location("optimizer_pages", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
