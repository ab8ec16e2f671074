"""A griffe extension: the docstrings' Sphinx markup, as Markdown.

The code's docstrings use Sphinx's inline roles (``:class:`Store```) and ``::`` before literal
blocks; mkdocstrings renders docstrings as Markdown, where both would show as typed. A role
becomes inline code (``~`` keeps the last part of the name, as in Sphinx) and a trailing ``::``
a colon; the indented block after it is already a Markdown code block.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

__all__ = ["SphinxRoles"]

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")
#: "text::" reads "text:"
_MARKER_AFTER_TEXT = re.compile(r"(\S)::[ \t]*$", re.MULTILINE)
#: "text ::" reads "text", and a "::" alone on its line goes away
_MARKER_ALONE = re.compile(r"[ \t]*::[ \t]*$", re.MULTILINE)


def _role(match: re.Match) -> str:
    name = match.group(2)
    return f"`{name.rsplit('.', 1)[-1] if match.group(1) else name}`"


def as_markdown(text: str) -> str:
    """``text`` with Sphinx roles as inline code and literal-block markers as colons."""
    text = _ROLE.sub(_role, text)
    return _MARKER_ALONE.sub("", _MARKER_AFTER_TEXT.sub(r"\1:", text))


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring with :func:`as_markdown` as its object is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = as_markdown(obj.docstring.value)
