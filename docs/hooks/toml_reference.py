"""MkDocs hook: the TOML reference page, generated from the config validator's own schema.

``docs/toml-reference.md`` holds the prose and a marker; at build time the marker becomes one
table per TOML table the validator checks: the top level, ``[store]`` and ``[[tier]]`` (the
``Option`` tuples of ``tierstore.config.validate``) and the keys every built-in plugin declares
(``Option`` objects on each registered class). A key added to the code is on the page at the
next build, and ``tests/test_docs.py`` checks that every key the validator accepts is there.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from tierstore.config import validate
from tierstore.plugin.host import KINDS
from tierstore.plugin.options import Option

# The hook's own directory is on sys.path while MkDocs imports it, not when a test does.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from builtin_host import builtin_registrations  # noqa: E402
from griffe_roles import as_markdown  # noqa: E402

__all__ = ["MARKER", "render", "on_page_markdown"]

#: what the page holds where the generated tables go
MARKER = "<!-- toml-reference -->"

#: the validator's tables of core keys: (name in validate.py, anchor, heading, what it is)
CORE_TABLES = (
    ("TOP_LEVEL_OPTIONS", "top-level", "Top level",
     "The file holds one `[store]` table and one `[[tier]]` table per tier; nothing else."),
    ("STORE_OPTIONS", "store", "`[store]`",
     "Store-wide settings. Every key is optional."),
    ("TIER_OPTIONS", "tier", "`[[tier]]`",
     "One table per tier, fastest first. Beside these core keys, a tier takes the keys of its "
     "backend (see [Backends](#backend)); a key that neither declares is a `ConfigError`."),
)

#: per plugin kind: (heading, the key that names the plugin inside its table or None, how a
#: config chooses one, an example)
KIND_USE = {
    "backend": ("Backends", None,
                "A tier's `backend` key chooses one; its keys go in the same `[[tier]]` table.",
                '[[tier]]\nname = "nvme"\nbackend = "local"\npath = "/local_nvme/ckpt/{node}"\n'
                'fsync = true'),
    "commit": ("Commit protocols", "name",
               "`[store] commit` chooses one for every tier (default: each backend's own), as a "
               "name or a table with `name` and the protocol's keys.",
               '[store]\ncommit = "atomic"'),
    "codec": ("Codecs", "name",
              "A tier's `codecs` list applies them in order; each entry is a name or a table "
              "with `name` and the codec's keys.",
              '[[tier]]\n# ...\ncodecs = [{ name = "zstd", level = 3 }]   # or just ["zstd"]'),
    "staging": ("Staging", "name",
                "`[store] staging` chooses one, as a name or a table with `name` and the "
                "plugin's keys (also written as a `[store.staging]` table).",
                '[store]\nstaging = { name = "cpu", lazy = true, max_staging_bytes = 4294967296 }'),
    "replication": ("Replication strategies", "strategy",
                    "The `replication` key of a tier whose backend holds peers' replicas "
                    "(`peer`) is a table: `strategy` names one, the other keys are the "
                    "strategy's.",
                    '[[tier]]\nname = "peer"\nbackend = "peer"\n'
                    'replication = { strategy = "clique", factor = 2, jump = 8 }'),
}


def _toml(value: Any) -> str:
    """``value`` as TOML writes it, for the default column."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_toml, value)) + "]"
    if isinstance(value, dict):
        inner = ", ".join(f"{k} = {_toml(v)}" for k, v in value.items())
        return "{ " + inner + " }" if inner else "{}"
    return str(value)


#: a TOML inline table or a placeholder in a description, not already inline code
_BRACES = re.compile(r"(?<!`)(\{[^{}`]*\})(?!`)")


def _cell(text: str) -> str:
    """``text`` safe inside a Markdown table cell: ``{ env = "NAME" }`` and ``{node}`` as
    inline code (attr_list would take a trailing one for HTML attributes)."""
    return _BRACES.sub(r"`\1`", text).replace("|", "\\|").replace("\n", " ")


def _default(opt: Option) -> str:
    if opt.required:
        return "required"
    if opt.default is None:
        return "unset"
    return f"`{_toml(opt.default)}`"


def _what(opt: Option) -> str:
    text = opt.description
    if opt.choices is not None:
        text += "; one of " + ", ".join(f"`{_toml(c)}`" for c in opt.choices)
    if opt.expand and "{node}" not in text:
        text += "; {rank}, {local_rank} and {node} are replaced per process"
    return _cell(text)


def _table(options: tuple[Option, ...], selector: tuple[str, str] | None = None) -> list[str]:
    """A Markdown table of ``options``; ``selector`` (key, value) first names the plugin."""
    rows = ["| key | type | default | what it is |", "| --- | --- | --- | --- |"]
    if selector is not None:
        key, value = selector
        rows.append(f"| `{key}` | string | required in a table | `{_toml(value)}` chooses "
                    f"this one |")
    for opt in options:
        rows.append(f"| `{opt.name}` | {_cell(opt.type_name())} | {_cell(_default(opt))} | "
                    f"{_what(opt)} |")
    return rows


def core_tables() -> dict[str, tuple[Option, ...]]:
    """Every module-level tuple of ``Option`` in the validator, by name. A new one fails the
    build until the page knows where it goes (:data:`CORE_TABLES`)."""
    found = {name: value for name, value in vars(validate).items()
             if isinstance(value, tuple) and value and all(isinstance(o, Option) for o in value)}
    unknown = sorted(set(found) - {name for name, *_ in CORE_TABLES})
    if unknown:
        raise RuntimeError(f"docs/hooks/toml_reference.py: the validator has tables {unknown} "
                           f"that the TOML reference does not place; add them to CORE_TABLES")
    return found


def render() -> str:
    """The generated part of the TOML reference page, as Markdown."""
    found = core_tables()
    lines: list[str] = []
    for name, anchor, heading, intro in CORE_TABLES:
        lines += [f"## {heading} {{#{anchor}}}", "", intro, "", *_table(found[name]), ""]
        if name == "STORE_OPTIONS" and validate.RENAMED_STORE_KEYS:
            lines += ["Former names, still read (with a `DeprecationWarning`) and taken as "
                      "the new key; setting both is a `ConfigError`:", ""]
            lines += [f"- `{old}`: now `{new}`"
                      for old, new in sorted(validate.RENAMED_STORE_KEYS.items())]
            lines.append("")
    registrations = builtin_registrations()
    missing = sorted(set(KINDS) - set(KIND_USE))
    if missing:
        raise RuntimeError(f"docs/hooks/toml_reference.py: plugin kinds {missing} have no "
                           f"section in the TOML reference; add them to KIND_USE")
    for kind in KINDS:
        heading, selector, how, example = KIND_USE[kind]
        lines += [f"## {heading} {{#{kind}}}", "", how, "", "```toml", example, "```", ""]
        for reg in registrations[kind]:
            lines += [f"### `{reg.name}` {{#{kind}-{reg.name}}}", ""]
            doc = (getattr(reg.factory, "__doc__", None) or "").strip().split("\n\n")[0]
            if doc:
                lines += [as_markdown(" ".join(doc.split())), ""]
            if reg.options or selector:
                lines += _table(reg.options, (selector, reg.name) if selector else None)
            else:
                lines.append("No keys of its own.")
            lines.append("")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """MkDocs event: put the generated tables in place of :data:`MARKER`."""
    if page.file.src_uri != "toml-reference.md":
        return markdown
    if MARKER not in markdown:
        raise RuntimeError(f"docs/toml-reference.md lost its marker {MARKER}")
    return markdown.replace(MARKER, render())
