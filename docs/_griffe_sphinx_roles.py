"""A griffe extension that reads aiolease's Sphinx-flavoured docstrings for mkdocstrings.

* The docstrings use ``:class:`Lease``` and friends (they read well in the source
  and in ``help()``). mkdocstrings renders Markdown, so each role becomes an
  optional autoref: a link when the target is documented, plain code otherwise.
  Names are resolved in the scope of the object whose docstring holds them.
* Attributes are documented Sphinx-style by ``#:`` comments just above them
  (enum members, class variables); griffe ignores those, so they become the
  attributes' docstrings.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|meth|attr|mod|func|exc|data|obj):`(?P<target>[^`]+)`")


def _lookup(scope: griffe.Object | griffe.Alias, head: str) -> str | None:
    if head in scope.members:
        member = scope.members[head]
        return member.target_path if isinstance(member, griffe.Alias) else member.path
    if scope.is_module and head in scope.imports:
        return scope.imports[head]
    return None


def resolve(obj: griffe.Object | griffe.Alias, target: str) -> str:
    """The full path of ``target`` as seen from ``obj``'s scope (``target`` if unknown).

    :param obj: the object whose docstring mentions ``target``
    :param target: a dotted name, possibly relative (``Lease.renew``, ``token``)
    """
    head, _, rest = target.partition(".")
    scope: griffe.Object | griffe.Alias | None = obj
    while scope is not None:
        base = _lookup(scope, head)
        if base is not None:
            return f"{base}.{rest}" if rest else base
        scope = scope.parent
    return target


def rewrite(obj: griffe.Object | griffe.Alias, text: str) -> str:
    """Replace every Sphinx role in ``text`` with an optional autoref.

    :param obj: the object the docstring belongs to
    :param text: the docstring
    """

    def replace(match: re.Match[str]) -> str:
        raw = match["target"].strip()
        short = raw.startswith("~")
        target = raw.lstrip("~.")
        title = target.rpartition(".")[2] if short else target
        path = html.escape(resolve(obj, target), quote=True)
        return f'<autoref identifier="{path}" optional><code>{html.escape(title)}</code></autoref>'

    return _ROLE.sub(replace, text)


def comment_doc(obj: griffe.Object) -> str | None:
    """The ``#:`` comment lines right above an attribute, joined, or ``None``.

    :param obj: an attribute
    """
    if obj.lineno is None or obj.filepath is None or isinstance(obj.filepath, list):
        return None
    if obj.filepath not in obj.lines_collection:
        return None
    lines = obj.lines_collection[obj.filepath]
    found: list[str] = []
    index = obj.lineno - 2  # lineno is 1-based; start at the line above
    while index >= 0 and lines[index].strip().startswith("#:"):
        found.insert(0, lines[index].strip()[2:].strip())
        index -= 1
    return " ".join(found) or None


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring of a loaded package (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Walk the package once it is loaded.

        :param pkg: the loaded package
        :param kwargs: other arguments griffe passes
        """
        self._walk(pkg)

    def _walk(self, obj: griffe.Object) -> None:
        if obj.is_attribute and obj.docstring is None and (text := comment_doc(obj)):
            obj.docstring = griffe.Docstring(text, parent=obj)
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj, obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias and isinstance(member, griffe.Object):
                self._walk(member)
