"""What a torchtitan job's store is opened with: the user's tierstore TOML, with its staging made
to agree with ``checkpoint.async_mode``, and what ``keep_latest_k`` becomes.

Pure functions of the configuration (nothing here imports torchtitan or opens a store), so the
rules are checked without a job:

- ``async_mode = "async"``: eager staging (``async_save`` returns once the state is copied);
  ``"async_with_pinned_mem"``: lazy staging (it returns at once, the copy runs beside the next
  forward and backward, and the optimizer step waits for it: torchtitan's
  ``maybe_wait_for_staging``); ``"disabled"``: synchronous ``dcp.save``, staging unused.
  ``async_mode`` wins over a ``lazy`` the TOML sets, with a warning; every other staging option
  (the plugin, ``max_staging_bytes``) stays the TOML's.
- Retention is the tiers' ``keep``. ``keep_latest_k`` deletes nothing; set to something the
  tiers do not keep, it draws a warning that says so.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ASYNC_MODES", "StoreSettings", "store_settings", "lazy_for"]

#: torchtitan's ``checkpoint.async_mode`` -> the ``lazy`` of tierstore's staging (None: no
#: staging, the save is synchronous)
ASYNC_MODES: dict[str, bool | None] = {
    "disabled": None,
    "async": False,
    "async_with_pinned_mem": True,
}


@dataclass(frozen=True)
class StoreSettings:
    """What to hand ``tierstore.open``, and what to tell the user first.

    ``config`` is the TOML path itself when nothing had to change (tierstore's errors then
    name the file and line), else a dict of the file's contents with the staging changed."""

    config: str | dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    #: what was changed, in words, for an error about the changed config
    changed: str = ""


def lazy_for(async_mode: str) -> bool | None:
    """The staging ``lazy`` that ``async_mode`` asks for (None: a synchronous save)."""
    try:
        return ASYNC_MODES[async_mode]
    except KeyError:
        raise ValueError(f"checkpoint.async_mode {async_mode!r} is not one of "
                         f"{', '.join(map(repr, ASYNC_MODES))}") from None


def store_settings(tiers: str | os.PathLike, async_mode: str,
                   keep_latest_k: int = 0) -> StoreSettings:
    """How to open the store of ``tiers`` (a TOML path) for a manager whose config says
    ``async_mode`` and ``keep_latest_k``.

    A file that cannot be read or parsed is handed to tierstore as it is: ``tierstore.open``
    then reports it with the file and line."""
    path = os.fspath(tiers)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return StoreSettings(path)
    notes = _keep_warnings(data, path, keep_latest_k)
    want = lazy_for(async_mode)
    store = data.get("store", {})
    staging = store.get("staging", "cpu") if isinstance(store, dict) else "cpu"
    if want is None or not isinstance(staging, (str, dict)):
        return StoreSettings(path, notes)  # nothing staged, or a mistake tierstore will name
    table = {"name": staging} if isinstance(staging, str) else dict(staging)
    have = table.get("lazy", False)
    if have is want or not isinstance(have, bool):
        return StoreSettings(path, notes)
    if "lazy" in table:
        notes.append(
            f"checkpoint.async_mode = {async_mode!r} asks for {_staging_words(want)}, but "
            f"[store] staging in {path} says lazy = {str(have).lower()}: async_mode wins and "
            f"the store stages lazy = {str(want).lower()}; make the two agree (or drop 'lazy' "
            f"from the TOML) to silence this")
    table["lazy"] = want
    changed = dict(data, store=dict(store, staging=table))
    return StoreSettings(changed, notes,
                         f"read from {path}, with [store] staging's lazy = "
                         f"{str(want).lower()} from checkpoint.async_mode = {async_mode!r}")


def _staging_words(lazy: bool) -> str:
    return "lazy staging" if lazy else "eager staging"


def _keep_warnings(data: dict[str, Any], path: str, keep_latest_k: int) -> list[str]:
    """A warning when ``keep_latest_k`` asks for a retention some tier does not apply."""
    if keep_latest_k <= 0:
        return []
    tiers = [t for t in data.get("tier", []) if isinstance(t, dict)]
    keeps = {str(t.get("name", f"tier[{i}]")): t.get("keep") for i, t in enumerate(tiers)}
    if all(k == keep_latest_k for k in keeps.values()):
        return []
    said = ", ".join(f"{name}: {'all' if k is None else k}" for name, k in keeps.items())
    return [f"checkpoint.keep_latest_k = {keep_latest_k} deletes nothing with tierstore: each "
            f"tier keeps the newest checkpoints its 'keep' says ({said}, in {path}); set "
            f"keep = {keep_latest_k} on the tiers that should keep {keep_latest_k}, and "
            f"keep_latest_k = 0 (the default here) to silence this"]
