"""Griffe extension: render PyTorch-style docstrings with mkdocstrings.

Docstring convention of scaledoptim ("PyTorch style"): Google sections (``Args:``,
``Returns:``, ``Raises:``) for structure, plus the reST that PyTorch's own docstrings use:

* cross-reference roles ``:class:`X```, ``:meth:``, ``:func:``, ``:attr:``, ``:mod:``,
  ``:data:``, ``:exc:`` (``:obj:``, ``:const:`` too). ``~X.y`` shows only ``y``;
  ``title <X>`` shows ``title``; ``!X`` shows ``X`` without a link. A relative name is
  looked up as Sphinx does: the enclosing class first (``:meth:`unscale``` inside
  ``Optimizer`` is ``Optimizer.unscale``), then the module's names and imports, then the
  package's public names.
* ``Example::`` followed by an indented ``>>>`` block (any paragraph ending in ``::``
  introduces a literal block, rendered as a fenced code block).
* ``#:`` comments right above a module or class attribute are its docstring, and so is a
  string assigned to ``NAME.__doc__`` at module level (``LBFGS = with_scaling(...)``, then
  ``LBFGS.__doc__ = "..."``): griffe reads neither by itself.

mkdocstrings is configured with ``docstring_style: google``; this extension rewrites each
docstring of the loaded package into that dialect before it is parsed. Names inside the
package become required cross-references (``mkdocs build --strict`` fails when the target is
not rendered anywhere: document it, or write it as ``!X``). Names outside it (``torch.*``)
become optional ones: plain code today (no objects inventory of torch can be fetched in the
docs build), links as soon as one is configured under the handler's ``inventories``.
"""

from __future__ import annotations

import ast
import html
import re
from typing import Any

import griffe

_ROLE = re.compile(
    r":(?:py:)?(?P<role>meth|func|class|attr|mod|data|exc|obj|const):`(?P<body>[^`]+)`"
)
_EXPLICIT_TITLE = re.compile(r"(?P<title>.*?)\s*<(?P<target>[^<>]+)>", re.DOTALL)
_CALLABLE_ROLES = frozenset({"meth", "func"})
_FENCE = re.compile(r"^\s*(```|~~~)")
_GOOGLE_ITEM = re.compile(r"\s+\*{0,2}[\w.]+(\s*\([^)]*\))?:(\s|$)")
_EXAMPLE_TITLES = frozenset({"Example::", "Examples::"})
# What griffe raises when a name leads outside the loaded packages (e.g. into torch).
_LOOKUP_ERRORS = (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _convert_literal_blocks(text: str) -> list[tuple[bool, str]]:
    """Split a docstring into (is_code, text) chunks, turning reST literal blocks into
    Markdown: a top-level ``Example::`` + indented block becomes a Google ``Example:``
    section holding a fenced code block (``pycon`` when it is a ``>>>`` session, else
    ``python``); any other ``para::`` + block becomes ``para:`` + a fenced block at the
    paragraph's indentation."""
    lines = text.split("\n")
    chunks: list[tuple[bool, str]] = []
    prose: list[str] = []
    i = 0
    in_fence = False
    while i < len(lines):
        line = lines[i]
        if _FENCE.match(line):
            # Already Markdown code: keep it verbatim, roles inside are not rewritten.
            if prose and not in_fence:
                chunks.append((False, "\n".join(prose)))
                prose = []
            in_fence = not in_fence
            chunks.append((True, line))
            i += 1
            continue
        if in_fence or not line.rstrip().endswith("::"):
            chunks.append((True, line)) if in_fence else prose.append(line)
            i += 1
            continue
        base = _indent(line)
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines) or _indent(lines[j]) <= base:
            prose.append(line)  # "::" with no indented block after it: leave it alone
            i += 1
            continue
        end = j
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > base):
            end += 1
        while not lines[end - 1].strip():
            end -= 1
        block = lines[j:end]
        block_indent = min(_indent(b) for b in block if b.strip())
        body = [b[block_indent:] if b.strip() else "" for b in block]
        head = line.strip()
        if head in _EXAMPLE_TITLES and base == 0:
            # A Google "Example:" section (an admonition), its body a fenced block.
            prose.append("Example:")
            pad = " " * 4
        else:
            head_line = line.rstrip()[:-1]  # "para::" -> "para:" ("::" alone -> "")
            if head_line.strip():
                prose.append(head_line)
            prose.append("")
            # Inside a Google section, a block after "name: text::" belongs to that item's
            # description, which continues one level deeper than the item line.
            pad = " " * (base + 4 if base and _GOOGLE_ITEM.match(line) else base)
        chunks.append((False, "\n".join(prose)))
        prose = []
        code = [f"{pad}```{'pycon' if body[0].startswith('>>>') else 'python'}"]
        code += [pad + b if b else "" for b in body]
        code.append(f"{pad}```")
        chunks.append((True, "\n".join(code)))
        i = end
    if prose:
        chunks.append((False, "\n".join(prose)))
    return chunks


class PyTorchDocstrings(griffe.Extension):
    """Rewrites the PyTorch-style docstrings of every loaded package (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for obj in self._objects(pkg):
            if obj.is_module:
                self._attach_doc_assignments(obj, loader)
            if obj.docstring is None and obj.is_attribute:
                self._attach_doc_comment(obj, loader)
            if obj.docstring is not None:
                obj.docstring.value = self._rewrite(obj.docstring.value, obj, pkg)

    def _objects(self, obj: griffe.Object):
        yield obj
        for member in obj.members.values():
            if not member.is_alias:
                yield from self._objects(member)

    def _attach_doc_assignments(self, mod: griffe.Module, loader: griffe.GriffeLoader) -> None:
        """Module-level ``NAME.__doc__ = "..."`` becomes the docstring of ``NAME``."""
        if mod.filepath is None or isinstance(mod.filepath, list):
            return
        try:
            tree = ast.parse("\n".join(mod.lines_collection[mod.filepath]))
        except (KeyError, SyntaxError):
            return
        for node in tree.body:
            if not (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(target := node.targets[0], ast.Attribute)
                and target.attr == "__doc__"
                and isinstance(target.value, ast.Name)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                continue
            member = mod.members.get(target.value.id)
            if member is not None and not member.is_alias and member.docstring is None:
                member.docstring = _docstring(
                    node.value.value, node.lineno, node.end_lineno, member, loader
                )

    def _attach_doc_comment(self, attr: griffe.Object, loader: griffe.GriffeLoader) -> None:
        """Sphinx's ``#:`` attribute doc-comments, which griffe does not read itself."""
        if attr.lineno is None or attr.filepath is None:
            return
        try:
            source = attr.lines_collection[attr.filepath]
        except KeyError:
            return
        comment: list[str] = []
        i = attr.lineno - 2
        while i >= 0 and source[i].lstrip().startswith("#:"):
            comment.insert(0, source[i].lstrip()[2:].removeprefix(" "))
            i -= 1
        if comment:
            attr.docstring = _docstring("\n".join(comment), i + 2, attr.lineno - 1, attr, loader)

    def _rewrite(self, text: str, obj: griffe.Object, pkg: griffe.Module) -> str:
        out = []
        for is_code, chunk in _convert_literal_blocks(text):
            if not is_code:
                chunk = _ROLE.sub(lambda m: self._reference(m["role"], m["body"], obj, pkg), chunk)
            out.append(chunk)
        return "\n".join(out)

    def _reference(self, role: str, body: str, obj: griffe.Object, pkg: griffe.Module) -> str:
        body = " ".join(body.split())
        explicit = _EXPLICIT_TITLE.fullmatch(body)
        target = explicit["target"] if explicit else body
        link = not target.startswith("!")
        target = target.lstrip("!.")
        short = target.startswith("~")
        target = target.lstrip("~").removesuffix("()")
        if explicit and explicit["title"]:
            title = explicit["title"]
        else:
            title = target.rsplit(".", 1)[-1] if short else target
            if role in _CALLABLE_ROLES:
                title += "()"
        code = f"`{title}`"
        if not link:
            return code
        internal, identifier = self._lookup(target, obj, pkg)
        if internal:
            return f"[{code}][{identifier}]"
        # Optional: rendered as plain code unless an inventory (e.g. torch's) knows it.
        return f'<autoref identifier="{html.escape(identifier)}" optional>{code}</autoref>'

    def _lookup(self, name: str, obj: griffe.Object, pkg: griffe.Module) -> tuple[bool, str]:
        """(True, path of the documented object) for a name inside the package, else
        (False, the best absolute name for it)."""
        parts = name.split(".")
        scopes: list[tuple[griffe.Object, list[str]]] = []
        scope: griffe.Object | None = obj if (obj.is_class or obj.is_module) else obj.parent
        while scope is not None:
            scopes.append((scope, parts))
            scope = scope.parent
        if parts[0] == pkg.name and len(parts) > 1:
            scopes.append((pkg, parts[1:]))
        for scope, relative in scopes:
            found = _walk(scope, relative)
            if found is not None:
                return found
        if len(parts) == 1 or parts[0] == pkg.name:
            # Not found, yet it names something of ours: a required reference, so that
            # ``mkdocs build --strict`` reports the typo instead of rendering plain code.
            return True, name
        return False, name


def _docstring(
    value: str,
    lineno: int,
    endlineno: int | None,
    parent: griffe.Object,
    loader: griffe.GriffeLoader,
) -> griffe.Docstring:
    """A docstring found in the source, parsed like the ones griffe finds itself."""
    return griffe.Docstring(
        value,
        lineno=lineno,
        endlineno=endlineno,
        parent=parent,
        parser=loader.docstring_parser,
        parser_options=loader.docstring_options,
    )


def _walk(scope: griffe.Object, parts: list[str]) -> tuple[bool, str] | None:
    """Follows ``parts`` through members (a class's inherited ones too) from ``scope``."""
    current: griffe.Object | griffe.Alias = scope
    for k, part in enumerate(parts):
        try:
            if current.is_alias:
                current = current.final_target
            members = current.all_members if current.is_class else current.members
        except _LOOKUP_ERRORS:  # an import from outside the package (torch): name it so
            return False, ".".join([current.target_path, *parts[k:]])
        if part not in members:
            return None
        current = members[part]
    try:
        target = current.final_target if current.is_alias else current
    except _LOOKUP_ERRORS:
        return False, current.target_path
    return True, target.path
