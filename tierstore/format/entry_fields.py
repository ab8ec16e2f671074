"""A manifest's file entry as plain fields, to travel between ranks, and back.

Ranks tell each other what files they hold (a load gathers what each can serve) as typed
messages, never pickles; an entry travels as the list of its fields, in a fixed order (shorter
than a table that repeats every field's name, entry after entry), and is rebuilt with the same
checks a manifest's entries pass (:mod:`tierstore.format.manifest_check`).
"""

from __future__ import annotations

from typing import Any

from tierstore.format.manifest import FileEntry
from tierstore.format.manifest_check import check_entry

__all__ = ["entry_fields", "entry_from_fields"]

_FIELDS = ("size", "checksum", "rank", "spans", "block_bytes", "blocks", "cuts")


def entry_fields(entry: FileEntry) -> list:
    """``entry`` as plain data: its fields, in :data:`_FIELDS` order."""
    return [entry.size, entry.checksum, entry.rank, entry.spans, entry.block_bytes, entry.blocks,
            entry.cuts]


def entry_from_fields(fields: Any, name: str = "?") -> FileEntry:
    """The entry :func:`entry_fields` made ``fields`` of (``name``: its file, for messages).
    Raises ``TypeError`` or ``ValueError`` (a ``ManifestError``, naming the field) when
    ``fields`` is not such a list or a field is not what a manifest may hold."""
    if not isinstance(fields, (list, tuple)) or len(fields) != len(_FIELDS):
        raise TypeError(f"the entry of {name!r} is not a list of its {len(_FIELDS)} fields "
                        f"({', '.join(_FIELDS)})")
    table = dict(zip(_FIELDS, fields))
    check_entry(name, table)
    spans = table["spans"]
    return FileEntry(size=table["size"], checksum=table["checksum"], rank=table["rank"],
                     spans=None if spans is None else [list(s) for s in spans],
                     block_bytes=table["block_bytes"],
                     blocks=None if table["blocks"] is None else list(table["blocks"]),
                     cuts=None if table["cuts"] is None else list(table["cuts"]))
