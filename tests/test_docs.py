"""The documentation site: it builds with ``mkdocs build --strict`` (a broken link or anchor, an
API reference that does not resolve, any warning fails), and its TOML reference lists every key
the config validator accepts, read from the validator's own schema."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tierstore.config import validate
from tierstore.plugin.host import KINDS
from tierstore.plugin.options import Option

ROOT = Path(__file__).resolve().parent.parent


def _load_hook(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}",
                                                  ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _keys_by_section(markdown: str) -> dict[str, set[str]]:
    """The keys each table of the reference lists, by the id of the heading above it."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in markdown.splitlines():
        heading = re.match(r"#+ .*\{#([\w-]+)\}\s*$", line)
        if heading:
            current = heading.group(1)
            sections[current] = set()
            continue
        row = re.match(r"\| `([^`]+)` \|", line)
        if row and current is not None:
            sections[current].add(row.group(1))
    return sections


def _accepted_keys() -> dict[str, set[str]]:
    """Every key the validator accepts, by the section of the reference that must list it: the
    validator's own Option tables and renamed keys, and the Options each built-in plugin
    declares (what every store registers), with the key that names a plugin in its table."""
    tables = {name: value for name, value in vars(validate).items()
              if isinstance(value, tuple) and value and all(isinstance(o, Option) for o in value)}
    assert {"TOP_LEVEL_OPTIONS", "STORE_OPTIONS", "TIER_OPTIONS"} <= set(tables)
    anchors = {"TOP_LEVEL_OPTIONS": "top-level", "STORE_OPTIONS": "store", "TIER_OPTIONS": "tier"}
    expected: dict[str, set[str]] = {}
    for name, options in tables.items():
        # A table the validator gained that the page does not place fails here by name.
        expected[anchors.get(name, name)] = {o.name for o in options}
    host = _load_hook("builtin_host")
    for kind, registrations in host.builtin_registrations().items():
        assert registrations, f"no built-in {kind} plugin registered"
        # "replication.strategy": the key inside the table that names the plugin
        selector = KINDS[kind].config_key.partition(".")[2]
        for reg in registrations:
            expected[f"{kind}-{reg.name}"] = ({o.name for o in reg.options}
                                             | ({selector} if selector else set()))
    return expected


def _missing(markdown: str) -> list[str]:
    listed = _keys_by_section(markdown)
    missing = [f"{section}: {key}" for section, keys in _accepted_keys().items()
               for key in sorted(keys - listed.get(section, set()))]
    renamed = re.search(r"Former names.*?\n\n(.*?)(\n\n|$)", markdown, re.S)
    for old, new in validate.RENAMED_STORE_KEYS.items():
        if renamed is None or f"`{old}`: now `{new}`" not in renamed.group(1):
            missing.append(f"store (former name): {old}")
    return missing


def test_every_toml_key_the_validator_accepts_is_in_the_reference():
    """Each key of each table the validator checks, under that table's heading of the
    generated page (the hook's own output, as the build puts it on the page)."""
    markdown = _load_hook("toml_reference").render()
    assert not _missing(markdown), "keys missing from docs/toml-reference.md: " + ", ".join(
        _missing(markdown))


def test_the_reference_check_notices_a_missing_key():
    """The check above fails when one row is gone, in a core table and in a plugin's."""
    markdown = _load_hook("toml_reference").render()
    for row in ("| `watchdog` |", "| `lazy` |", "| `strategy` |"):
        lines = markdown.splitlines()
        index = next(i for i, line in enumerate(lines) if line.startswith(row))
        assert _missing("\n".join(lines[:index] + lines[index + 1:])), row


def test_the_reference_page_holds_the_generated_tables():
    page = (ROOT / "docs" / "toml-reference.md").read_text()
    assert _load_hook("toml_reference").MARKER in page


@pytest.mark.timeout(180)
def test_the_docs_build_strict_without_a_warning(tmp_path):
    """``mkdocs build --strict``, as ``make docs`` runs it: any warning fails the build, and a
    warning that does not (a plugin's own) fails this test; the output says which."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert not re.search(r"^(WARNING|ERROR)\b", output, re.M), output
    site = tmp_path / "site"
    # The generated pages are there, with their tables and the charts they show.
    reference = (site / "toml-reference" / "index.html").read_text()
    assert '<td><code>copy_chunk_mib</code></td>' in reference
    for chart in ("bench/save_load.png", "simulate/timeline.png"):
        assert (site / chart).is_file(), chart
    assert 'src="../bench/save_load.png"' in (site / "performance" / "index.html").read_text()
    assert "tierstore.Store.latest" in (site / "reference" / "tierstore" / "index.html").read_text()
    # Code wraps instead of running off the page, and table cells keep identifiers whole:
    # every page links the stylesheet that says so.
    css = (site / "stylesheets" / "extra.css").read_text()
    assert re.search(r"pre > code \{[^}]*white-space: pre-wrap", css), css
    assert re.search(r"table:not\(\[class\]\) code \{[^}]*white-space: nowrap", css), css
    for page in ("index.html", "configuration/index.html", "integrations-lightning/index.html"):
        assert "stylesheets/extra.css" in (site / page).read_text(), page
