"""Recipes: how a data file stored as content-addressed chunks (``dedup = true``) is put back.

A deduplicated tier keeps each DCP data file as a *recipe* beside the other files of its
checkpoint, and the bytes as chunks in the tier's chunk store, each named by its digest. The
recipe lists the file's chunks in order, each with its length and digest; its name carries the
file's name and the file's size: one listing tells every file's size, as for a whole file, and
a reader that knows the size from the manifest reads the recipe without a listing.

A recipe is read from a tier: untrusted. :func:`parse_recipe` checks every field, and the bytes
a recipe puts together are checked against the manifest's digests like any file's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tierstore.format.manifest_check import CHECKSUM_PATTERN, MAX_INT, ManifestError

__all__ = ["RECIPE_MARK", "Recipe", "RecipeName", "recipe_name", "parse_recipe_name",
           "parse_recipe", "MAX_RECIPE_BYTES"]

#: what a recipe's name holds between the file's name and its size
RECIPE_MARK = ".tierstore-chunked."
#: the largest recipe read from a tier (a file of a TiB in chunks of 1 MiB lists about 1M
#: chunks of about 60 bytes each)
MAX_RECIPE_BYTES = 128 << 20
_NAME = re.compile(rf"^(?P<name>.+){re.escape(RECIPE_MARK)}(?P<size>[0-9]{{1,19}})$")


@dataclass(frozen=True)
class RecipeName:
    """What a recipe's name says: the file it stands for and its size."""

    name: str
    size: int

    def __str__(self) -> str:
        return f"{self.name}{RECIPE_MARK}{self.size}"


def recipe_name(name: str, size: int) -> RecipeName:
    """The recipe name of file ``name`` of ``size`` bytes."""
    return RecipeName(name, size)


def parse_recipe_name(entry: str) -> RecipeName | None:
    """The :class:`RecipeName` of a directory entry, or None when it is no recipe."""
    if RECIPE_MARK not in entry:
        return None
    match = _NAME.match(entry)
    if match is None or int(match["size"]) > MAX_INT:
        return None
    return RecipeName(match["name"], int(match["size"]))


@dataclass(frozen=True)
class Recipe:
    """A file's chunks, in order: ``(length, digest)`` each."""

    size: int
    chunks: tuple[tuple[int, str], ...]

    def to_bytes(self) -> bytes:
        """The stored form (JSON)."""
        return json.dumps({"size": self.size, "chunks": [list(c) for c in self.chunks]},
                          separators=(",", ":")).encode()


def parse_recipe(raw: bytes, size: int, where: str) -> Recipe:
    """The recipe stored as ``raw`` for a file of ``size`` bytes (its name says), or
    ManifestError (an IntegrityError) naming ``where`` and what is wrong."""
    if len(raw) > MAX_RECIPE_BYTES:
        raise ManifestError(f"{where}: recipe of {len(raw)} bytes, more than any file needs")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"{where}: not a recipe ({type(exc).__name__})") from None
    if not isinstance(data, dict) or data.get("size") != size or type(size) is not int:
        raise ManifestError(f"{where}: the recipe is not one of a file of {size} bytes")
    chunks = data.get("chunks")
    if not isinstance(chunks, list):
        raise ManifestError(f"{where}: the recipe lists no chunks")
    out, total = [], 0
    for chunk in chunks:
        if (not isinstance(chunk, list) or len(chunk) != 2 or type(chunk[0]) is not int
                or not 0 < chunk[0] <= MAX_INT or not isinstance(chunk[1], str)
                or not CHECKSUM_PATTERN.fullmatch(chunk[1])):
            raise ManifestError(f"{where}: the recipe has a chunk out of shape "
                                f"({str(chunk)[:80]})")
        total += chunk[0]
        out.append((chunk[0], chunk[1]))
    if total != size:
        raise ManifestError(f"{where}: the recipe's chunks hold {total} bytes, the file "
                            f"{size}")
    return Recipe(size, tuple(out))
