"""File checksums: XXH3-128, computed while bytes stream past (about 9-30 GB/s per core here,
far above disk speed, so hashing never bounds a save or a load)."""

from __future__ import annotations

from typing import IO, Callable

import xxhash

__all__ = ["ALGORITHM", "Hasher", "checksum_of", "hash_stream", "CHUNK_BYTES"]

#: read size of :func:`hash_stream` when the caller gives none
CHUNK_BYTES = 8 << 20

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


def hash_stream(source: IO[bytes], chunk_bytes: int = CHUNK_BYTES,
                sink: Callable[[memoryview], object] | None = None) -> tuple[int, str]:
    """Read ``source`` to its end in chunks through one reused buffer, hashing every byte (and
    handing each chunk to ``sink``, e.g. a copy's ``write``); return (size, checksum). The one
    read-and-hash loop of the project: verification, drains and their checks all use it."""
    hasher = Hasher()
    size = 0
    view = memoryview(bytearray(chunk_bytes))
    while n := source.readinto(view):
        chunk = view[:n]
        hasher.update(chunk)
        if sink is not None:
            sink(chunk)
        size += n
    return size, hasher.hexdigest()
