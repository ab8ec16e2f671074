"""File checksums: XXH3-128, computed while bytes stream past (about 9-30 GB/s per core here,
far above disk speed, so hashing never bounds a save or a load)."""

from __future__ import annotations

import xxhash

__all__ = ["ALGORITHM", "Hasher", "checksum_of"]

ALGORITHM = "xxh3_128"


class Hasher:
    """Incremental checksum; ``hexdigest`` gives the manifest form ``xxh3_128:<hex>``."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def update(self, data) -> None:  # bytes-like
        self._h.update(data)

    def hexdigest(self) -> str:
        return f"{ALGORITHM}:{self._h.hexdigest()}"


def checksum_of(data) -> str:
    """Checksum of a whole bytes-like object."""
    h = Hasher()
    h.update(data)
    return h.hexdigest()
