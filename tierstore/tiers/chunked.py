"""A deduplicated tier's view of its backend: DCP data files stored as chunks.

``dedup = true`` on a tier wraps its backend in a :class:`ChunkedBackend`. To everything above
it (saves, drains, loads, replication, verify, scrub, gc) a data file (``*.distcp``) looks as
it always did: written through ``open_write``, read through ``open_read``, listed with its size.
Below, the bytes go to the tier's chunk store (:mod:`tierstore.tiers.chunks`) and the file is a
small *recipe* (:mod:`tierstore.format.chunk_recipe`) in its checkpoint's directory. A chunk the
store holds already is not written again: a save, a drain or a repair writes only what the tier
lacks.

Chunks are cut where each of the file's items starts (the save tells the file as it writes,
:meth:`ChunkingFile.start_item`; a drain passes the offsets the manifest recorded,
:meth:`ChunkingFile.set_cuts`) and every ``CHUNK_BYTES`` after: an unchanged tensor has the same
chunks from one checkpoint to the next, whatever changed beside it (``CHUNK_BYTES`` on a
filesystem, ``OBJECT_CHUNK_BYTES`` on an object store, where each chunk is a request). Every other file (the
manifest, ``.metadata``, markers, leases) is the backend's own, untouched, and so is a data file
written whole before the tier had ``dedup`` (it is read as it is).
"""

from __future__ import annotations

import collections
import io
import posixpath
import threading
from concurrent.futures import Future
from typing import IO, Any, Callable

from tierstore.format.checksum import Hasher
from tierstore.format.chunk_recipe import (Recipe, RecipeName, parse_recipe, parse_recipe_name,
                                           recipe_name)
from tierstore.plugin.bases import Backend, DirectoryLock
from tierstore.tiers.chunks import (CHUNK_BYTES, CHUNKS_DIR, OBJECT_CHUNK_BYTES, ChunkStore,
                                    Collected)

__all__ = ["ChunkedBackend", "ChunkingFile", "is_chunked_name"]

#: the files a deduplicated tier stores as chunks: DCP's data files (and a drain's partial
#: copy of one, renamed into place once whole)
_CHUNKED_SUFFIXES = (".distcp", ".distcp.part")
#: chunks of one file written at once to an object store (each a request of its own)
_IN_FLIGHT = 8
#: the chunk store's threads for an object store's writes, shared by every file
_POOL_THREADS = 16


def is_chunked_name(path: str) -> bool:
    """Whether a deduplicated tier stores the file ``path`` as chunks."""
    return path.endswith(_CHUNKED_SUFFIXES)


def _split(path: str) -> tuple[str, str]:
    directory, _, name = path.rpartition("/")
    return directory, name


def _join(directory: str, name: str) -> str:
    return f"{directory}/{name}" if directory else name


class ChunkingFile(io.RawIOBase):
    """A data file being written to a deduplicated tier: its bytes are cut into chunks, each
    written to the chunk store unless there already, and its recipe is written on
    :meth:`close` (replacing the file's former recipe)."""

    def __init__(self, view: "ChunkedBackend", path: str):
        super().__init__()
        self._view, self._path = view, path
        self._store = view.chunks
        self._hold = self._store.hold()
        if self._store.parallel:
            try:
                view.learn_chunks_of(path)
            except BaseException:
                self._hold.release()  # (a leaked hold would keep every collection away)
                raise
        self._buf = bytearray()
        self._chunk_start = 0  # offset of the chunk being gathered
        self._item_start = 0
        self._planned: collections.deque[int] = collections.deque()  # item starts ahead
        self._chunks: list[tuple[int, str]] = []
        #: bytes this file wrote to the chunk store (the rest was there already)
        self.new_bytes = 0
        self._done = False
        self._recheck = False
        # chunks being written on the store's pool, at most _IN_FLIGHT of this file's at once
        self._pending: list[Future] = []
        self._room = threading.BoundedSemaphore(_IN_FLIGHT)

    def writable(self) -> bool:
        return True

    def set_cuts(self, cuts: list[int] | None) -> None:
        """The offsets where the file's items start, known up front (a copy of a file whose
        manifest entry recorded them)."""
        self._planned = collections.deque(sorted(c for c in (cuts or [])
                                                 if c > self._chunk_start))

    def recheck_chunks(self) -> None:
        """Read back each chunk the store holds already and write it again unless its bytes
        match its name (a repair: the copy it replaces may be bad because a chunk is)."""
        self._recheck = True

    def start_item(self) -> None:
        """An item starts at the current offset: the chunk gathered so far ends here."""
        self._emit_buffer()
        self._item_start = self._chunk_start

    def _boundary(self) -> int:
        """Where the chunk being gathered ends at the latest."""
        step = self._store.chunk_bytes
        done = self._chunk_start - self._item_start
        end = self._item_start + (done // step + 1) * step
        return min(end, self._planned[0]) if self._planned else end

    def write(self, data) -> int:
        if self._done:
            raise ValueError(f"write to {self._path} after it was closed")
        view = memoryview(data).cast("B")
        n = len(view)
        while view:
            room = self._boundary() - self._chunk_start - len(self._buf)
            take = view[:room]
            view = view[len(take):]
            if not self._buf and len(take) == room:
                self._emit(take)  # a whole chunk of the caller's bytes, not copied
            else:
                self._buf += take
                if len(take) == room:  # the chunk is whole
                    self._emit_buffer()
        return n

    def _emit_buffer(self) -> None:
        if self._buf:
            data, self._buf = self._buf, bytearray()
            self._emit(memoryview(data))

    def _emit(self, data: memoryview) -> None:
        hasher = self._store.new_hasher()
        hasher.update(data)
        digest = hasher.hexdigest()
        if self._store.parallel:
            self._check_pending()
            self._room.acquire()
            # (a copy: the caller reuses its buffer once write() returns)
            future = self._store.submit(digest, bytes(data), self._recheck)
            future.add_done_callback(lambda _f: self._room.release())
            self._pending.append(future)
        else:
            self.new_bytes += self._store.ensure(digest, data, self._recheck)
        self._chunks.append((len(data), digest))
        self._chunk_start += len(data)
        while self._planned and self._planned[0] <= self._chunk_start:
            if self._planned[0] == self._chunk_start:
                self._item_start = self._chunk_start
            self._planned.popleft()

    def tell(self) -> int:
        return self._chunk_start + len(self._buf)

    def close(self) -> None:
        """Write the last chunk and the file's recipe, then let go of the chunk store.
        Idempotent."""
        if self._done:
            return
        self._done = True
        try:
            self._emit_buffer()
            self._finish_pending()
            recipe = Recipe(self._chunk_start, tuple(self._chunks))
            self._view.put_recipe(self._path, recipe)
        finally:
            for future in self._pending:  # (after a failure: let the others end first)
                future.exception()
            self._hold.release()
            super().close()

    def _check_pending(self) -> None:
        """Raise the first failure of a chunk written so far; count what the done ones
        wrote."""
        done = [f for f in self._pending if f.done()]
        for future in done:
            self.new_bytes += future.result()
        if done:
            self._pending = [f for f in self._pending if not f.done() or f not in done]

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, []
        try:
            for future in pending:
                self.new_bytes += future.result()
        finally:
            self._pending = pending


class ChunkedBackend(Backend):
    """The deduplicating view of a tier's backend (see the module's docstring)."""

    def __init__(self, inner: Backend, new_hasher: Callable[[], Hasher]):
        self.inner = inner
        self.root = inner.root
        # An object store (no local path) writes chunks many at once, and larger ones (each
        # is a request); a filesystem, in line.
        remote = inner.local_path("") is None
        self.chunks = ChunkStore(inner, new_hasher, parallel=_POOL_THREADS if remote else 0,
                                 chunk_bytes=OBJECT_CHUNK_BYTES if remote else CHUNK_BYTES)
        # What the core asks of a backend's class, answered as the real one does; a bulk
        # upload would store whole files.
        self.supports_rename = inner.supports_rename
        self.durable = inner.durable
        self.locks_write = inner.locks_write
        self.default_commit = inner.default_commit
        self.bulk_upload = False
        # A peer tier's: its replicas live in backends beside it (replica_backend), which
        # the core wraps in their own deduplicating view.
        self.replication = inner.replication
        self._has_inventory: bool | None = None

    def __getattr__(self, name: str) -> Any:
        # A backend's own extras (its leases, a parity backend) are the real one's.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- recipes ---------------------------------------------------------------------------
    def _recipes_in(self, directory: str) -> dict[str, list[RecipeName]]:
        """The recipes of directory ``directory``, by the file each stands for."""
        out: dict[str, list[RecipeName]] = {}
        for entry in self.inner.list(directory):
            parsed = parse_recipe_name(entry)
            if parsed is not None:
                out.setdefault(parsed.name, []).append(parsed)
        return out

    def _recipe_of(self, path: str) -> RecipeName | None:
        directory, name = _split(path)
        found = self._recipes_in(directory).get(name)
        return found[0] if found else None

    def put_recipe(self, path: str, recipe: Recipe) -> None:
        """Write ``recipe`` as the file ``path``, in place of any recipe it had."""
        directory, name = _split(path)
        self._remove_recipes(path)
        self.inner.write_bytes(_join(directory, str(recipe_name(name, recipe.size))),
                               recipe.to_bytes())

    def _remove_recipes(self, path: str) -> None:
        directory, name = _split(path)
        for old in self._recipes_in(directory).get(name, []):
            self.inner.delete(_join(directory, str(old)))

    def read_recipe(self, path: str, found: RecipeName | None = None) -> Recipe:
        """The recipe of data file ``path`` (FileNotFoundError when it has none), checked."""
        found = found or self._recipe_of(path)
        if found is None:
            raise FileNotFoundError(f"{self.describe().rstrip('/')}/{path} is not there")
        directory, _ = _split(path)
        where = _join(directory, str(found))
        return parse_recipe(self.inner.read_bytes(where), found.size,
                            f"{self.describe().rstrip('/')}/{where}")

    def _inventory_outside_chunks(self) -> dict[str, int] | None:
        """The real backend's :meth:`inventory` of the whole tier but the chunk store: one
        listing of the root's entries, then one of each entry's but the store's (a listing of
        the whole prefix would list every chunk of every checkpoint: about one key per MiB
        stored, where a restart asks only for what the checkpoints hold); None where the
        backend has no inventory."""
        if self._has_inventory is False or self.inner.local_path("") is not None:
            return None  # (a filesystem: a stat per file costs nothing remote)
        out: dict[str, int] = {}
        for entry in self.inner.list(""):
            if entry == CHUNKS_DIR:
                continue
            sizes = self.inner.inventory(entry)
            if sizes is None:
                self._has_inventory = False
                return None
            if not sizes:  # a file at the root (or an empty directory)
                size = self.inner.size(entry)
                if size is not None:
                    out[entry] = size
                continue
            out.update({f"{entry}/{k}": v for k, v in sizes.items()})
        return out

    def learn_chunks_of(self, path: str) -> None:
        """An object store's writer of data file ``path``: tell the chunk store of the chunks
        the tier's other copies of a file of that name hold (the same file of the checkpoints
        there: what a save of it shares), one listing of the root and one recipe per
        checkpoint not looked at before. Only under the chunk store's hold."""
        name = _split(path)[1].removesuffix(".part")
        for entry in self.chunks.root_entries():
            if entry.startswith(".") or f"{entry}/{name}" in self.chunks.learned:
                continue
            found = self._recipes_in(entry).get(name)
            self.chunks.learned.add(f"{entry}/{name}")
            if not found:
                continue
            try:
                recipe = self.read_recipe(f"{entry}/{name}", found[0])
            except (FileNotFoundError, ValueError):  # gone, or a damaged recipe: learn nothing
                continue
            self.chunks.learn(d for _, d in recipe.chunks)

    def recipe_paths(self) -> list[str]:
        """Every recipe on the tier, in whatever directory (checkpoints, staging, trash)."""
        sizes = self._inventory_outside_chunks()
        if sizes is not None:
            return [k for k in sizes if parse_recipe_name(posixpath.basename(k)) is not None]
        out = []
        for entry in self.inner.list(""):
            if entry == CHUNKS_DIR:
                continue
            for name in self.inner.list(entry):
                if parse_recipe_name(name) is not None:
                    out.append(f"{entry}/{name}")
        return out

    def collect_chunks(self, force: bool = False,
                       announce: Callable[[int], None] = lambda n: None) -> Collected:
        """Remove the chunks no recipe on the tier names (see :mod:`tierstore.tiers.chunks`);
        unless ``force`` (the operator's ``gc``), only when a pass is due there."""
        if not force and not self.chunks.due():
            return Collected(False)
        return self.chunks.collect(self.recipe_paths, announce)

    # -- the backend's primitives, data files as chunks ------------------------------------
    def check_reachable(self) -> str | None:
        return self.inner.check_reachable()

    def open_write(self, path: str) -> IO[bytes]:
        if is_chunked_name(path):
            return ChunkingFile(self, path)  # type: ignore[return-value]
        return self.inner.open_write(path)

    def open_read(self, path: str) -> IO[bytes]:
        if is_chunked_name(path):
            found = self._recipe_of(path)
            if found is not None:
                return self.chunks.open(self.read_recipe(path, found),  # type: ignore[return-value]
                                        path)
        # Every other file, and a data file written whole (before dedup was turned on).
        return self.inner.open_read(path)

    def open_read_sized(self, path: str, size: int) -> IO[bytes]:
        if is_chunked_name(path):
            # The size (from the manifest) names the recipe: read it without a listing.
            try:
                return self.chunks.open(  # type: ignore[return-value]
                    self.read_recipe(path, recipe_name(_split(path)[1], size)), path)
            except FileNotFoundError:
                return self.open_read(path)  # written whole, or of another size
        return self.inner.open_read_sized(path, size)

    def size(self, path: str) -> int | None:
        if is_chunked_name(path):
            found = self._recipe_of(path)
            if found is not None:
                return found.size
        return self.inner.size(path)

    def list(self, path: str) -> list[str]:
        names = set()
        for entry in self.inner.list(path):
            if not path and entry == CHUNKS_DIR:
                continue
            parsed = parse_recipe_name(entry)
            names.add(parsed.name if parsed is not None else entry)
        return sorted(names)

    def inventory(self, path: str) -> dict[str, int] | None:
        sizes = self._inventory_outside_chunks() if not path else self.inner.inventory(path)
        if sizes is None:
            return None
        out = {}
        for key, size in sizes.items():
            directory, name = _split(key)
            parsed = parse_recipe_name(name)
            if parsed is not None:
                out[_join(directory, parsed.name)] = parsed.size
            else:
                out[key] = size
        return out

    def makedirs(self, path: str) -> None:
        self.inner.makedirs(path)

    def delete(self, path: str) -> None:
        if is_chunked_name(path):
            self._remove_recipes(path)
        self.inner.delete(path)  # (missing is no error: a data file written whole, or none)

    def discard(self, path: str) -> None:
        self.inner.discard(path)

    def rename(self, src: str, dst: str, *, replace: bool = False) -> None:
        if not is_chunked_name(src):
            self.inner.rename(src, dst, replace=replace)
            return
        found = self._recipe_of(src)
        if found is None:  # a data file written whole
            self.inner.rename(src, dst, replace=replace)
            return
        if self._recipe_of(dst) is not None:
            if not replace:
                raise FileExistsError(f"{self.describe().rstrip('/')}/{dst} exists")
            self._remove_recipes(dst)
        src_dir, _ = _split(src)
        dst_dir, dst_name = _split(dst)
        self.inner.rename(_join(src_dir, str(found)),
                          _join(dst_dir, str(RecipeName(dst_name, found.size))),
                          replace=replace)

    def lock_directory(self, path: str, *, exclusive: bool) -> DirectoryLock | None:
        return self.inner.lock_directory(path, exclusive=exclusive)

    def claim(self, job: str) -> DirectoryLock | str:
        return self.inner.claim(job)

    def claimed_by(self, job: str) -> str | None:
        return self.inner.claimed_by(job)

    def sync_dir(self, path: str) -> None:
        self.inner.sync_dir(path)

    def local_path(self, path: str) -> str | None:
        # A data file here is no file of the OS: it is read through open_read.
        return None if is_chunked_name(path) else self.inner.local_path(path)

    def close(self) -> None:
        self.chunks.close()
        self.inner.close()

    def sending_end(self, path: str, size: int):
        return None if is_chunked_name(path) else self.inner.sending_end(path, size)

    def receiving_end(self, path: str, size: int):
        if is_chunked_name(path):
            raise NotImplementedError("a deduplicated tier receives no peer transfers")
        return self.inner.receiving_end(path, size)

    def write_bytes(self, path: str, data: bytes) -> None:
        if is_chunked_name(path):
            super().write_bytes(path, data)
        else:
            self.inner.write_bytes(path, data)

    def read_bytes(self, path: str) -> bytes:
        if is_chunked_name(path):
            return super().read_bytes(path)
        return self.inner.read_bytes(path)

    def free_bytes(self) -> int | None:
        return self.inner.free_bytes()

    def replica_backend(self, src: int, holder: int) -> Backend:
        return self.inner.replica_backend(src, holder)

    def replica_sets(self) -> list[tuple[int, int]]:
        return self.inner.replica_sets()

    def describe(self) -> str:
        return self.inner.describe()
