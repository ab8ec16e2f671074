"""Pointer files: what Lightning's own bookkeeping sees of a checkpoint kept in a store.

Lightning decides a few things by looking at its checkpoint directory before any strategy runs:
``trainer.fit(ckpt_path="last")`` picks the newest ``last*.ckpt`` file there, and
``ModelCheckpoint`` adds ``-v1`` to a name that exists already. The checkpoints themselves live in
the store's tiers, so the adapter leaves, at each path Lightning saved to, a small text file
naming the checkpoint's id in the store, and it writes that file only once the checkpoint has
been committed on a tier: whatever Lightning finds in its directory was complete when it
appeared. Removing a pointer file leaves the checkpoint in the store (``keep`` removes it).
"""

from __future__ import annotations

import os
import uuid

__all__ = ["write_pointer", "remove_pointer", "is_pointer", "pointed_id", "HEADER"]

#: the first line of a pointer file starts with this, followed by the checkpoint id
HEADER = "tierstore-checkpoint: "

_BODY = (
    "This file stands for a checkpoint kept in a tierstore store, under the id above (it holds\n"
    "no data). Resume from it with the strategy of tierstore.integrations.lightning, as\n"
    "trainer.fit(ckpt_path=...) or fabric.load(...); `tierstore ls <tiers.toml>` lists the\n"
    "store. Deleting this file does not delete the checkpoint: the tiers' `keep` does.\n"
)


def write_pointer(path: str | os.PathLike, checkpoint_id: str) -> None:
    """Write the pointer file at ``path`` for ``checkpoint_id``, atomically (a reader sees the
    old file or the new one), creating its directory. IsADirectoryError when ``path`` is a
    directory (a checkpoint saved there by Lightning's own strategy)."""
    path = os.fspath(path)
    if os.path.isdir(path) and not os.path.islink(path):
        raise IsADirectoryError(
            f"{path} is a directory (a checkpoint saved by Lightning's own strategy?): the "
            f"tierstore strategy leaves a small pointer file there instead; give ModelCheckpoint "
            f"another dirpath, or remove the directory")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(f"{HEADER}{checkpoint_id}\n{_BODY}")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def pointed_id(path: str | os.PathLike) -> str | None:
    """The checkpoint id the pointer file at ``path`` names (or the file a link there leads
    to, as ``save_last="link"`` makes); None when it is not a pointer file."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline(len(HEADER) + 256)
    except (OSError, UnicodeDecodeError):
        return None
    if not first.startswith(HEADER) or not first.endswith("\n"):
        return None
    return first[len(HEADER):-1]


def is_pointer(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a pointer file (or a link to one)."""
    return pointed_id(path) is not None


def remove_pointer(path: str | os.PathLike) -> None:
    """Remove the pointer file (or the link to one) at ``path``; anything else there, a
    directory above all, is left alone."""
    path = os.fspath(path)
    if os.path.islink(path) or is_pointer(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
