"""mkdocs hook: the API reference's optimizer pages, derived from the registered optimizers
(``scaledoptim.optim.spec.registered``, Note [an optimizer declared once]): one nav entry each,
after the protocol's page; their list with each spec's ``summary`` on ``api/index.md`` (its
``<!-- optimizers -->`` line), and their links on ``index.md`` (its ``<!-- optimizer links -->``).
A registered optimizer without its page fails the strict build."""

from __future__ import annotations

import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIST, LINKS = "<!-- optimizers -->", "<!-- optimizer links -->"
SECTION, AFTER = "API reference", "The loss-scaling protocol"


def _specs() -> tuple[Any, ...]:
    if str(ROOT) not in sys.path:  # this checkout's package, not an installed one
        sys.path.insert(0, str(ROOT))
    import scaledoptim.optim  # noqa: F401  (registers every spec)
    from scaledoptim.optim.spec import registered

    return registered()


def nav_entries() -> list[dict[str, str]]:
    """The nav entry of each registered optimizer's page."""
    return [{spec.name: f"api/{spec.page}.md"} for spec in _specs()]


def fill(src_uri: str, markdown: str) -> str:
    """``markdown`` of the page ``src_uri`` with its marker replaced: the list of the
    optimizers' pages (``api/index.md``), or their links (``index.md``)."""
    specs = _specs()
    if src_uri == "api/index.md":
        listed = "\n".join(f"  - [{s.name}]({s.page}.md): {s.summary}." for s in specs)
        return markdown.replace(LIST, listed)
    if src_uri == "index.md":
        return markdown.replace(LINKS, ", ".join(f"[{s.name}](api/{s.page}.md)" for s in specs))
    return markdown


def on_config(config: Any) -> Any:
    for section in config["nav"]:
        if isinstance(section, dict) and SECTION in section:
            pages = section[SECTION]
            at = next(i for i, entry in enumerate(pages) if AFTER in entry) + 1
            pages[at:at] = nav_entries()
    return config


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    return fill(page.file.src_uri, markdown)
