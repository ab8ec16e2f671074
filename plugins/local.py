"""Backends ``local`` (a POSIX directory, fsynced) and ``memory`` (a tmpfs directory, no fsync).

Both keep the on-tier layout of the contract, so a checkpoint written without codecs loads with
stock ``dcp.load(checkpoint_id=<tier root>/<id>)``. ``memory`` lives in ``/dev/shm`` by default:
it survives a crashed process (not a rebooted node), which is what a RAM tier is for.

Every file and directory below a root is reached from the root's descriptor without following
a symbolic link (:mod:`.safe_fs`), and a root another user could change, or the way to it, is
refused at open and again each time the root is opened (:mod:`.ownership`): ``/dev/shm`` is
every local user's, so the ``memory`` tier's default root is this user's own,
``/dev/shm/tierstore-<uid>/{node}``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import os
import shutil
import logging
import stat
import struct
import sys
from typing import IO

from tierstore.plugin import (Backend, confined, DirectoryLock, hookimpl, IntegrityError,
                              Option, TransferEnd)

from .claims import claim_root, holder_of
from .recycle import RECYCLE_DIR, PageRecycler
from .safe_fs import (TierTree, mapped_end, open_dir_at, open_regular_at, remove_at, root_problem,
                      written_end)

# Start writeback of every this-many bytes while the file is still being written, so that the
# final fsync has little left to flush: write and disk flush overlap (about +20% on this disk).
_WRITEBACK_CHUNK = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()

log = logging.getLogger("tierstore.local")

# Linux's limits on a name (one path component) and on a whole path, in bytes; PATH_MAX counts
# the terminating NUL. Beyond them every call fails with ENAMETOOLONG, so a tier's path is
# checked against them at open rather than at the first save.
_NAME_MAX = 255
_PATH_MAX = 4096


def local_path_problem(path: str) -> str | None:
    """Why ``path`` cannot name a local directory (a name longer than NAME_MAX, the whole longer
    than PATH_MAX), or None. Placeholders are counted as written, which is at least as long as
    what they become for all but huge jobs. Said without quoting the path."""
    try:
        expanded = os.path.expanduser(path)
        names = os.fsencode(expanded).split(b"/")
        whole = os.fsencode(os.path.abspath(expanded))
    except UnicodeEncodeError:
        return "holds characters that cannot be encoded as a file name; use UTF-8 text"
    for i, name in enumerate(names):
        if len(name) > _NAME_MAX:
            return (f"its component {i + 1} of {len(names)} is {len(name)} bytes long, but a "
                    f"file or directory name may be at most {_NAME_MAX} bytes (NAME_MAX); "
                    f"use shorter directory names")
    if len(whole) >= _PATH_MAX:
        return (f"it is {len(whole)} bytes long as an absolute path, but a path may be at most "
                f"{_PATH_MAX - 1} bytes (PATH_MAX) and the checkpoints' own directories and "
                f"files still go below it; choose a much shorter directory")
    return None


class LocalWriteFile(io.RawIOBase):
    """A file being written on a local disk: unbuffered writes, early writeback, fsync on close."""

    def __init__(self, fd: int, durable: bool, recycler: PageRecycler | None = None,
                 entry_dir: int = -1):
        """``fd``: the file, open for writing at its start (closed with this object);
        ``recycler``: the file is one it recycled; ``entry_dir``: a descriptor of the directory
        holding the file (taken over), fsynced after the file so that its new entry survives a
        power loss with its bytes."""
        super().__init__()
        self._entry_dir = entry_dir
        # A recycled file is written over in place (its pages are why it was kept) and cut to
        # the length written at close.
        self._recycler = recycler
        self._reused = recycler is not None
        self._fd = fd
        self._durable = durable
        self._pos = 0
        self._flushed_to = 0

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self._pos

    def write(self, data) -> int:  # bytes-like
        if self.closed:
            # After close the descriptor number is free, and the next file this process opens
            # (another save's data file, a drain's copy) takes it: a late write (an abandoned
            # writer's finalizer flushing what it gathered) would land in that file.
            raise ValueError(f"write to closed file (descriptor {self._fd} was released)")
        view = memoryview(data).cast("B")
        total = len(view)
        done = 0
        while done < total:
            done += os.write(self._fd, view[done:])
        self._pos += total
        if self._durable and _sync_file_range and self._pos - self._flushed_to >= _WRITEBACK_CHUNK:
            _sync_file_range(self._fd, self._flushed_to, self._pos - self._flushed_to,
                             _SYNC_FILE_RANGE_WRITE)
            self._flushed_to = self._pos
        return total

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._reused:
                self._recycler.truncate(self._fd, self._pos)
            if self._durable:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
            super().close()
            if self._entry_dir >= 0:
                try:
                    os.fsync(self._entry_dir)
                finally:
                    os.close(self._entry_dir)


class _FlockedDirectory(DirectoryLock):
    """An open directory holding a ``flock``."""

    def __init__(self, fd: int):
        self._fd = fd

    def release(self) -> None:
        """Unlock (close the directory)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _still_named(fd: int, dir_fd: int, name: str) -> bool:
    """Whether ``name`` in the directory open as ``dir_fd`` still is the directory open as
    ``fd``."""
    try:
        named = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


# struct flock of fcntl(2) on Linux: l_type, l_whence, l_start, l_len, l_pid (native alignment).
_FLOCK = "@hhqqi4x"
_warned_unlockable: set[str] = set()


def _nobody_holds(fd: int, refused: OSError, full: str) -> bool:
    """After an exclusive ``flock`` on directory ``fd`` failed with ``refused`` (not because
    it is held): whether no other process holds the directory, known for certain, or False.

    NFS emulates ``flock`` with POSIX record locks, and an exclusive one needs a descriptor
    open for writing, which a directory cannot have: EBADF. The shared locks of writers there
    are POSIX read locks on the directory, which F_GETLK sees from a read-only descriptor, so
    the question is asked that way. Any other failure (no locks on this mount at all) cannot
    be answered: the directory is kept, and gc or ``keep`` tries again later."""
    if refused.errno == errno.EBADF:
        try:
            probe = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
            answer = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, probe))
        except OSError as exc:
            refused = exc
        else:
            return answer[0] == fcntl.F_UNLCK
    parent = os.path.dirname(full)
    if parent not in _warned_unlockable:
        _warned_unlockable.add(parent)
        log.warning("cannot lock directories in %s (%s): gc and keep leave what they cannot "
                    "lock there, since another process may still be writing it", parent,
                    os.strerror(refused.errno or 0))
    return False


class LocalBackend(Backend):
    """A directory on a local (or network) POSIX filesystem; files are fsynced, renames atomic."""

    options = (
        Option("path", str, required=True, expand=True, check=local_path_problem,
               description="directory of the tier; may use {rank}, {local_rank}, {node}"),
        Option("fsync", bool, default=True,
               description="fsync files and directories so a commit survives power loss"),
    )
    default_commit = "atomic"
    supports_rename = True

    def __init__(self, root: str, path: str | None = None, fsync: bool = True,
                 recycle: bool = False, *, inside: str | None = None,
                 sync_entries: bool = False):
        """``inside``: the root is a directory below that one (a ``peer`` tier's replicas),
        reached from it without following links too. ``sync_entries``: every new directory
        entry (a file when it is closed, a directory when it is made, a removal) is fsynced
        as it happens, for a commit protocol that syncs no directory itself (``manifest-last``
        on a ``file://`` tier): the manifest must not outlive its data in a power loss."""
        self.root = os.path.abspath(os.path.expanduser(path or root))
        # What paths must resolve under (_abs); resolved once, not on every file access.
        self._real_root = os.path.realpath(self.root)
        self._sync_entries = sync_entries
        # Every file operation goes through the root's descriptor, link-free (safe_fs).
        self._tree = (TierTree(inside, os.path.relpath(self.root, inside),
                               durable=sync_entries) if inside
                      else TierTree(self.root, durable=sync_entries))
        self.durable = fsync
        #: with ``recycle``, dropped checkpoints' pages are reused (see tierstore_plugins.recycle)
        self.recycler = PageRecycler(self._tree) if recycle else None

    def _rel(self, path: str) -> str:
        """``path`` (relative to the root, untrusted: it may come from a manifest or a
        listing) when it is made of plain names; ``""`` is the root."""
        return confined(path.rstrip("/"), f"tier root {self.root}") if path else ""

    def _abs(self, path: str) -> str:
        """The OS path of ``path`` (relative to the root, untrusted: it may come from a
        manifest or a listing), refused when it, or a symbolic link on its way, leads out of
        the root. Only for :meth:`local_path`, whose callers open by path; this backend's own
        operations never follow a link (``self._tree``)."""
        # Whoever opens the path opens it through the way to the root: that way is checked
        # now (a root another user took over since the open is refused here too).
        self._check_root()
        if not path:
            return self.root
        target = os.path.join(self.root, confined(path.rstrip("/"), f"tier root {self.root}"))
        real = os.path.realpath(target)
        root = self._real_root
        if real != root and not real.startswith(root + os.sep):
            raise IntegrityError(
                f"refusing {target}: a symbolic link leads it out of the tier's root {self.root} "
                f"(to {real}); tierstore never follows links out of a tier. Remove the link, "
                f"or restore the checkpoint from another tier")
        return target

    def _check_root(self) -> None:
        """Raise PermissionError when another user could change the root or the way to it (a
        root not made yet passes: it is checked when made)."""
        try:
            os.close(self._tree.open_root())
        except (FileNotFoundError, NotADirectoryError):
            pass

    def check_reachable(self) -> str | None:
        """Why the tier cannot be used: another user could change its root (ownership), or
        its nearest existing directory is no directory or not writable; None when it can."""
        problem = root_problem(self.root)
        if problem is not None:
            return problem
        probe = self.root
        while not os.path.exists(probe):
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        if not os.path.isdir(probe):
            return f"{probe} exists and is not a directory"
        if not os.access(probe, os.W_OK | os.X_OK):
            return f"{probe} is not writable by this user (uid {os.getuid()})"
        return None

    def open_write(self, path: str) -> IO[bytes]:
        return self._write_file(path, recycled=True)  # type: ignore[return-value]

    def open_read(self, path: str) -> IO[bytes]:
        rel = self._rel(path)
        f = io.FileIO(self._tree.open_file(rel, os.O_RDONLY), "rb")
        f.name = os.path.join(self.root, rel)  # for messages, as open(path) would name it
        return f

    def size(self, path: str) -> int | None:
        try:
            st = self._tree.status(self._rel(path))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def list(self, path: str) -> list[str]:
        try:
            with self._tree.directory(self._rel(path)) as fd:
                names = sorted(os.listdir(fd))
        except (FileNotFoundError, NotADirectoryError):
            return []
        if self.recycler is not None and not path:
            names = [n for n in names if n != RECYCLE_DIR]  # the recycler's, not a checkpoint
        return names

    def makedirs(self, path: str) -> None:
        with self._tree.directory(self._rel(path), create=True):
            pass

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write a small file (manifest, metadata) new: a recycled file's pages are kept for
        the large files that follow."""
        with self._write_file(path, recycled=False) as f:
            f.write(data)

    def _write_file(self, path: str, *, recycled: bool) -> LocalWriteFile:
        """File ``path`` open for writing, never through a link: with ``recycled`` (and
        recycling) a recycled file written over in place where the bin holds one, else a new
        (or truncated) file, which recycling may take back once it is evicted."""
        rel = self._rel(path)
        recycler = self.recycler if recycled else None
        with self._tree.parent(rel) as (dir_fd, name):
            if recycler is not None:
                fd = recycler.take_for_write(dir_fd, name)
                if fd is not None:
                    return LocalWriteFile(fd, self.durable, recycler)
            try:
                fd = open_regular_at(dir_fd, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            except OSError as exc:
                raise self._tree.refusal(dir_fd, name, rel, exc) from None
            if recycler is not None:
                recycler.owns(fd, name)
            entry_dir = os.dup(dir_fd) if self._sync_entries else -1
            return LocalWriteFile(fd, self.durable, entry_dir=entry_dir)

    def delete(self, path: str) -> None:
        self._remove(path, recycle=False)

    def discard(self, path: str) -> None:
        """Delete an evicted checkpoint's directory; with recycling its files (those this
        process wrote) go to the recycle bin, to be written over by the next ones."""
        self._remove(path, recycle=True)

    def _remove(self, path: str, recycle: bool) -> None:
        """Remove ``path`` from its directory's descriptor: a directory's tree without
        following any link in it, a link itself (never its target), a file."""
        rel = self._rel(path)
        try:
            if not rel:
                self._tree.remove_tree()  # the whole tier, reached as every operation does
                return
            with self._tree.parent(rel) as (dir_fd, name):
                if self.recycler is not None:
                    self._release(dir_fd, name, recycle)
                remove_at(dir_fd, name)
                if self._sync_entries:
                    # A manifest deleted first (an overwrite, a delete) must stay deleted
                    # after a power loss that undoes nothing of what came after it.
                    os.fsync(dir_fd)
        except (FileNotFoundError, NotADirectoryError):
            pass  # not there: nothing to remove

    def _release(self, dir_fd: int, name: str, recycle: bool) -> None:
        """The recycler recycles (or forgets) this process's files in directory ``name``."""
        try:
            fd = open_dir_at(dir_fd, name)
        except OSError:
            return  # a file, a link or nothing: no files of a directory to recycle
        try:
            if recycle:
                self.recycler.recycle(fd)
            else:
                self.recycler.forget(fd)
        finally:
            os.close(fd)

    def free_bytes(self) -> int | None:
        """Free space of the filesystem holding the tier (for an unprivileged user), asked of
        its nearest existing directory (the root is made by the first save)."""
        path = self.root
        while not os.path.isdir(path) and os.path.dirname(path) != path:
            path = os.path.dirname(path)
        try:
            return shutil.disk_usage(path).free
        except OSError:
            return None

    def lock_directory(self, path: str, *, exclusive: bool) -> DirectoryLock | None:
        """``flock`` on the directory: shared while a rank writes or sends a checkpoint,
        exclusive (non-blocking) to evict or collect it; the lock goes with the process if it
        dies. An exclusive lock the filesystem refuses is None ("held") unless it can be told
        for certain that no other process holds the directory (:func:`_nobody_holds`). Exclusive on a directory that is not there locks nothing; shared raises
        FileNotFoundError when the directory is not there or was removed while the lock
        waited (an exclusive holder deleted it), so a writer never holds a deleted one."""
        rel = self._rel(path)
        try:
            with self._tree.parent(rel) as (dir_fd, name):
                return self._lock_at(dir_fd, name, os.path.join(self.root, rel), exclusive)
        except (FileNotFoundError, NotADirectoryError):
            if exclusive:
                return DirectoryLock()
            raise

    def claim(self, job: str) -> DirectoryLock | str:
        """Claim the root for ``job`` (see :mod:`tierstore_plugins.claims`), making it if
        needed, through the checked way to it (another user's root is refused)."""
        fd = self._tree.open_root(create=True)
        try:
            return claim_root(fd, job)
        finally:
            os.close(fd)

    def claimed_by(self, job: str) -> str | None:
        """Who else holds the root (see :mod:`tierstore_plugins.claims`); None when nobody
        does or the root is not there yet. Writes nothing."""
        try:
            fd = self._tree.open_root()
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            return holder_of(fd, job)
        finally:
            os.close(fd)

    @staticmethod
    def _lock_at(dir_fd: int, name: str, full: str, exclusive: bool) -> DirectoryLock | None:
        """:meth:`lock_directory` of directory ``name`` in ``dir_fd`` (OS path ``full``)."""
        try:
            fd = open_dir_at(dir_fd, name)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                raise
            # Missing, a file, or a link (never followed): no directory of this tier to lock.
            if exclusive:
                return DirectoryLock()
            raise FileNotFoundError(f"{full} is not there to lock") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as exc:
            try:
                if exclusive:
                    # Whoever asks exclusively is about to delete: a lock that could not be
                    # taken is never read as "nobody holds it".
                    return DirectoryLock() if _nobody_holds(fd, exc, full) else None
            finally:
                os.close(fd)
            # A shared lock that cannot be taken (Lustre mounted noflock): the write goes on;
            # what keeps its directory is that no exclusive locker deletes without knowing.
            return DirectoryLock()
        except BaseException:
            os.close(fd)
            raise
        if not exclusive and not _still_named(fd, dir_fd, name):
            os.close(fd)
            raise FileNotFoundError(f"{full} was removed while it was being locked")
        return _FlockedDirectory(fd)

    def rename(self, src: str, dst: str, *, replace: bool = False) -> None:
        self._tree.rename(self._rel(src), self._rel(dst), replace=replace)

    def sync_dir(self, path: str) -> None:
        if not self.durable:
            return
        with self._tree.directory(self._rel(path)) as fd:
            os.fsync(fd)

    def local_path(self, path: str) -> str | None:
        return self._abs(path)

    def sending_end(self, path: str, size: int) -> TransferEnd:
        """File ``path`` (``size`` bytes) mapped, to send over torch.distributed without a
        copy; with recycling the mapping is kept for the file's next uses."""
        rel = self._rel(path)
        shown = os.path.join(self.root, rel)
        if self.recycler is not None:
            fd = self._tree.open_file(rel, os.O_RDWR)  # its kept mapping is writable
            try:
                return self.recycler.sending_end(fd, shown, size)
            finally:
                os.close(fd)
        return mapped_end(self._tree.open_file(rel, os.O_RDONLY), shown, size)

    def receiving_end(self, path: str, size: int) -> TransferEnd:
        """File ``path`` created (with its parents) to receive ``size`` bytes into; with
        recycling, the pages of a dropped file, mapped."""
        rel = self._rel(path)
        shown = os.path.join(self.root, rel)
        with self._tree.parent(rel, create=True) as (dir_fd, name):
            try:
                if self.recycler is not None:
                    return self.recycler.receiving_end(dir_fd, name, shown, size)
                return written_end(open_regular_at(dir_fd, name, os.O_WRONLY | os.O_CREAT
                                                   | os.O_TRUNC), shown, size)
            except OSError as exc:
                raise self._tree.refusal(dir_fd, name, rel, exc) from None

    def close(self) -> None:
        """Free the recycled pages and mappings (with recycling)."""
        if self.recycler is not None:
            self.recycler.close()


#: Where a ``memory`` tier lives unless its ``path`` says otherwise: a directory of this user's
#: own in ``/dev/shm`` (by uid), so that no two users share a name there, and a directory
#: another user made under a shared name is never taken for this job's.
MEMORY_DEFAULT_PATH = f"/dev/shm/tierstore-{os.geteuid()}/{{node}}"


class MemoryBackend(LocalBackend):
    """A tmpfs directory (default ``/dev/shm/tierstore-<uid>/{node}``, this user's own): same
    format, no fsync."""

    options = (
        Option("path", str, default=MEMORY_DEFAULT_PATH, expand=True,
               check=local_path_problem,
               description="tmpfs directory of the tier (default: /dev/shm/tierstore-<uid>/"
                           "{node}, by this user's uid); may use {rank}, {local_rank}, "
                           "{node}"),
    )
    durable = False

    def __init__(self, root: str, path: str | None = None):
        super().__init__(root, path, fsync=False)


@hookimpl
def tierstore_register_backends(register):
    register("local", LocalBackend)
    register("memory", MemoryBackend)
