"""scaledoptim is not on PyPI: every install hint (error messages, docs, README) names the form
that works from a checkout, ``pip install -e ".[extra]"``, next to the form that works where
scaledoptim was installed from a wheel, ``pip install "scaledoptim[extra]"``."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ("README.md", "CHANGELOG.md", "docs", "scaledoptim", "benchmarks", "tests")
WHEEL_FORM = re.compile(r"scaledoptim\[([\w-]+)\]")
NEAR = 300  # characters either side: the same message or paragraph


def _texts():
    for entry in SCANNED:
        path = ROOT / entry
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        for file in files:
            if file.suffix in (".py", ".md") and file != pathlib.Path(__file__).resolve():
                yield file, file.read_text(encoding="utf-8")


def test_every_wheel_form_hint_has_the_checkout_form_beside_it() -> None:
    found, missing = 0, []
    for file, text in _texts():
        for match in WHEEL_FORM.finditer(text):
            found += 1
            window = text[max(0, match.start() - NEAR) : match.end() + NEAR]
            if f'".[{match.group(1)}]"' not in window:
                line = text.count("\n", 0, match.start()) + 1
                missing.append(f"{file.relative_to(ROOT)}:{line}: {match.group(0)}")
    assert found >= 8, found  # the scan sees the hints (messages, docs, the README)
    assert not missing, 'hints without pip install -e ".[extra]" nearby:\n' + "\n".join(missing)


def test_no_hint_says_pip_install_scaledoptim_as_if_it_were_on_pypi_alone() -> None:
    bare = re.compile(r"pip install '?scaledoptim\[")  # the old form: no checkout form, quotes
    offenders = [
        f"{file.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
        for file, text in _texts()
        for m in bare.finditer(text)
    ]
    assert not offenders, offenders
