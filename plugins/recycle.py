"""Reusing the pages of evicted files on tmpfs, and keeping them mapped.

On tmpfs a file's pages are its memory: writing a new file allocates and zeroes every page, and
mapping one fills a page-table entry per 4 KiB. Measured here (two ranks exchanging 256 MiB
each over gloo), receiving into a new file takes about twice as long as receiving into pages
that exist, and mapping the pages costs another quarter. A :class:`PageRecycler` keeps the
files of the last checkpoint its backend evicted (``keep``, through ``Backend.discard``) in a
bin under ``.recycle`` instead of freeing them, gives their pages to the next files written or
received, and keeps every file it mapped mapped while the file lives: after the first few
saves, saving, sending and receiving touch only pages that are already there.

The bin holds at most the files of one evicted checkpoint (older ones are freed when a newer
one arrives): between saves that is one checkpoint more than ``keep``, which is the peak anyway
while a new checkpoint is written beside the ones kept. ``close()`` frees it.

Reusing a file changes bytes that someone may still map or read, so:

- only eviction recycles: a checkpoint overwritten under the same id, an aborted save and
  ``gc`` delete their files as usual (a reader may still hold them open; unlinked, their pages
  stay theirs);
- the store never evicts a checkpoint that it is replicating or loading;
- each process recycles only the files it wrote or received itself (ranks of a node may share a
  tier directory, and another rank may still map its own file), into a bin of its own, locked
  while the process lives (``flock``; the next process frees a dead one's bin, whatever its
  pid namespace);
- a recycled file is grown (with its pages allocated: a full tmpfs is an ``OSError``, never a
  fault inside a transfer) before it is mapped, and is cut only after this process's mapping of
  it is dropped; a mapping handed out stays valid as long as its holder keeps it.

Readers outside the store (another job's ``dcp.load`` of a checkpoint as it is evicted) are not
protected: recycling rewrites an evicted checkpoint's files in place where deleting would have
left an open file intact. Point such readers at a tier without recycling (``memory``,
``local``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
import uuid

import torch

from tierstore.plugin import DescriptorEnd, map_populated, MappedFile, WrittenFile

__all__ = ["MappedEnd", "PageRecycler", "RECYCLE_DIR"]

#: directory (under a backend root) of the files kept for reuse
RECYCLE_DIR = ".recycle"


class MappedEnd(DescriptorEnd):
    """A file mapped whole, to send from or receive into: pieces are slices of the mapping.
    It holds the mapping and a descriptor of its own, so it stays valid whatever the recycler
    does meanwhile; closing it leaves the recycler's mapping for the file's next use."""

    def __init__(self, data: torch.Tensor, fd: int):
        self._data = data
        self._fd = os.dup(fd)

    def piece(self, offset: int, length: int) -> torch.Tensor:
        """A view of bytes ``[offset, offset + length)`` of the file."""
        return self._data[offset:offset + length]



class PageRecycler:
    """The recycle bin and the mappings of one backend directory (see the module docstring)."""

    def __init__(self, root: str):
        self._bins = os.path.join(root, RECYCLE_DIR)
        self._lock = threading.Lock()
        self._maps: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}  # key -> (fd, data)
        # Files this process wrote: (st_dev, st_ino) -> file name. The name guards against a
        # stale key whose inode number the filesystem gave to another process's new file (DCP
        # names files by rank, and every replica directory has one holder).
        self._own: dict[tuple[int, int], str] = {}
        self._closed = False
        #: this process's bin (made, and locked, when something is first recycled)
        self.bin = os.path.join(self._bins, f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._bin_fd: int | None = None
        self._free_dead_bins()

    def owns(self, fd: int, path: str) -> None:
        """Record the open file ``fd`` at ``path`` as written by this process (it may be
        recycled)."""
        with self._lock:
            if not self._closed:
                self._own[_key(os.fstat(fd))] = os.path.basename(path)

    def recycle(self, directory: str) -> None:
        """``directory`` is evicted: move this process's files directly under it into the bin
        (which first frees what it held); the caller deletes the rest."""
        with self._lock:
            if self._closed:
                return
            self._forget_unlinked()
            files = [(path, size) for path, key, size in self._own_files(directory)]
            if not files:
                return
            self._free_bin()
            if self._bin_fd is None:
                self.bin, self._bin_fd = _locked_bin(self._bins)
            for i, (path, size) in enumerate(files):
                try:
                    os.replace(path, os.path.join(self.bin, f"{i}-{size}"))
                except OSError:
                    pass  # gone meanwhile: the caller's delete has nothing more to do

    def forget(self, directory: str) -> None:
        """``directory`` is deleted (not recycled): stop tracking this process's files in it."""
        with self._lock:
            self._forget_unlinked()
            for _, key, _ in self._own_files(directory):
                self._own.pop(key, None)
                self._unmap(key)

    def take_for_write(self, path: str) -> bool:
        """Move the largest recycled file to OS path ``path`` (parents must exist), to be
        written over from its start; False when the bin is empty. Whoever writes it calls
        :meth:`truncate` with the length written."""
        with self._lock:
            self._forget_unlinked()
            sizes = [] if self._closed else self._bin_sizes()
            if not sizes:
                return False
            self._take(max(sizes)[1], path)
            return True

    def truncate(self, fd: int, length: int) -> None:
        """Cut or extend the open file ``fd`` to ``length`` bytes, dropping this recycler's
        mapping of it first when the size changes."""
        st = os.fstat(fd)
        if st.st_size != length:
            with self._lock:
                self._unmap(_key(st))
            os.ftruncate(fd, length)

    def receiving_end(self, path: str, size: int) -> WrittenFile | MappedEnd:
        """Where to receive a file of ``size`` bytes at OS path ``path`` (parents must exist):
        the pages of the largest recycled file not larger than that, grown and kept mapped, or
        a new file written piece by piece when none fits."""
        with self._lock:
            self._forget_unlinked()
            fits = [] if self._closed else [
                (got, name) for got, name in self._bin_sizes() if got <= size]
            if not fits:
                end = WrittenFile(path, size)
                if not self._closed:
                    self._own[_key(os.fstat(end.fileno()))] = os.path.basename(path)
                return end
            self._take(max(fits)[1], path)
            return self._end(path, size, grow=True)

    def sending_end(self, path: str, size: int) -> MappedFile | MappedEnd:
        """The file at OS path ``path`` (``size`` bytes), mapped and kept mapped, to send."""
        with self._lock:
            if self._closed:
                return MappedFile(path, size)
            self._forget_unlinked()
            return self._end(path, size, grow=False)

    def close(self) -> None:
        """Free the bin and every mapping; later calls neither recycle nor keep mappings."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._free_bin()
            for key in list(self._maps):
                self._unmap(key)
            self._own.clear()
            if self._bin_fd is not None:
                shutil.rmtree(self.bin, ignore_errors=True)
                os.close(self._bin_fd)  # releases the bin's lock
                self._bin_fd = None

    # -- under the lock ---------------------------------------------------------------------
    def _own_files(self, directory: str) -> list[tuple[str, tuple[int, int], int]]:
        """(path, key, size) of this process's files directly under ``directory``."""
        found = []
        try:
            entries = list(os.scandir(directory))
        except OSError:
            return found
        for entry in entries:
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # removed meanwhile
            if self._own.get(_key(st)) == entry.name:
                found.append((entry.path, _key(st), st.st_size))
        return found

    def _take(self, name: str, path: str) -> None:
        """Move bin file ``name`` to ``path``; it is this process's file under its new name."""
        os.replace(os.path.join(self.bin, name), path)
        self._own[_key(os.stat(path))] = os.path.basename(path)

    def _bin_sizes(self) -> list[tuple[int, str]]:
        """(size, name) of the files in the bin (their names end in their size)."""
        out = []
        for name in (os.listdir(self.bin) if self._bin_fd is not None else []):
            size = name.rsplit("-", 1)[-1]
            if size.isdigit():
                out.append((int(size), name))
        return out

    def _end(self, path: str, size: int, *, grow: bool) -> MappedEnd:
        """A :class:`MappedEnd` over the file at ``path`` with ``size`` bytes, from the kept
        mapping (made on first use; ``grow``: extend a shorter file to ``size`` first)."""
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            key = _key(st)
            kept = self._maps.get(key)
            if kept is None or kept[1].numel() != size:
                self._unmap(key)
                if grow and st.st_size < size:
                    # Allocate the pages now: growing with ftruncate alone would leave a hole,
                    # and a full tmpfs would then fault (SIGBUS) inside the transfer.
                    os.posix_fallocate(fd, st.st_size, size - st.st_size)
                elif st.st_size < size:
                    raise OSError(f"{path} holds {st.st_size} bytes, fewer than the {size} "
                                  f"expected")
                data = (map_populated(fd, size, writable=True) if size
                        else torch.empty(0, dtype=torch.uint8))
                kept = self._maps[key] = (os.dup(fd), data)
            return MappedEnd(kept[1], fd)
        finally:
            os.close(fd)

    def _free_bin(self) -> None:
        for _, name in self._bin_sizes():
            path = os.path.join(self.bin, name)
            try:
                key = _key(os.stat(path))
                os.remove(path)
            except OSError:
                continue
            self._unmap(key)
            self._own.pop(key, None)

    def _free_dead_bins(self) -> None:
        """Free the bins no live process holds locked (a crashed job's recycled pages)."""
        try:
            names = os.listdir(self._bins)
        except OSError:
            return  # no bins (or no tier directory yet)
        for name in names:
            path = os.path.join(self._bins, name)
            if path == self.bin:
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its process lives
            else:
                shutil.rmtree(path, ignore_errors=True)
            finally:
                os.close(fd)

    def _forget_unlinked(self) -> None:
        """Drop mappings of files deleted behind our back (they would hold their memory)."""
        for key, (fd, _) in list(self._maps.items()):
            if os.fstat(fd).st_nlink == 0:
                self._unmap(key)
                self._own.pop(key, None)

    def _unmap(self, key: tuple[int, int]) -> None:
        kept = self._maps.pop(key, None)
        if kept is not None:
            os.close(kept[0])
            # The pages are unmapped when the last view goes (ends handed out keep theirs).


def _key(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _locked_bin(bins: str) -> tuple[str, int]:
    """A new bin directory under ``bins``, and a descriptor holding its lock for the life of
    this process (the lock, unlike a pid, says for sure whether its owner lives)."""
    os.makedirs(bins, exist_ok=True)
    while True:
        path = os.path.join(bins, f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.mkdir(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            return path, fd  # no flock on this filesystem: the bin is freed by close() only
        try:
            if _key(os.stat(path)) == _key(os.fstat(fd)):
                return path, fd
        except FileNotFoundError:
            pass
        os.close(fd)  # another process took it for a dead bin before the lock: again
