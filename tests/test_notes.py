"""The source Notes (PyTorch's convention, shared by the Python and the CUDA sources): each one
has a single heading, a line with the Note's name over a ``~`` underline of the same length, in
a comment or a docstring; every other mention names a Note that has one, and where it says the
file (``... in fused/plan.py``), that is the file holding the heading. A mention that opens a
comment, a docstring or a sentence reads "See Note [...]", so that it is never taken for the
definition.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("scaledoptim", "cuda", "tests", "benchmarks")
SUFFIXES = {".py", ".cu", ".cuh", ".h"}

# A comment marker or docstring opening a mention may wrap after: ``#``, ``#:``, ``//``, ``*``.
_PREFIX = re.compile(r'^\s*(?:#:?|//|\*|""")?\s*')
_NAME = r"\[([^\]]+)\]"
_HEADING = re.compile(r"^Note " + _NAME + r"$")
_COMMENT = re.compile(r"\s*(?:#|//)")
_MENTION = re.compile(r"Note\s+" + _NAME + r"(\)?\s+in\s+(?:``)?([\w./]+\.(?:py|cuh?|h))\b)?")


@dataclass(frozen=True)
class Place:
    path: str  # relative to the repository root
    line: int
    module_docstring: bool = False


@dataclass
class Notes:
    headings: dict[str, list[Place]]
    mentions: dict[str, list[tuple[Place, str | None]]]  # the file a mention names, if any
    bad_underlines: list[Place]
    bare: list[Place]  # mentions opening a comment, docstring or sentence without "See"


def _name(raw: str) -> str:
    # A mention may wrap inside a comment, or inside implicitly concatenated string literals.
    return " ".join(raw.replace('"', " ").split())


def _module_docstring_end(path: Path, lines: list[str]) -> int:
    """The last line of a Python module's docstring (0 when it has none)."""
    if path.suffix != ".py" or not lines or not lines[0].startswith(('"""', 'r"""')):
        return 0
    for index, line in enumerate(lines):
        if line.rstrip().endswith('"""') and (index > 0 or line.count('"""') == 2):
            return index + 1
    return 0


def scan(root: Path = ROOT) -> Notes:
    headings: dict[str, list[Place]] = collections.defaultdict(list)
    mentions: dict[str, list[tuple[Place, str | None]]] = collections.defaultdict(list)
    bad: list[Place] = []
    bare: list[Place] = []
    for tree in TREES:
        for path in sorted((root / tree).rglob("*")):
            if path.suffix not in SUFFIXES or path == Path(__file__).resolve():
                continue
            relative = path.relative_to(root).as_posix()
            lines = path.read_text(encoding="utf-8").split("\n")
            docstring_end = _module_docstring_end(path, lines)
            texts = [_PREFIX.sub("", line).rstrip() for line in lines]
            starts, offset = [], 0
            for index, text in enumerate(texts):
                heading = _HEADING.match(text)
                underline = texts[index + 1] if index + 1 < len(texts) else ""
                if heading and set(underline) == {"~"}:
                    place = Place(relative, index + 1, index < docstring_end)
                    if len(underline) == len(text):
                        headings[heading.group(1)].append(place)
                    else:
                        bad.append(place)
                    texts[index] = ""  # a heading is not a mention of itself
                else:
                    bare.extend(_bare_mentions(relative, index, lines, texts))
                starts.append(offset)
                offset += len(texts[index]) + 1
            joined = "\n".join(texts)
            for match in _MENTION.finditer(joined):
                line = next(i for i in range(len(starts) - 1, -1, -1) if starts[i] <= match.start())
                mentions[_name(match.group(1))].append((Place(relative, line + 1), match.group(3)))
    return Notes(dict(headings), dict(mentions), bad, bare)


def _bare_mentions(path: str, index: int, lines: list[str], texts: list[str]) -> list[Place]:
    previous = texts[index - 1] if index else ""
    after_a_sentence = not previous or previous.endswith(".")
    in_a_comment = index > 0 and _COMMENT.match(lines[index - 1]) is not None
    found = []
    for match in re.finditer(r"Note \[", lines[index]):
        before = lines[index][: match.start()].rstrip()
        if before.endswith(("See", "see")):
            continue
        if before.endswith(("#", "#:", "//")):
            code = before.rstrip("#:/").strip()
            opens = bool(code) or not in_a_comment or after_a_sentence
        else:
            opens = before.endswith('"""') or re.search(r"[.!?]$", before) is not None
            opens = opens or (not before and after_a_sentence)
        if opens:
            found.append(Place(path, index + 1))
    return found


def test_every_note_has_one_heading_with_an_underline_of_its_length() -> None:
    notes = scan()
    bad = [f"{place.path}:{place.line}" for place in notes.bad_underlines]
    assert not bad, f"underline a Note's name with as many '~' as it has characters: {bad}"
    several = {name: places for name, places in notes.headings.items() if len(places) > 1}
    assert not several, f"one heading per Note; keep one and point the others to it: {several}"


def test_a_mention_that_opens_a_comment_or_sentence_says_see() -> None:
    bare = [f"{place.path}:{place.line}" for place in scan().bare]
    assert not bare, f"write 'See Note [...]' where a mention opens a comment or sentence: {bare}"


def test_every_mention_names_a_note_with_a_heading_in_the_file_it_names() -> None:
    notes = scan()
    missing = {
        name: [f"{place.path}:{place.line}" for place, _ in places]
        for name, places in notes.mentions.items()
        if name not in notes.headings
    }
    assert not missing, f"mentions of Notes without a heading: {missing}"
    elsewhere = [
        f"{place.path}:{place.line} says Note [{name}] is in {named}, it is in "
        f"{notes.headings[name][0].path}"
        for name, places in notes.mentions.items()
        for place, named in places
        if named is not None and not notes.headings[name][0].path.endswith(named)
    ]
    assert not elsewhere, elsewhere


def test_every_note_is_mentioned_or_opens_its_module() -> None:
    notes = scan()
    unread = [
        f"Note [{name}] at {places[0].path}:{places[0].line}"
        for name, places in notes.headings.items()
        if name not in notes.mentions and not places[0].module_docstring
    ]
    assert not unread, f"a Note nothing points to belongs in its module's docstring: {unread}"
