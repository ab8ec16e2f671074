"""What ``tierstore`` says about a checkpoint id it was given that names no checkpoint: a
Lightning checkpoint file name (``epoch=0-step=10.ckpt``, ``last.ckpt``) is told apart from a
mistyped id, and answered with the id the store holds that file under.

The mapping is :mod:`tierstore.integrations.lightning.paths` (pure functions: it imports no
Lightning, and neither does this), so that the answer is the id the Lightning strategies saved.
"""

from __future__ import annotations

import os
from typing import Iterable

from tierstore.integrations.lightning.paths import (DIGEST_LENGTH, EXTENSION, checkpoint_id,
                                                    checkpoint_path)

__all__ = ["looks_like_lightning_file", "lightning_hint"]


def looks_like_lightning_file(given: str) -> bool:
    """Whether ``given`` reads as a Lightning checkpoint path rather than an id (it ends with
    Lightning's extension; a Lightning id never does, since the mapping drops it)."""
    return os.path.basename(given.rstrip("/")).endswith(EXTENSION)


def lightning_hint(given: str, stored: Iterable[str], config: str, command: str) -> str:
    """The answer of ``tierstore COMMAND CONFIG GIVEN`` to ``given``, a Lightning checkpoint
    path or file name, among the ``stored`` ids of the store of ``config``: the id (or ids) it
    is stored under, or the id it would have (``given``'s directory read from here, as
    Lightning's ``dirpath`` is) when none is."""
    path = given.rstrip("/")
    name = os.path.basename(path)
    own = checkpoint_id(path)  # the directory as given: exact when it is the job's dirpath
    found = [i for i in stored if i == own or _same_file_name(i, own, name)]
    if own in found:
        found = [own]
    quoted = ", ".join(f"'{i}'" for i in found)
    if len(found) == 1:
        return (f"'{given}' is a Lightning checkpoint file name, not a checkpoint id: the store "
                f"holds it as {quoted} (`tierstore {command} {config} {found[0]}`)")
    if found:
        return (f"'{given}' is a Lightning checkpoint file name, not a checkpoint id: the store "
                f"holds files of that name from {len(found)} directories, as {quoted}; give "
                f"its path (ModelCheckpoint's dirpath and the name) to pick one")
    directory = os.path.dirname(os.path.abspath(path))
    return (f"'{given}' is a Lightning checkpoint file name, not a checkpoint id: saved in "
            f"{directory}, it would be '{own}', and no tier holds a checkpoint of that name; "
            f"`tierstore ls {config}` shows what is stored")


def _same_file_name(stored: str, own: str, name: str) -> bool:
    """Whether id ``stored`` is Lightning's file ``name`` saved in any directory: the same
    id after the directory's digest, or an id of the rule before the digest (the escaped name
    alone, which :func:`checkpoint_path` reads as that name in any directory)."""
    if len(stored) > DIGEST_LENGTH and stored[DIGEST_LENGTH:] == own[DIGEST_LENGTH:]:
        return True
    try:
        return os.path.basename(checkpoint_path(stored, ".")) == name
    except ValueError:  # not an id the mapping makes, or one of another directory
        return False
