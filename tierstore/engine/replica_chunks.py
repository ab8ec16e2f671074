"""Peer replicas of deduplicated checkpoints: only the chunks a holder lacks travel.

Where the tier a save goes to has ``dedup = true``, the sender knows each data file's chunks (its
recipes) and puts them in its replication header; where the ``peer`` tier has ``dedup = true``,
each holder keeps its replicas as chunks too (one chunk store per rank it holds for), answers
with the chunks it lacks, and the pair moves only those, as byte ranges of the file. The holder
checks each chunk against its digest as it lands, writes it to its chunk store, and writes each
file's recipe once every chunk is there. A file the sender holds whole (its tier does not
deduplicate) travels whole and is cut into chunks as it is written.

Both ranks of a pair must list that pair's transfers alike (``run_transfers``):
:func:`pair_transfers` makes them from the header and the holder's answer, on either side.
"""

from __future__ import annotations

from typing import Any

import torch

from tierstore.errors import ReplicationError
from tierstore.format.chunk_recipe import Recipe
from tierstore.format.manifest import FileEntry
from tierstore.format.manifest_check import CHECKSUM_PATTERN
from tierstore.plugin.bases import DirectoryLock
from tierstore.tiers.chunked import ChunkedBackend, is_chunked_name
from tierstore.tiers.tier import Tier
from tierstore.transport.ends import BufferTarget, TransferEnd
from tierstore.transport.transfer import Transfer

__all__ = ["ChunkedReceipt", "ChunkingEnd", "chunk_lists", "checked_chunk_lists",
           "checked_needs", "pair_transfers"]

#: chunks of one file: ``(length, digest)`` each, in order
Chunks = tuple[tuple[int, str], ...]


def chunk_lists(source: Tier, checkpoint_id: str, files: dict[str, FileEntry]
                ) -> dict[str, list[list]]:
    """The sender: each data file's chunks as ``source`` stores them (the recipes of a
    deduplicated tier), as plain data for the header; {} on any other tier."""
    backend = source.backend
    if not isinstance(backend, ChunkedBackend):
        return {}
    out = {}
    for rel in files:
        if not is_chunked_name(rel):
            continue
        try:
            recipe = backend.read_recipe(f"{checkpoint_id}/{rel}")
        except FileNotFoundError:
            continue  # written whole (before the tier deduplicated): it travels whole
        out[rel] = [list(c) for c in recipe.chunks]
    return out


def checked_chunk_lists(value: Any, files: dict[str, FileEntry], src: int) -> dict[str, Chunks]:
    """The chunk lists of a header rank ``src`` sent, checked: files it sends, digests of the
    file checksum's kind, lengths adding up to each file's size."""
    if not isinstance(value, dict):
        raise ReplicationError(f"rank {src} sent chunk lists that are not a table")
    out = {}
    for rel, chunks in value.items():
        entry = files.get(rel)
        if entry is None or not isinstance(chunks, list):
            raise ReplicationError(f"rank {src} sent chunks of {rel!r}, a file it does not send")
        kind = entry.checksum.split(":", 1)[0]
        parsed = []
        for chunk in chunks:
            if (not isinstance(chunk, list) or len(chunk) != 2 or type(chunk[0]) is not int
                    or chunk[0] <= 0 or not isinstance(chunk[1], str)
                    or not CHECKSUM_PATTERN.fullmatch(chunk[1])
                    or chunk[1].split(":", 1)[0] != kind):
                raise ReplicationError(f"rank {src} sent a chunk of {rel!r} out of shape "
                                       f"({str(chunk)[:80]})")
            parsed.append((chunk[0], chunk[1]))
        if sum(n for n, _ in parsed) != entry.size:
            raise ReplicationError(f"rank {src} sent chunks of {rel!r} that do not add up to "
                                   f"its {entry.size} bytes")
        out[rel] = tuple(parsed)
    return out


def checked_needs(value: Any, chunks: dict[str, Chunks], holder: int) -> dict[str, list[int]]:
    """What holder ``holder`` answered it lacks, checked: chunk indexes of files this rank
    sends as chunks, ascending."""
    if not isinstance(value, dict):
        raise ReplicationError(f"rank {holder} answered with needs that are not a table")
    out = {}
    for rel, wanted in value.items():
        have = chunks.get(rel)
        if have is None or not isinstance(wanted, list) or not all(
                type(i) is int and 0 <= i < len(have) for i in wanted) or \
                wanted != sorted(set(wanted)):
            raise ReplicationError(f"rank {holder} asked for chunks of {rel!r} that this rank "
                                   f"does not send")
        out[rel] = wanted
    return out


def pair_transfers(src: int, dst: int, files: dict[str, FileEntry], chunks: dict[str, Chunks],
                   needs: dict[str, list[int]] | None) -> list[Transfer]:
    """The transfers from ``src`` to ``dst``, alike on both ranks: the chunks ``dst`` needs
    of each file both sides deduplicate (``needs``; None: the holder keeps whole files), each
    as a byte range of its file; every other file whole."""
    out = []
    for rel, entry in sorted(files.items()):
        wanted = None if needs is None else needs.get(rel)
        if wanted is None or rel not in chunks:
            out.append(Transfer(src, dst, rel, entry.size))
            continue
        starts, pos = [], 0
        for length, _ in chunks[rel]:
            starts.append(pos)
            pos += length
        out += [Transfer(src, dst, rel, chunks[rel][i][0], starts[i]) for i in wanted]
    return out


class ChunkingEnd(TransferEnd):
    """A receiving end that writes a whole file into a deduplicated replica tier: the pieces
    arrive in order and go through the tier's chunking writer (cut where the manifest entry
    says the file's items start)."""

    in_place = False

    def __init__(self, tier: Tier, path: str, entry: FileEntry):
        self._writing = tier.open_write(path, entry.size, entry.cuts)
        self._file = self._writing.__enter__()
        self._next = 0

    def write_at(self, offset: int, data: torch.Tensor) -> None:
        """Write the piece that starts at ``offset`` (the one after the last)."""
        if offset != self._next:
            raise OSError(f"a replica piece at {offset} arrived out of order (expected "
                          f"{self._next})")
        self._file.write(memoryview(data.numpy()))
        self._next += data.numel()

    def close(self, fsync: bool = False) -> None:
        """Write the last chunks and the file's recipe. Closing twice is a no-op."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.__exit__(None, None, None)


class ChunkedReceipt:
    """A holder's side of one source rank's replicas on a deduplicated replica tier: the
    chunks it lacks, where they land, and the recipes written once they are all there. Holds
    the tier's chunk store from its first look until :meth:`close`."""

    def __init__(self, tier: Tier, chunks: dict[str, Chunks]):
        backend = tier.backend
        assert isinstance(backend, ChunkedBackend)
        self.tier, self.chunks = tier, chunks
        self._store = backend.chunks
        # per file: where each chunk starts (offset -> index), and the file's size
        self._starts: dict[str, dict[int, int]] = {}
        self._sizes: dict[str, int] = {}
        for rel, lst in chunks.items():
            pos, starts = 0, {}
            for i, (length, _) in enumerate(lst):
                starts[pos] = i
                pos += length
            self._starts[rel], self._sizes[rel] = starts, pos
        self._buffers: dict[str, BufferTarget] = {}
        self._arrived: dict[tuple[str, int], int] = {}  # (file, offset) -> bytes so far
        self._whole: set[tuple[str, int]] = set()  # (file, index) of chunks checked, written
        #: bytes of chunks received and written
        self.received = 0
        self._hold: DirectoryLock | None = self._store.hold()
        try:
            #: per file, the indexes of the chunks this holder lacks
            self.needs = {rel: [i for i, (n, d) in enumerate(lst) if not self._store.has(d, n)]
                          for rel, lst in chunks.items()}
        except BaseException:
            self.close()
            raise

    def target(self, t: Transfer) -> BufferTarget:
        """Where a chunk of ``t.key`` lands: one buffer per file (only its chunks' pages are
        touched)."""
        if t.key not in self._buffers:
            self._buffers[t.key] = BufferTarget(self._sizes[t.key])
        return self._buffers[t.key]

    def arrived(self, t: Transfer, data: torch.Tensor) -> None:
        """A piece of chunk transfer ``t`` is there: once the chunk is whole, check it against
        its digest and write it to the chunk store."""
        key = (t.key, t.offset)
        got = self._arrived.get(key, 0) + data.numel()
        self._arrived[key] = got
        if got < t.size:
            return
        index = self._index_of(t)
        length, digest = self.chunks[t.key][index]
        view = self._buffers[t.key].data[t.offset:t.offset + length]
        hasher = self._store.new_hasher()
        hasher.update(view)
        if hasher.hexdigest() != digest:
            raise ReplicationError(f"a chunk of {t.key} from rank {t.src} does not match its "
                                   f"digest; the replica was not committed")
        self.received += self._store.ensure(digest, view)
        self._whole.add((t.key, index))

    def _index_of(self, t: Transfer) -> int:
        index = self._starts[t.key].get(t.offset)
        if index is None:
            raise ReplicationError(f"no chunk of {t.key} starts at {t.offset}")
        return index

    def write_recipes(self, staging: str) -> None:
        """Every chunk is there: write each file's recipe into the replica's staging
        directory."""
        for rel in self.needs:
            missing = [i for i in self.needs[rel] if (rel, i) not in self._whole]
            if missing:
                raise ReplicationError(f"{len(missing)} chunks of {rel} never arrived; the "
                                       f"replica was not committed")
            backend = self.tier.backend
            assert isinstance(backend, ChunkedBackend)
            backend.put_recipe(f"{staging}/{rel}", Recipe(self._sizes[rel], self.chunks[rel]))


    def close(self) -> None:
        """Let go of the chunk store. Idempotent."""
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.release()
        self._buffers.clear()
