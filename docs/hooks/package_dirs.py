"""MkDocs hook: the packages that live in directories of other names, under their import names.

``pyproject.toml`` installs ``plugins/`` as ``tierstore_plugins``, ``conformance/`` as
``tierstore_conformance`` and ``simulate/`` as ``tierstore_simulate``
(``[tool.setuptools.package-dir]``). mkdocstrings finds a package's source by its import name;
so that it reads these from source, as it reads ``tierstore``, instead of importing them (the
conformance kit would need pytest to build the documentation), each gets a link of its import
name in ``build/docs-packages/``, which ``mkdocs.yml`` lists among the handler's paths.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

__all__ = ["LINKS", "package_dirs", "link_packages", "on_config"]

ROOT = Path(__file__).resolve().parents[2]
#: where the links go (build/ is ignored by git and removed by `make clean`)
LINKS = ROOT / "build" / "docs-packages"


def package_dirs() -> dict[str, Path]:
    """Import name -> directory, for every package whose directory has another name."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / path for name, path in mapping.items() if name != path}


def link_packages() -> None:
    """Make (or refresh) the links; atomic, so that two builds at once do not trip each other."""
    LINKS.mkdir(parents=True, exist_ok=True)
    for name, target in package_dirs().items():
        link = LINKS / name
        if link.is_symlink() and os.readlink(link) == str(target):
            continue
        fresh = LINKS / f".{name}.{os.getpid()}"
        fresh.unlink(missing_ok=True)
        fresh.symlink_to(target, target_is_directory=True)
        os.replace(fresh, link)


def on_config(config: Any, **kwargs: Any) -> Any:
    """MkDocs event, before any page is read: the links are there when mkdocstrings looks."""
    link_packages()
    return config
