"""MkDocs hook: the reference of the built-in plugins, generated from what the core registers.

``docs/reference/plugins.md`` holds the prose and a marker; at build time the marker becomes,
per plugin kind, one mkdocstrings block per registered built-in plugin (its class and
docstring), so a plugin added to ``BUILTIN_PLUGINS`` is on the page at the next build.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tierstore.plugin.host import KINDS

# The hook's own directory is on sys.path while MkDocs imports it, not when a test does.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from builtin_host import builtin_registrations  # noqa: E402

__all__ = ["MARKER", "render", "on_page_markdown"]

#: what the page holds where the generated blocks go
MARKER = "<!-- builtin-plugins -->"

#: headings of the kinds, in the order of ``KINDS``
HEADINGS = {"backend": "Backends", "commit": "Commit protocols", "codec": "Codecs",
            "staging": "Staging", "replication": "Replication strategies"}


def render() -> str:
    """The generated part of the page: a section per kind, a block per plugin."""
    lines: list[str] = []
    for kind, registrations in builtin_registrations().items():
        lines += [f"## {HEADINGS.get(kind, kind.capitalize())}", ""]
        for reg in registrations:
            factory = reg.factory
            path = f"{factory.__module__}.{factory.__qualname__}"
            lines += [f"### `{reg.name}`", "",
                      f"Registered as {KINDS[kind].name} `{reg.name}` by `{reg.plugin}`.", "",
                      f"::: {path}",
                      "    options:",
                      "      heading_level: 4",
                      "      show_root_full_path: false",
                      "      show_bases: true", ""]
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """MkDocs event: put the generated blocks in place of :data:`MARKER`."""
    if page.file.src_uri != "reference/plugins.md":
        return markdown
    if MARKER not in markdown:
        raise RuntimeError(f"docs/reference/plugins.md lost its marker {MARKER}")
    return markdown.replace(MARKER, render())
