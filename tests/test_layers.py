"""The package's layers only point down, so no import order is load-bearing.

* Every module imports first in a fresh interpreter, with the top-level ``__init__`` out of the
  way (a stub package with the real ``__path__``), so nothing it imported earlier can hide a
  cycle.
* ``scaledoptim/__init__.py`` imports with its import lines reversed, and shuffled.
* Statically, from every module's imports (in functions and ``TYPE_CHECKING`` blocks too): each
  layer imports only itself and the layers below it, and the modules inside one layer import
  each other without a cycle (a cycle closed by a function-level import is one too: it only
  moves the failure from import time to call time).
"""

from __future__ import annotations

import ast
import pathlib
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

import scaledoptim

PACKAGE = pathlib.Path(scaledoptim.__file__).parent

#: Each layer and what it may import besides itself (torch and the standard library always).
#: The fused engine never imports optim/, the protocol never imports the engine, the scale and
#: the kernels know no optimizer, and torch_ops imports only torch.
LAYERS: dict[str, set[str]] = {
    "compile_boundary": set(),
    "torch_ops": set(),
    "kernels": set(),
    "amp": set(),
    "scale": {"torch_ops"},
    "protocol": {"torch_ops", "scale"},
    "fused": {"torch_ops", "scale", "protocol", "kernels"},
    "optim": {"torch_ops", "scale", "protocol", "kernels", "fused"},
}
#: Leaves every layer may import: they import only torch (Note [lazy compile boundary]).
LEAVES = {"compile_boundary"}


def _modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _import_targets(path: pathlib.Path, module: str) -> Iterator[tuple[str, list[str]]]:
    """Each import in ``path``, anywhere in it, as (the module imported or imported from, the
    names taken from it: none for a plain ``import``), relative imports resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, [alias.name for alias in node.names]


def _imported(path: pathlib.Path, module: str) -> set[str]:
    """Every scaledoptim module ``path`` imports, anywhere in it."""
    found = set()
    for target, names in _import_targets(path, module):
        if target.startswith("scaledoptim"):
            found |= {f"{target}.{name}" for name in names} | {target}
    return found


@pytest.mark.parametrize("module", [m for m in _modules() if _layer(m) in LAYERS], ids=str)
def test_each_layer_imports_only_itself_and_the_layers_below(module) -> None:
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE.parent / module.replace(".", "/") / "__init__.py"
    layer = _layer(module)
    allowed = LAYERS[layer] | {layer} | LEAVES
    wrong = sorted(
        target
        for target in _imported(path, module)
        if target != "scaledoptim" and _layer(target) not in allowed
    )
    assert not wrong, f"{module} ({layer}) imports {wrong}; it may import {sorted(allowed)}"


def _module_edges(path: pathlib.Path, module: str, known: set[str]) -> set[str]:
    """The scaledoptim modules ``path`` imports, anywhere in it: ``from .pkg import mod`` counts
    as an import of ``pkg.mod`` (not of ``pkg``'s ``__init__``) where ``mod`` is a module."""
    found = set()
    for target, names in _import_targets(path, module):
        found |= {f"{target}.{name}" if f"{target}.{name}" in known else target for name in names}
        if not names:
            found.add(target)
    return (found & known) - {module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one node (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _path_of(module: str) -> pathlib.Path:
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    return path if path.exists() else PACKAGE.parent / module.replace(".", "/") / "__init__.py"


@pytest.mark.parametrize("layer", sorted({_layer(m) for m in _modules()} - {None}), ids=str)
def test_the_modules_inside_each_layer_import_each_other_without_a_cycle(layer) -> None:
    inside = {m for m in _modules() if _layer(m) == layer}
    graph = {m: _module_edges(_path_of(m), m, inside) for m in inside}
    cycles = _cycles(graph)
    assert not cycles, (
        f"the modules of {layer}/ import each other in a cycle: {cycles}; move what they share "
        "down into a module both import, or pass the dependency in (a callable or a registry)"
    )


# Forked from one process that imported torch and the optional packages (their import time is
# not ours to test): each child imports one scaledoptim module first.
_IMPORT_EACH_FIRST = textwrap.dedent(
    """
    import importlib, os, sys, traceback, types
    import torch
    for optional in ("torch._dynamo", "lightning.pytorch", "accelerate", "transformers",
                     "matplotlib.pyplot", "tqdm", "cupy"):
        try:
            importlib.import_module(optional)
        except ImportError:
            pass
    path, modules = sys.argv[1], sys.argv[2:]
    failures = 0
    for module in modules:
        pid = os.fork()
        if pid == 0:
            stub = types.ModuleType("scaledoptim")
            stub.__path__ = [path]
            sys.modules["scaledoptim"] = stub
            try:
                importlib.import_module(module)
            except BaseException:
                print(f"--- {module} cannot be imported first:")
                traceback.print_exc()
                sys.stdout.flush()
                os._exit(1)
            os._exit(0)
        failures += os.waitpid(pid, 0)[1] != 0
    sys.exit(1 if failures else 0)
    """
)


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    """Slow (a fresh import of the package per module). Exists for a module that imports only after
    another one did (an import cycle, a name read at import time): the suite imports them in one
    order and never sees it."""
    modules = [m for m in _modules() if m != "scaledoptim"]
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH_FIRST, str(PACKAGE), *modules],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr


_EXEC_INIT = textwrap.dedent(
    """
    import sys, types
    path, source = sys.argv[1], sys.stdin.read()
    package = types.ModuleType("scaledoptim")
    package.__path__ = [path]
    package.__file__ = path + "/__init__.py"
    sys.modules["scaledoptim"] = package
    exec(compile(source, package.__file__, "exec"), package.__dict__)
    missing = [name for name in package.__all__ if not hasattr(package, name)]
    assert not missing, missing
    """
)


def _init_with_import_order(order: str) -> str:
    """``scaledoptim/__init__.py`` with its import statements reversed, or shuffled."""
    source = (PACKAGE / "__init__.py").read_text()
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    texts = ["".join(lines[node.lineno - 1 : node.end_lineno]) for node in imports]
    reordered = (
        texts[::-1] if order == "reversed" else random.Random(order).sample(texts, len(texts))
    )
    first, last = imports[0].lineno - 1, imports[-1].end_lineno
    return "".join(lines[:first]) + "".join(reordered) + "".join(lines[last:])


@pytest.mark.parametrize("order", ["reversed", "shuffled-1", "shuffled-2"])
def test_init_imports_in_any_order(order) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _EXEC_INIT, str(PACKAGE)],
        input=_init_with_import_order(order),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_formatter_markers() -> None:
    """CI runs no formatter (ruff check enforces the 100 columns), so a formatter's skip or off
    comment would only be noise."""
    root = pathlib.Path(__file__).resolve().parents[1]
    marked = [
        f"{path.relative_to(root)}:{number}"
        for folder in ("scaledoptim", "tests", "benchmarks")
        for path in sorted((root / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "# fmt: " + "skip" in line or "# fmt: " + "off" in line
    ]
    assert not marked, marked
