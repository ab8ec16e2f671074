"""Paths that come from tiers are untrusted: a manifest, a listing or a ``.metadata`` may name
anything. Everything a backend opens, writes, copies or deletes is a path relative to its tier
root made of plain names: no ``..``, nothing absolute, no NUL, no backslash, no empty segment.
Backends on filesystems also refuse to follow a symbolic link out of the root (plugins/local.py).
"""

from __future__ import annotations

import re

from tierstore.errors import IntegrityError

__all__ = ["confined", "is_plain_file_name"]

# One file of a checkpoint directory: DCP's ``__<rank>_<n>.distcp`` and ``.metadata``, the
# manifest, tierstore's hidden markers. Nothing with a separator or a parent reference.
_FILE_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,255}$")


def is_plain_file_name(name: object) -> bool:
    """Whether ``name`` can be a file of a checkpoint directory (one plain segment)."""
    return isinstance(name, str) and bool(_FILE_NAME.match(name)) and name not in (".", "..")


def confined(path: str, where: str = "") -> str:
    """``path`` itself when it stays under the tier root; else an :class:`IntegrityError`
    naming it (``where``: the tier, for the message)."""
    problem = None
    body = path[:-1] if isinstance(path, str) and path.endswith("/") else path  # a "directory"
    if not isinstance(path, str):
        problem = f"is a {type(path).__name__}, not a path"
    elif "\x00" in path or "\\" in path:
        problem = "contains a NUL or a backslash"
    elif path.startswith("/"):
        problem = "is absolute"
    elif body and any(seg in ("", ".", "..") for seg in body.split("/")):
        problem = "has an empty, '.' or '..' segment"
    if problem is None:
        return path
    place = f" on {where}" if where else ""
    raise IntegrityError(
        f"refusing path {path!r}{place}: it {problem}, so it could reach outside the tier's "
        f"root. A manifest or listing naming it was not written by tierstore: restore the "
        f"checkpoint from another tier, or delete it")
