"""Reusing the pages of dropped files on tmpfs, and keeping them mapped.

On tmpfs a file's pages are its memory: writing a new file allocates and zeroes every page, and
mapping one fills a page-table entry per 4 KiB. Measured here (two ranks exchanging 256 MiB
each over gloo), receiving into a new file takes about twice as long as receiving into pages
that exist, and mapping the pages costs another quarter. A :class:`PageRecycler` keeps the
files of the last directory its backend dropped (``keep`` evicting the oldest checkpoint, an
aborted staging directory) in a ``.recycle`` directory instead of freeing them, gives their
pages to the next files written or received, and keeps every file it mapped mapped while the
file lives: after the first few saves, saving, sending and receiving touch only pages that are
already there.

The bin holds at most the files of one dropped directory (older ones are freed when a newer
one arrives): between saves that is one checkpoint more than ``keep``, which is the peak anyway
while a new checkpoint is written beside the ones kept. ``close()`` frees it.

Reusing a file changes bytes that someone may still map, so: each process has a bin of its
own (``.recycle/<pid>``; a dead process's bin is freed by the next one) and recycles only the
files it wrote or received itself (ranks of a node may share a tier directory, and another
rank's file is deleted as usual); the store never evicts a checkpoint that is being replicated
or loaded; and a recycled file is grown to its new size before it is mapped, never cut below a
mapping of this process.
"""

from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass

import torch

from tierstore.mapped import WrittenFile, map_populated

__all__ = ["PageRecycler", "RECYCLE_DIR"]

#: directory (under a backend root) of the files kept for reuse
RECYCLE_DIR = ".recycle"


@dataclass
class _Mapping:
    fd: int
    data: torch.Tensor  # the whole file, mapped shared


class MappedEnd:
    """A file this recycler keeps mapped, to send from or receive into: pieces are slices."""

    def __init__(self, mapping: _Mapping):
        self._mapping = mapping

    def piece(self, offset: int, length: int) -> torch.Tensor:
        """A view of bytes ``[offset, offset + length)`` of the file."""
        return self._mapping.data[offset:offset + length]

    def close(self, fsync: bool = False) -> None:
        """The mapping stays (the recycler's); ``fsync`` flushes what was written."""
        if fsync:
            os.fsync(self._mapping.fd)


class PageRecycler:
    """The recycle bin and the mappings of one backend directory (see the module docstring)."""

    def __init__(self, root: str):
        self._bins = os.path.join(root, RECYCLE_DIR)
        self.bin = os.path.join(self._bins, str(os.getpid()))
        self._lock = threading.Lock()
        self._maps: dict[tuple[int, int], _Mapping] = {}  # (st_dev, st_ino) -> mapping
        self._own: set[tuple[int, int]] = set()  # files this process wrote or received
        self._free_dead_bins()

    def owns(self, fd: int) -> None:
        """Record the open file ``fd`` as written by this process (it may be recycled)."""
        st = os.fstat(fd)
        with self._lock:
            self._own.add((st.st_dev, st.st_ino))

    def recycle(self, directory: str) -> None:
        """Move this process's files directly under ``directory`` into the bin (which first
        frees what it held); the caller deletes the rest."""
        files = []
        with self._lock:
            for entry in os.scandir(directory):
                if entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    if (st.st_dev, st.st_ino) in self._own:
                        files.append((entry.path, st.st_size))
            if not files:
                return
            self._free_bin()
            os.makedirs(self.bin, exist_ok=True)
            for i, (path, size) in enumerate(files):
                os.replace(path, os.path.join(self.bin, f"{i}-{size}"))

    def take_for_write(self, path: str) -> bool:
        """Move the largest recycled file to OS path ``path`` (parents must exist), to be
        written over from its start; False when the bin is empty. Whoever writes it calls
        :meth:`truncate` with the length written."""
        with self._lock:
            sizes = self._bin_sizes()
            if not sizes:
                return False
            os.replace(os.path.join(self.bin, max(sizes)[1]), path)
            return True

    def truncate(self, fd: int, length: int) -> None:
        """Cut or extend the open file ``fd`` to ``length`` bytes, dropping its mapping first
        when the size changes (a mapping past the end would fault)."""
        st = os.fstat(fd)
        if st.st_size != length:
            with self._lock:
                self._unmap((st.st_dev, st.st_ino))
            os.ftruncate(fd, length)

    def receiving_end(self, path: str, size: int) -> WrittenFile | MappedEnd:
        """Where to receive a file of ``size`` bytes at OS path ``path`` (parents must exist):
        the pages of the largest recycled file not larger than that, kept mapped (it is only
        grown, never cut), or a new file written piece by piece when none fits."""
        with self._lock:
            self._forget_unlinked()
            fits = [(got, name) for got, name in self._bin_sizes() if got <= size]
            if not fits:
                end = WrittenFile(path, size)
                st = os.fstat(end.fileno())
                self._own.add((st.st_dev, st.st_ino))
                return end
            os.replace(os.path.join(self.bin, max(fits)[1]), path)
            return MappedEnd(self._mapped(path, size, grow=True))

    def sending_end(self, path: str, size: int) -> MappedEnd:
        """The file at OS path ``path`` (``size`` bytes), mapped and kept mapped, to send."""
        with self._lock:
            self._forget_unlinked()
            return MappedEnd(self._mapped(path, size, grow=False))

    def close(self) -> None:
        """Free the bin and every mapping."""
        with self._lock:
            self._free_bin()
            for key in list(self._maps):
                self._unmap(key)

    # -- under the lock ---------------------------------------------------------------------
    def _bin_sizes(self) -> list[tuple[int, str]]:
        """(size, name) of the files in the bin (their names end in their size)."""
        out = []
        for name in (os.listdir(self.bin) if os.path.isdir(self.bin) else []):
            size = name.rsplit("-", 1)[-1]
            if size.isdigit():
                out.append((int(size), name))
        return out

    def _mapped(self, path: str, size: int, *, grow: bool) -> _Mapping:
        """The kept mapping of the file at ``path`` with ``size`` bytes (made on first use;
        ``grow``: extend a shorter file to ``size`` first)."""
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        mapping = self._maps.get(key)
        if mapping is not None and mapping.data.numel() == size:
            return mapping
        self._unmap(key)
        fd = os.open(path, os.O_RDWR)
        try:
            if grow and st.st_size < size:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise OSError(f"{path} holds {st.st_size} bytes, fewer than the {size} expected")
            mapping = _Mapping(fd, map_populated(fd, size, writable=True) if size
                               else torch.empty(0, dtype=torch.uint8))
        except BaseException:
            os.close(fd)
            raise
        self._maps[key] = mapping
        return mapping

    def _free_bin(self) -> None:
        for _, name in self._bin_sizes():
            path = os.path.join(self.bin, name)
            st = os.stat(path)
            key = (st.st_dev, st.st_ino)
            self._unmap(key)
            self._own.discard(key)
            os.remove(path)

    def _free_dead_bins(self) -> None:
        """Free the bins of processes that are gone (a crashed job's recycled pages)."""
        for name in (os.listdir(self._bins) if os.path.isdir(self._bins) else []):
            if name.isdigit() and int(name) != os.getpid() and not _alive(int(name)):
                shutil.rmtree(os.path.join(self._bins, name), ignore_errors=True)

    def _forget_unlinked(self) -> None:
        """Drop mappings of files deleted behind our back (they would hold their memory)."""
        for key, mapping in list(self._maps.items()):
            if os.fstat(mapping.fd).st_nlink == 0:
                self._unmap(key)

    def _unmap(self, key: tuple[int, int]) -> None:
        mapping = self._maps.pop(key, None)
        if mapping is not None:
            os.close(mapping.fd)
            # The storage unmaps when its last view goes (a finished transfer's are gone).
            del mapping.data


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
