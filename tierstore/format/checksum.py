"""File checksums, computed while bytes stream past.

Unsigned stores use XXH3-128 (about 9-30 GB/s per core here, far above disk speed, so hashing
never bounds a save or a load). Stores with a signing key use keyed BLAKE3 (about 4-5 GB/s per
core), whose digest nobody without the key can compute (``tierstore.format.signing``). The
manifest form names the algorithm, and for keyed digests the key's public id, so a reader knows
how to check a digest from the digest alone.
"""

from __future__ import annotations

import hmac

from typing import IO, Callable

import blake3
import xxhash

__all__ = ["ALGORITHM", "KEYED_PREFIX", "KEYED_ALGORITHM", "Hasher", "checksum_of", "hash_stream", "CHUNK_BYTES",
           "same_digest"]

#: read size of :func:`hash_stream` when the caller gives none
CHUNK_BYTES = 8 << 20

ALGORITHM = "xxh3_128"
#: keyed digests are written ``blake3k_<16 hex digits of key id>:<64 hex digits>``
KEYED_PREFIX = "blake3k_"
#: a manifest's ``checksum_algorithm`` when its file digests are keyed
KEYED_ALGORITHM = "blake3_keyed"


class Hasher:
    """Incremental checksum; ``hexdigest`` gives the manifest form ``xxh3_128:<hex>``, or
    ``blake3k_<key id>:<hex>`` when made with a key (a 32-byte BLAKE3 key and its public id;
    stores get keyed hashers from their ``Keyring``, never by building one with a raw key)."""

    __slots__ = ("_h", "_prefix")

    def __init__(self, key: bytes | None = None, key_id: str = "") -> None:
        if key is None:
            self._h = xxhash.xxh3_128()
            self._prefix = ALGORITHM
        else:
            # Large updates (a tensor read in place, an 8 MiB piece) are hashed on several
            # cores: keyed BLAKE3 runs at about 4.6 GB/s per core, a third of XXH3, and the
            # cores of a training node are idle while it saves or loads.
            self._h = blake3.blake3(key=key, max_threads=blake3.blake3.AUTO)
            self._prefix = KEYED_PREFIX + key_id

    def update(self, data) -> None:  # bytes-like
        self._h.update(data)

    def hexdigest(self) -> str:
        return f"{self._prefix}:{self._h.hexdigest()}"


def checksum_of(data) -> str:
    """Unkeyed checksum of a whole bytes-like object."""
    h = Hasher()
    h.update(data)
    return h.hexdigest()


def hash_stream(source: IO[bytes], chunk_bytes: int = CHUNK_BYTES,
                sink: Callable[[memoryview], object] | None = None,
                hasher: Hasher | None = None) -> tuple[int, str]:
    """Read ``source`` to its end in chunks through one reused buffer, hashing every byte with
    ``hasher`` (default: an unkeyed one) and handing each chunk to ``sink``, e.g. a copy's
    ``write``; return (size, checksum). The one read-and-hash loop of the project:
    verification, drains and their checks all use it."""
    hasher = hasher if hasher is not None else Hasher()
    size = 0
    view = memoryview(bytearray(chunk_bytes))
    while n := source.readinto(view):
        chunk = view[:n]
        hasher.update(chunk)
        if sink is not None:
            sink(chunk)
        size += n
    return size, hasher.hexdigest()


def same_digest(got: str, recorded: str) -> bool:
    """Whether two digests (as manifests write them) are the same, compared in constant time:
    a keyed digest is a MAC, and comparing MACs must not tell how many leading characters
    match. Bytes, not str: ``compare_digest`` raises TypeError on a str that is not ASCII,
    and a recorded digest comes from a tier."""
    return hmac.compare_digest(got.encode("utf-8", "surrogatepass"),
                               recorded.encode("utf-8", "surrogatepass"))
