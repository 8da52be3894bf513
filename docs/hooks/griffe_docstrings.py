"""Griffe extension: read optclip's docstring conventions as Google-style sections.

* ``Example:`` (singular, the house style) is read as an ``Examples:`` section, so its doctest
  renders as code instead of Markdown;
* an ``Args:`` entry naming several parameters (``dim, inverse_dims, min_size: as in ...``) is
  split into one entry per parameter, each with the shared description;
* Sphinx roles (``:func:`zclip```, ``:class:`Criterion```) become cross-references to the API
  reference when they name a public ``optclip`` object, and inline code otherwise (a role's colon
  would otherwise also be read as the ``type:`` separator of a ``Returns:`` entry).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_GROUPED = re.compile(r"^(\s+)(\w+(?:\s*,\s*\w+)+):(.*)$")
_SECTION = re.compile(r"^\s*[A-Z][A-Za-z ]*:\s*$")
_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj|exc):`~?([\w.]+)`")


def _public_names() -> frozenset[str]:
    import optclip  # the checkout being documented (the api_reference hook puts it on sys.path)

    return frozenset(optclip.__all__)


def roles_to_markdown(text: str, public: frozenset[str]) -> str:
    def replace(match: re.Match) -> str:
        target = match[1]
        name = target.rsplit(".", 1)[-1]
        if name in public and target in (name, f"optclip.{name}"):
            return f"[`{target}`][optclip.{name}]"
        return f"`{target}`"

    return _ROLE.sub(replace, text)


def rewrite(text: str, public: frozenset[str] = frozenset()) -> str:
    lines = roles_to_markdown(text, public).splitlines()
    out: list[str] = []
    in_args = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if _SECTION.match(line):
            in_args = line.strip() in ("Args:", "Arguments:", "Parameters:")
            out.append(re.sub(r"Example:\s*$", "Examples:", line))
            i += 1
            continue
        grouped = _GROUPED.match(line) if in_args else None
        if grouped is None:
            out.append(line)
            i += 1
            continue
        indent, names, first = grouped.groups()
        body = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or
                                  len(lines[i]) - len(lines[i].lstrip()) > len(indent)):
            body.append(lines[i])
            i += 1
        for name in (n.strip() for n in names.split(",")):
            out.append(f"{indent}{name}:{first}")
            out.extend(body)
    return "\n".join(out)


class OptclipDocstrings(griffe.Extension):
    def __init__(self) -> None:
        super().__init__()
        self._public = _public_names()

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value, self._public)
