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

The bins are in the tier's directory, where a name may be replaced between two calls, so the
recycler never follows a link there (:mod:`.safe_fs`): ``.recycle`` and each bin are opened
link-free from the root's descriptor (a ``.recycle`` that is a link is neither freed nor used:
evicted files are then deleted as usual), a dead bin is removed by the descriptor-based
``shutil.rmtree``, and a file is taken from the bin only when it is, by its device and inode,
one this process put there (a link or another file put in its place is dropped from the bin,
never written into).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import uuid
from typing import TYPE_CHECKING

from tierstore.plugin import DescriptorEnd, IntegrityError, map_populated, MappedFile, WrittenFile

from .ownership import DIR_MODE
from .safe_fs import (TierTree, mapped_end, open_dir_at, open_regular_at, remove_at,
                      written_end)

if TYPE_CHECKING:  # torch is imported where a tensor is made: `tierstore ls` loads none
    import torch

__all__ = ["MappedEnd", "PageRecycler", "RECYCLE_DIR"]

#: directory (under a backend root) of the files kept for reuse
RECYCLE_DIR = ".recycle"

log = logging.getLogger("tierstore.recycle")


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
    """The recycle bin and the mappings of one backend directory, ``tree`` (see the module
    docstring)."""

    def __init__(self, tree: TierTree):
        self._tree = tree
        self._bins = os.path.join(tree.root, RECYCLE_DIR)  # for messages; never opened by path
        self._lock = threading.Lock()
        self._maps: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}  # key -> (fd, data)
        # Files this process wrote: (st_dev, st_ino) -> file name. The name guards against a
        # stale key whose inode number the filesystem gave to another process's new file (DCP
        # names files by rank, and every replica directory has one holder).
        self._own: dict[tuple[int, int], str] = {}
        self._closed = False
        #: this process's bin (made, and locked, when something is first recycled)
        self.bin = os.path.join(self._bins, f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._bin_fd: int | None = None  # the bin, holding its lock
        self._bins_fd: int | None = None  # .recycle, where the bin is
        # Dead processes' bins are freed at this process's first write here, not when the tier
        # is opened: a reading command (`tierstore ls` beside a job) must change nothing.
        self._dead_bins_freed = False

    def owns(self, fd: int, path: str) -> None:
        """Record the open file ``fd`` at ``path`` as written by this process (it may be
        recycled)."""
        with self._lock:
            if not self._closed:
                self._first_write()
                self._own[_key(os.fstat(fd))] = os.path.basename(path)

    def recycle(self, dir_fd: int) -> None:
        """The directory open as ``dir_fd`` is evicted: move this process's files directly in
        it into the bin (which first frees what it held); the caller deletes the rest."""
        with self._lock:
            if self._closed:
                return
            self._forget_unlinked()
            found = self._own_files(dir_fd)
            if not found:
                return
            self._free_bin()
            if self._bin_fd is None:
                try:
                    self.bin, self._bins_fd, self._bin_fd = _locked_bin(self._tree)
                except (OSError, IntegrityError) as exc:
                    log.warning("not recycling evicted files in %s (they are deleted): %s",
                                self._bins, exc)
                    for _, key, _ in found:  # deleted by the caller: no longer this one's
                        self._own.pop(key, None)
                        self._unmap(key)
                    return
            for i, (name, _, size) in enumerate(found):
                try:
                    os.replace(name, f"{i}-{size}", src_dir_fd=dir_fd, dst_dir_fd=self._bin_fd)
                except OSError:
                    pass  # gone meanwhile: the caller's delete has nothing more to do

    def forget(self, dir_fd: int) -> None:
        """The directory open as ``dir_fd`` is deleted (not recycled): stop tracking this
        process's files in it."""
        with self._lock:
            self._forget_unlinked()
            for _, key, _ in self._own_files(dir_fd):
                self._own.pop(key, None)
                self._unmap(key)

    def take_for_write(self, dir_fd: int, name: str) -> int | None:
        """Move the largest recycled file to ``name`` in the directory open as ``dir_fd``, to
        be written over from its start, and return it open for writing; None when the bin
        holds none. Whoever writes it calls :meth:`truncate` with the length written."""
        with self._lock:
            self._first_write()
            self._forget_unlinked()
            sizes = [] if self._closed else self._bin_sizes()
            while sizes:
                biggest = max(sizes)
                sizes.remove(biggest)
                fd = self._take(biggest[1], dir_fd, name)
                if fd is not None:
                    return fd
            return None

    def truncate(self, fd: int, length: int) -> None:
        """Cut or extend the open file ``fd`` to ``length`` bytes, dropping this recycler's
        mapping of it first when the size changes."""
        st = os.fstat(fd)
        if st.st_size != length:
            with self._lock:
                self._unmap(_key(st))
            os.ftruncate(fd, length)

    def receiving_end(self, dir_fd: int, name: str, path: str, size: int
                      ) -> WrittenFile | MappedEnd:
        """Where to receive a file of ``size`` bytes as ``name`` in the directory open as
        ``dir_fd`` (OS path ``path``, for messages): the pages of the largest recycled file not
        larger than that, grown and kept mapped, or a new file written piece by piece when none
        fits. A link at ``name`` is OSError ELOOP."""
        with self._lock:
            self._forget_unlinked()
            fits = [] if self._closed else [
                (got, binned) for got, binned in self._bin_sizes() if got <= size]
            while fits:
                best = max(fits)
                fits.remove(best)
                fd = self._take(best[1], dir_fd, name)
                if fd is not None:
                    try:
                        return self._end(fd, path, size, grow=True)
                    finally:
                        os.close(fd)
            end = written_end(open_regular_at(dir_fd, name, os.O_WRONLY | os.O_CREAT
                                              | os.O_TRUNC), path, size)
            if not self._closed:
                self._own[_key(os.fstat(end.fileno()))] = name
            return end

    def sending_end(self, fd: int, path: str, size: int) -> MappedFile | MappedEnd:
        """The open file ``fd`` (OS path ``path``, ``size`` bytes, opened for reading and
        writing), mapped and kept mapped, to send; ``fd`` stays the caller's."""
        with self._lock:
            if self._closed:
                return mapped_end(os.dup(fd), path, size)
            self._forget_unlinked()
            return self._end(fd, path, size, grow=False)

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
                remove_at(self._bins_fd, os.path.basename(self.bin))
                os.close(self._bin_fd)  # releases the bin's lock
                os.close(self._bins_fd)
                self._bin_fd = self._bins_fd = None

    # -- under the lock ---------------------------------------------------------------------
    def _own_files(self, dir_fd: int) -> list[tuple[str, tuple[int, int], int]]:
        """(name, key, size) of this process's files directly in the directory open as
        ``dir_fd`` (links are no one's files)."""
        found = []
        try:
            entries = list(os.scandir(dir_fd))
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
                found.append((entry.name, _key(st), st.st_size))
        return found

    def _take(self, name: str, dir_fd: int, dst: str) -> int | None:
        """Move bin file ``name`` to ``dst`` in the directory open as ``dir_fd`` and return it
        open for reading and writing; it is this process's file under its new name. None
        when it is no file this process put in the bin (a link, or another file put in its
        place: dropped from the bin, never written into) or it went meanwhile."""
        try:
            fd = open_regular_at(self._bin_fd, name, os.O_RDWR)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.EINVAL, errno.EISDIR, errno.ENXIO):
                raise
            fd = None
        key = _key(os.fstat(fd)) if fd is not None else None
        if key is None or key not in self._own:
            if fd is not None:
                os.close(fd)
            _drop(self._bin_fd, name)
            return None
        try:
            os.replace(name, dst, src_dir_fd=self._bin_fd, dst_dir_fd=dir_fd)
            moved = _key(os.stat(dst, dir_fd=dir_fd, follow_symlinks=False))
        except OSError:
            os.close(fd)
            return None
        if moved != key:  # the bin's entry was swapped after it was opened: not ours either
            os.close(fd)
            _drop(dir_fd, dst)
            return None
        self._own[key] = dst
        return fd

    def _bin_sizes(self) -> list[tuple[int, str]]:
        """(size, name) of the files in the bin (their names end in their size)."""
        out = []
        for name in (os.listdir(self._bin_fd) if self._bin_fd is not None else []):
            size = name.rsplit("-", 1)[-1]
            if size.isdigit():
                out.append((int(size), name))
        return out

    def _end(self, fd: int, path: str, size: int, *, grow: bool) -> MappedEnd:
        """A :class:`MappedEnd` over the open file ``fd`` (read and write; OS path ``path``)
        with ``size`` bytes, from the kept mapping (made on first use; ``grow``: extend a
        shorter file to ``size`` first); ``fd`` stays the caller's."""
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
            if size:
                data = map_populated(fd, size, writable=True)
            else:
                import torch

                data = torch.empty(0, dtype=torch.uint8)
            kept = self._maps[key] = (os.dup(fd), data)
        return MappedEnd(kept[1], fd)

    def _free_bin(self) -> None:
        for _, name in self._bin_sizes():
            try:
                key = _key(os.stat(name, dir_fd=self._bin_fd, follow_symlinks=False))
                os.unlink(name, dir_fd=self._bin_fd)
            except OSError:
                continue
            self._unmap(key)
            self._own.pop(key, None)

    def _first_write(self) -> None:
        """At this process's first write in the tier (under ``_lock``): free the dead bins."""
        if not self._dead_bins_freed:
            self._dead_bins_freed = True
            self._free_dead_bins()

    def _free_dead_bins(self) -> None:
        """Free the bins no live process holds locked (a crashed job's recycled pages): the
        directories in ``.recycle``, itself no link, reached and removed link-free."""
        try:
            root_fd = self._tree.open_root()
        except (OSError, IntegrityError):
            return  # no tier directory yet, or one refused (check_reachable says why)
        try:
            bins_fd = open_dir_at(root_fd, RECYCLE_DIR)
        except OSError:
            return  # no bins; or .recycle is a link or a file, which is no bin of ours
        finally:
            os.close(root_fd)
        try:
            mine = os.path.basename(self.bin)
            for name in os.listdir(bins_fd):
                if name == mine:
                    continue
                try:
                    fd = open_dir_at(bins_fd, name)
                except OSError:
                    continue  # a link or a file: no bin
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # its process lives
                else:
                    remove_at(bins_fd, name)
                finally:
                    os.close(fd)
        finally:
            os.close(bins_fd)

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


def _drop(dir_fd: int, name: str) -> None:
    """Unlink ``name`` from the directory open as ``dir_fd`` (a link goes, not its target)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def _locked_bin(tree: TierTree) -> tuple[str, int, int]:
    """A new bin directory in ``.recycle`` under ``tree``'s root: its OS path, a descriptor of
    ``.recycle`` and one of the bin holding its lock for the life of this process (the lock,
    unlike a pid, says for sure whether its owner lives). IntegrityError when ``.recycle`` is
    a link."""
    root_fd = tree.open_root(create=True)
    try:
        try:
            bins_fd = open_dir_at(root_fd, RECYCLE_DIR, create=True)
        except OSError as exc:
            raise tree.refusal(root_fd, RECYCLE_DIR, RECYCLE_DIR, exc) from None
    finally:
        os.close(root_fd)
    try:
        while True:
            name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
            path = os.path.join(tree.root, RECYCLE_DIR, name)
            os.mkdir(name, DIR_MODE, dir_fd=bins_fd)
            fd = open_dir_at(bins_fd, name)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                return path, bins_fd, fd  # no flock here: the bin is freed by close() only
            try:
                if _key(os.stat(name, dir_fd=bins_fd, follow_symlinks=False)) == _key(
                        os.fstat(fd)):
                    return path, bins_fd, fd
            except FileNotFoundError:
                pass
            os.close(fd)  # another process took it for a dead bin before the lock: again
    except BaseException:
        os.close(bins_fd)
        raise
