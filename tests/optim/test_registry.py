"""An optimizer declared once (scaledoptim/optim/spec.py, Note [an optimizer declared once]):
every optimizer module in scaledoptim/optim/ registers a spec, and every derivation from the
specs reaches it (the package's exports, a row of optim_db, a docs page in the nav and on the
lists), so that forgetting a step of docs/kernels.md's "Adding an optimizer" fails here."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import pathlib
import pkgutil

import pytest
import torch

import scaledoptim
import scaledoptim.optim
from scaledoptim.fused import FusedOptimizer
from scaledoptim.kernels import ROUNDING_LISTS
from scaledoptim.optim.spec import registered
from scaledoptim.testing.optim_db import optim_db
from tests.support.optimizer_pages import optimizer_pages_hook

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _optimizers_defined_in_optim() -> list[type]:
    """Every optimizer class defined in a module of scaledoptim/optim/ (importing each)."""
    found = []
    for info in pkgutil.iter_modules(scaledoptim.optim.__path__):
        module = importlib.import_module(f"scaledoptim.optim.{info.name}")
        found += [
            value for value in vars(module).values()
            if isinstance(value, type) and issubclass(value, torch.optim.Optimizer)
            and value.__module__ == module.__name__ and not value.__name__.startswith("_")
        ]
    return found


def test_every_optimizer_of_the_package_is_registered_and_exported() -> None:
    classes = _optimizers_defined_in_optim()
    specs = registered()
    assert {spec.cls for spec in specs} >= set(classes) and classes
    names = [spec.name for spec in specs]
    assert len(names) == len(set(names)), names
    assert list(scaledoptim.optim.__all__) == names
    for spec in specs:
        assert getattr(scaledoptim, spec.name) is spec.cls, f"scaledoptim does not export {spec}"
        assert spec.name in scaledoptim.__all__


def test_every_registered_optimizer_has_its_row() -> None:
    by_name = {info.name: info for info in optim_db}
    assert list(by_name) == [spec.name for spec in registered()]
    for spec in registered():
        info = by_name[spec.name]
        assert info.cls is spec.cls and info.reference is spec.reference
        assert info.configs[: len(spec.configs)] == spec.configs
        assert all(refusal in info.error_inputs for refusal in spec.refusals)


@pytest.mark.parametrize("spec", registered(), ids=lambda spec: spec.name)
def test_every_registered_optimizer_has_its_page_in_the_nav_and_the_lists(spec) -> None:
    page = ROOT / "docs" / "api" / f"{spec.page}.md"
    assert page.is_file(), f"write docs/api/{spec.page}.md (docs/kernels.md, the five files)"
    assert f"::: scaledoptim.{spec.name}\n" in page.read_text()
    hook = optimizer_pages_hook()
    nav = hook.on_config({"nav": [{"API reference": [{"The loss-scaling protocol": "p.md"}]}]})
    assert {spec.name: f"api/{spec.page}.md"} in nav["nav"][0]["API reference"]
    assert f"[{spec.name}]({spec.page}.md): {spec.summary}." in hook.fill(
        "api/index.md", hook.LIST
    )
    assert f"[{spec.name}](api/{spec.page}.md)" in hook.fill("index.md", hook.LINKS)


def test_the_nav_and_the_lists_name_no_optimizer_page_by_hand() -> None:
    """They are derived: a hand-kept entry would list a page twice, or outlive its optimizer."""
    pages = [f"api/{spec.page}.md" for spec in registered()]
    assert not [page for page in pages if page in (ROOT / "mkdocs.yml").read_text()]
    for path, marker in (("docs/api/index.md", "<!-- optimizers -->"),
                         ("docs/index.md", "<!-- optimizer links -->")):
        text = (ROOT / path).read_text()
        assert marker in text
        assert not [spec.name for spec in registered() if f"({spec.page}.md)" in text], path


@pytest.mark.parametrize(
    "spec", [s for s in registered() if s.options is not None], ids=lambda spec: spec.name
)
def test_the_declared_defaults_are_the_constructors(spec) -> None:
    signature = inspect.signature(spec.cls.__init__).parameters
    fields = dataclasses.fields(spec.options)
    compared = [f for f in fields if f.name in signature]
    assert compared
    for field in compared:
        assert field.default == signature[field.name].default, (spec.name, field.name)
    made = spec.cls([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]
    assert all(made[field.name] == field.default for field in compared), spec.name


@pytest.mark.parametrize("spec", registered(), ids=lambda spec: spec.name)
def test_rounds_is_what_the_kernel_takes(spec) -> None:
    cls = spec.cls
    if issubclass(cls, FusedOptimizer):
        assert cls.rounds == (cls.kernel.lists[-3:-1] == ROUNDING_LISTS)


def test_a_rounds_flag_its_kernel_contradicts_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"declares rounds = False.*declare rounds = True"):

        class Unflagged(FusedOptimizer):  # a kernel with the rounding lists
            kernel = scaledoptim.SGD.kernel

    with pytest.raises(TypeError, match=r"declares rounds = True.*declare rounds = False"):

        class Flagged(FusedOptimizer):  # the kernel of LAMB's grad norm: no rounding lists
            kernel = scaledoptim.optim.lamb.LAMB_GRAD_NORM_KERNEL
            rounds = True
