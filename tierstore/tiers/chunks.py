"""The chunk store of a deduplicated tier (``dedup = true``): chunks named by their digest.

Chunks live under ``<tier root>/.tierstore-chunks/<digest kind>/<2 hex digits>/<hex digest>``,
beside the checkpoints, so that every checkpoint on the tier shares them. A chunk's name is its
digest: keyed BLAKE3 where the store signs (nobody without the key can make a chunk that takes
another's name), XXH3-128 otherwise.

Who may rely on a chunk being there, and when one may go:

- a writer holds the chunk store *shared* (``Backend.lock_directory``: a ``flock`` on a
  filesystem, a lease on an object store) from its first look at the store until the recipe
  that names its chunks is written (in its checkpoint's staging directory);
- the collector (:meth:`ChunkStore.collect`) takes it *exclusive* (never waiting: a pass that
  finds a writer skips and the next one collects), then removes every chunk no recipe on the
  tier names: committed, staging, being deleted, whatever directory it is in. A checkpoint that
  is kept, pinned, pending or being loaded has its recipes, so its chunks stay.
- what a writer knows to be there (the chunks it wrote or found) is valid while the store's
  *generation* is the one it read: the collector writes a new one before it removes anything,
  and a writer that finds another forgets what it knew.

On an object store the exclusive lease is a check that no writer's lease is current, not a lock
a writer must wait for; there a chunk goes only once two passes at least ``grace`` apart found
it unreferenced (a writer that took its lease right after a pass's check has its recipe written
long before the next).
"""

from __future__ import annotations

import bisect
import io
import json
import logging
import posixpath
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Callable, Iterable

from tierstore.format.checksum import Hasher
from tierstore.format.chunk_recipe import Recipe, parse_recipe, parse_recipe_name
from tierstore.format.manifest_check import CHECKSUM_PATTERN
from tierstore.format.streams import write_all
from tierstore.plugin.bases import Backend, DirectoryLock

__all__ = ["CHUNK_BYTES", "OBJECT_CHUNK_BYTES", "CHUNKS_DIR", "ChunkStore", "ChunkReader", "chunk_path",
           "Collected", "MissingChunk"]

log = logging.getLogger("tierstore.chunks")

#: the largest chunk on a filesystem: an item is cut at its start and every this many bytes
#: after it (a file per chunk costs little there)
CHUNK_BYTES = 1 << 20
#: the largest chunk on an object store, where each chunk is a request: fewer, larger ones
OBJECT_CHUNK_BYTES = 4 << 20
#: where a tier's chunks live, below its root
CHUNKS_DIR = ".tierstore-chunks"
_GENERATION = f"{CHUNKS_DIR}/.generation"
_UNREFERENCED = f"{CHUNKS_DIR}/.unreferenced.json"
#: chunks an object store's reader fetches ahead of the one it reads
_READ_AHEAD = 8
#: an object store's chunk goes only after this long unreferenced (two passes apart), unless
#: its backend's leases say how long a writer may go unseen
_DEFAULT_GRACE_S = 1200.0


def chunk_path(digest: str) -> str:
    """Where the chunk whose digest is ``digest`` lives, relative to the tier's root."""
    kind, hexdigest = digest.split(":", 1)
    return f"{CHUNKS_DIR}/{kind}/{hexdigest[:2]}/{hexdigest}"


def _digest_of(path: str) -> str | None:
    """The digest a chunk's path (relative to the chunk store) names, or None when it is no
    chunk's (a temporary file, a stranger's)."""
    parts = path.split("/")
    if len(parts) != 3 or parts[1] != parts[2][:2]:
        return None
    digest = f"{parts[0]}:{parts[2]}"
    return digest if CHECKSUM_PATTERN.fullmatch(digest) else None


class _Hold(DirectoryLock):
    """One writer's share of the process's hold on a chunk store (``ChunkStore.hold``)."""

    def __init__(self, store: "ChunkStore"):
        self._store: ChunkStore | None = store

    def release(self) -> None:
        """Let go (idempotent)."""
        store, self._store = self._store, None
        if store is not None:
            store._let_go()


class MissingChunk(FileNotFoundError):
    """A chunk a recipe names is not in the chunk store (or is shorter than it says): the
    file it belongs to is missing from this copy, and the message says which chunk."""


class Collected:
    """What a collection pass did: chunks and bytes removed, and whether it ran at all."""

    def __init__(self, ran: bool, chunks: int = 0, nbytes: int = 0):
        self.ran, self.chunks, self.nbytes = ran, chunks, nbytes


class ChunkStore:
    """The chunks of one tier, on its backend (the real one, below the deduplicating view)."""

    def __init__(self, backend: Backend, new_hasher: Callable[[], Hasher], parallel: int = 0,
                 chunk_bytes: int = CHUNK_BYTES):
        self.backend = backend
        self.new_hasher = new_hasher
        #: the largest chunk written here (a store reads chunks of any size)
        self.chunk_bytes = chunk_bytes
        #: chunks written at once per file, on a thread pool (an object store: each chunk is
        #: a request, and one at a time would leave the link idle between them); 0: in the
        #: writer's own thread, one after the other (a filesystem)
        self.parallel = parallel
        self._pool: ThreadPoolExecutor | None = None
        self._guard = threading.Lock()
        # digests known to be in the store, valid under generation self._generation
        self._known: set[str] = set()
        self._generation: str | None = None
        self._dirs_made: set[str] = set()
        #: the recipes whose chunks :meth:`learn` was told of, under the current generation
        self.learned: set[str] = set()
        self._last_pass = 0.0
        # the one hold this process's writers share (hold), and how many use it
        self._holding = threading.Lock()
        self._holders = 0
        self._shared: DirectoryLock | None = None
        self._root_seen: tuple[float, list[str]] | None = None

    # -- writers ---------------------------------------------------------------------------
    def hold(self) -> DirectoryLock:
        """Hold the store shared for a writer (see the module's docstring); release the hold
        returned when done. The writers of this process share one hold: the first takes the
        lock (a lease on an object store: a write) and brings this process's knowledge of
        what is there up to date; the last lets go of it."""
        with self._holding:
            if self._holders == 0:
                self._makedirs(CHUNKS_DIR)
                lock = self.backend.lock_directory(CHUNKS_DIR, exclusive=False)
                self._shared = lock if lock is not None else DirectoryLock()
                try:
                    generation = self._read_generation()
                except BaseException:
                    self._shared.release()
                    raise
                with self._guard:
                    if generation != self._generation:
                        self._known.clear()
                        self.learned.clear()
                        self._generation = generation
            self._holders += 1
        return _Hold(self)

    def _let_go(self) -> None:
        """One writer is done (:class:`_Hold`); the last one releases the lock."""
        with self._holding:
            self._holders -= 1
            if self._holders:
                return
            shared, self._shared = self._shared, None
            if shared is not None:
                shared.release()

    def root_entries(self) -> list[str]:
        """The root's entries, as a listing at most a second old saw them (every file a save
        writes asks: one listing serves the save's files)."""
        with self._guard:
            seen = self._root_seen
        if seen is not None and time.monotonic() - seen[0] < 1.0:
            return seen[1]
        entries = self.backend.list("")
        with self._guard:
            self._root_seen = (time.monotonic(), entries)
        return entries

    def learn(self, digests: Iterable[str]) -> None:
        """Chunks a recipe on the tier names (so they are there): an object store's writer
        writes only the chunks it does not know of, without asking for each. Only under
        :meth:`hold`."""
        with self._guard:
            self._known.update(digests)

    def ensure(self, digest: str, data: memoryview, recheck: bool = False) -> int:
        """Make sure the chunk ``digest`` (whose bytes are ``data``) is in the store; the
        bytes written (0 when it was there already). Only under :meth:`hold`. ``recheck``
        (a repair): a chunk there is read back and written again unless its bytes match."""
        with self._guard:
            if digest in self._known and not recheck:
                return 0
        path = chunk_path(digest)
        # An object store's writer asks nothing: what it does not know of (learn) is most
        # likely new, and a question per chunk would cost more requests than the writes.
        if (not self.parallel or recheck) and self._holds(path, digest, len(data), recheck):
            written = 0
        else:
            self._put(path, data)
            written = len(data)
        with self._guard:
            self._known.add(digest)
        return written

    def has(self, digest: str, size: int) -> bool:
        """Whether the chunk ``digest`` of ``size`` bytes is in the store (known, or found).
        Only under :meth:`hold`."""
        with self._guard:
            if digest in self._known:
                return True
        if self.backend.size(chunk_path(digest)) != size:
            return False
        with self._guard:
            self._known.add(digest)
        return True

    def fetch(self, digest: str) -> Future:
        """The chunk ``digest``'s bytes, read on the store's thread pool (with
        :attr:`parallel`)."""
        return self._thread_pool().submit(self.backend.read_bytes, chunk_path(digest))

    def _thread_pool(self) -> ThreadPoolExecutor:
        with self._guard:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.parallel,
                                                thread_name_prefix="tierstore-chunks")
            return self._pool

    def submit(self, digest: str, data: bytes, recheck: bool = False) -> Future:
        """:meth:`ensure` on the store's thread pool (with :attr:`parallel`); ``data`` must
        stay as it is until the future is done."""
        return self._thread_pool().submit(self.ensure, digest, memoryview(data), recheck)

    def close(self) -> None:
        """Stop the thread pool (the store closes; its writers are done)."""
        with self._guard:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _holds(self, path: str, digest: str, size: int, recheck: bool) -> bool:
        if self.backend.size(path) != size:
            return False
        if not recheck:
            return True
        hasher = self.new_hasher()
        try:
            hasher.update(self.backend.read_bytes(path))
        except FileNotFoundError:
            return False
        return hasher.hexdigest() == digest

    def forget(self, digest: str) -> None:
        """A reader found chunk ``digest`` missing or damaged: never skip writing it again on
        the word of what this process knew."""
        with self._guard:
            self._known.discard(digest)

    def _put(self, path: str, data: memoryview) -> None:
        """Write a chunk so that it is there whole or not at all: beside, then renamed, where
        the backend renames; in one request on an object store."""
        self._makedirs(posixpath.dirname(path))
        if not self.backend.supports_rename:
            with self.backend.open_write(path) as f:
                write_all(f, data)
            return
        beside = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        with self.backend.open_write(beside) as f:
            write_all(f, data)
        self.backend.rename(beside, path, replace=True)

    def _makedirs(self, path: str) -> None:
        if path in self._dirs_made:
            return
        self.backend.makedirs(path)
        with self._guard:
            self._dirs_made.add(path)

    def _read_generation(self) -> str:
        try:
            return self.backend.read_bytes(_GENERATION).decode("ascii", "replace")[:64]
        except FileNotFoundError:
            return ""

    # -- readers ---------------------------------------------------------------------------
    def open(self, recipe: Recipe, name: str) -> "ChunkReader":
        """A seekable reader of the file ``recipe`` puts together (``name`` for messages)."""
        return ChunkReader(self, recipe, name)

    # -- the collector ----------------------------------------------------------------------
    def due(self) -> bool:
        """Whether a pass would do anything now: always on a filesystem; on an object store,
        where a chunk goes only once two passes at least the grace apart found it unnamed,
        once a quarter of the grace has gone by since this process's last pass (a pass costs
        a listing of every checkpoint and of the chunk store)."""
        if not self.backend.locks_write:
            return True
        return time.time() - self._last_pass >= _grace_s(self.backend) / 4

    def collect(self, recipe_paths: Callable[[], Iterable[str]],
                announce: Callable[[int], None] = lambda n: None) -> Collected:
        """Remove every chunk that none of the recipes at ``recipe_paths()`` (every recipe on
        the tier; called by :meth:`~tierstore.tiers.chunked.ChunkedBackend.collect_chunks`)
        names. ``Collected(ran=False)`` when a writer holds the store (the next pass
        collects)."""
        self._last_pass = time.time()
        lock = self.backend.lock_directory(CHUNKS_DIR, exclusive=True)
        if lock is None:
            log.info("not collecting chunks on %s: a writer holds its chunk store",
                     self.backend.describe())
            return Collected(False)
        try:
            referenced = self._referenced(recipe_paths())
            stored, strays = self._stored()
            unreferenced = {d: p for d, p in stored.items() if d not in referenced}
            victims = self._past_grace(unreferenced) if self.backend.locks_write \
                else list(unreferenced)
            if not victims and not strays:
                return Collected(True)
            announce(len(victims))
            # Writers in other processes forget what they knew before anything goes.
            generation = uuid.uuid4().hex
            self.backend.write_bytes(_GENERATION, generation.encode())
            nbytes = 0
            for digest in victims:
                path, size = unreferenced[digest]
                if size < 0:
                    size = self.backend.size(f"{CHUNKS_DIR}/{path}") or 0
                try:
                    self.backend.delete(f"{CHUNKS_DIR}/{path}")
                except FileNotFoundError:
                    continue
                nbytes += size
            if not self.backend.locks_write:
                for path in strays:  # a writer killed mid-chunk (no writer holds the store)
                    self.backend.delete(f"{CHUNKS_DIR}/{path}")
            with self._guard:
                self._known.difference_update(victims)
                self._generation = generation
            return Collected(True, len(victims), nbytes)
        finally:
            lock.release()

    def _referenced(self, recipe_paths: Iterable[str]) -> set[str]:
        """Every digest the recipes at ``recipe_paths`` name. A recipe that cannot be read
        or parsed spares everything: never remove what a damaged listing may still need."""
        referenced: set[str] = set()
        for path in recipe_paths:
            name = parse_recipe_name(posixpath.basename(path))
            try:
                raw = self.backend.read_bytes(path)
            except FileNotFoundError:
                continue  # removed since the listing: its checkpoint went
            referenced.update(d for _, d in parse_recipe(raw, name.size, path).chunks)
        return referenced

    def _stored(self) -> tuple[dict[str, tuple[str, int]], list[str]]:
        """Every chunk in the store: digest -> (path below the store, size); and the paths of
        files there that are no chunk (a write a killed writer left)."""
        out: dict[str, tuple[str, int]] = {}
        strays: list[str] = []
        sizes = self.backend.inventory(CHUNKS_DIR)
        if sizes is None:  # a filesystem: names only (the victims' sizes are asked later)
            sizes = {}
            for kind in self.backend.list(CHUNKS_DIR):
                if kind.startswith("."):
                    continue
                for prefix in self.backend.list(f"{CHUNKS_DIR}/{kind}"):
                    for name in self.backend.list(f"{CHUNKS_DIR}/{kind}/{prefix}"):
                        sizes[f"{kind}/{prefix}/{name}"] = -1
        for rel, size in sizes.items():
            if rel.startswith("."):
                continue  # the store's own files (its generation, what is unreferenced)
            digest = _digest_of(rel)
            if digest is None:
                strays.append(rel)
            else:
                out[digest] = (rel, size)
        return out, strays

    def _past_grace(self, unreferenced: dict) -> list[str]:
        """On an object store: the unreferenced chunks a pass at least the grace ago found
        unreferenced too; the others are noted for the next pass."""
        now = time.time()
        grace = _grace_s(self.backend)
        try:
            noted = json.loads(self.backend.read_bytes(_UNREFERENCED))
            noted = {k: float(v) for k, v in noted.items()} if isinstance(noted, dict) else {}
        except (FileNotFoundError, ValueError, TypeError, AttributeError):
            noted = {}
        victims = [d for d in unreferenced if d in noted and now - noted[d] >= grace]
        keep = {d: noted.get(d, now) for d in unreferenced if d not in victims}
        self.backend.write_bytes(_UNREFERENCED, json.dumps(keep).encode())
        return victims


def _grace_s(backend: Backend) -> float:
    leases = getattr(backend, "leases", None)
    seconds = getattr(leases, "seconds", None)
    return 2 * float(seconds) + 60 if isinstance(seconds, (int, float)) else _DEFAULT_GRACE_S


class ChunkReader(io.RawIOBase):
    """A deduplicated file read back: its recipe's chunks in order, seekable. On an object
    store (the store's :attr:`~ChunkStore.parallel`) the chunks after the one being read are
    fetched ahead, several at once."""

    #: a load reads it whole into memory and checks it before using any of it
    #: (tierstore.format.item_io.map_checked), as it does a mapped local file
    read_whole_first = True

    def __init__(self, store: ChunkStore, recipe: Recipe, name: str):
        super().__init__()
        self._store, self._recipe, self.name = store, recipe, name
        # index -> the chunk's bytes, fetched ahead (object stores)
        self._ahead: dict[int, Future] = {}
        self._starts = []
        pos = 0
        for length, _ in recipe.chunks:
            self._starts.append(pos)
            pos += length
        self._pos = 0
        self._open: tuple[int, IO[bytes]] | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._recipe.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        done = 0
        while done < len(view) and self._pos < self._recipe.size:
            index = self._chunk_at(self._pos)
            length, digest = self._recipe.chunks[index]
            within = self._pos - self._starts[index]
            want = min(len(view) - done, length - within)
            if self._store.parallel:
                data = self._fetched(index)
                got = min(want, len(data) - within)
                view[done:done + max(got, 0)] = data[within:within + max(got, 0)]
                got = max(got, 0)
            else:
                f = self._chunk_file(index, digest)
                f.seek(within)
                got = f.readinto(view[done:done + want])
            if not got:
                self._store.forget(digest)
                raise MissingChunk(
                    f"{self.name}: chunk {digest} ends {length - within} bytes early; the "
                    f"chunk store is damaged (run `tierstore scrub --repair`)")
            done += got
            self._pos += got
        return done

    def _fetched(self, index: int) -> bytes:
        """Chunk ``index``'s bytes, with the next ones asked for meanwhile."""
        chunks = self._recipe.chunks
        for ahead in range(index, min(index + _READ_AHEAD, len(chunks))):
            if ahead not in self._ahead:
                self._ahead[ahead] = self._store.fetch(chunks[ahead][1])
        for old in [i for i in self._ahead if i < index]:
            self._ahead.pop(old).cancel()
        try:
            return self._ahead[index].result()
        except FileNotFoundError:
            self._store.forget(chunks[index][1])
            raise MissingChunk(f"{self.name}: chunk {chunks[index][1]} is missing from the "
                               f"tier's chunk store") from None

    def mapped(self):
        """The whole file as one read-only mapping of its chunks' own pages, in order
        (:func:`tierstore.tiers.chunk_map.map_chunks`: a load checks and reads it as it does a
        whole mapped file, with no copy); None on an object store, whose chunks are no local
        files, or where the chunks' files cannot be mapped. MissingChunk when one is
        missing or short."""
        if self._store.parallel:
            return None
        from tierstore.tiers.chunk_map import map_chunks  # (ctypes and mmap: local tiers only)

        def open_chunk(index: int, digest: str) -> IO[bytes]:
            try:
                f = self._store.backend.open_read(chunk_path(digest))
            except FileNotFoundError:
                self._store.forget(digest)
                raise MissingChunk(f"{self.name}: chunk {digest} is missing from the tier's "
                                   f"chunk store") from None
            if not hasattr(f, "fileno"):
                f.close()
                raise io.UnsupportedOperation("a chunk's file has no descriptor")
            return f

        try:
            return map_chunks(list(self._recipe.chunks), open_chunk, self.name)
        except io.UnsupportedOperation:
            return None
        except MissingChunk:
            raise
        except OSError as exc:
            raise MissingChunk(f"{exc}; the chunk store is damaged (run `tierstore scrub "
                               f"--repair`)") from None

    def _chunk_at(self, pos: int) -> int:
        return bisect.bisect_right(self._starts, pos) - 1

    def _chunk_file(self, index: int, digest: str) -> IO[bytes]:
        if self._open is not None and self._open[0] == index:
            return self._open[1]
        self._close_chunk()
        try:
            f = self._store.backend.open_read(chunk_path(digest))
        except FileNotFoundError:
            self._store.forget(digest)
            raise MissingChunk(
                f"{self.name}: chunk {digest} is missing from the tier's chunk store") from None
        self._open = (index, f)
        return f

    def _close_chunk(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None

    def close(self) -> None:
        self._close_chunk()
        for future in self._ahead.values():
            future.cancel()
        self._ahead.clear()
        super().close()
