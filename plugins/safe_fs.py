"""Files and directories under a tier's root, reached without following symbolic links.

A tier's directory is shared ground: the ranks of a node, an operator, or (in ``/dev/shm``)
anyone who got write access may replace a name in it between two calls, with a symbolic link
to somewhere else for instance. So every name below a root is opened, made, removed or renamed
relative to a descriptor of the directory holding it (``dir_fd``), one component at a time and
with ``O_NOFOLLOW``, as CPython's descriptor-based ``shutil.rmtree`` and git's object store do:

- a symbolic link anywhere below the root is refused for reading and writing (IntegrityError
  naming it, which is how a backend says "this is no copy of the file"), even one that stays
  inside the root;
- deleting a link removes the link, never what it points to, and trees are removed by
  ``shutil.rmtree(name, dir_fd=...)``, which refuses a link at its top and follows none below;
- only regular files are opened as files (a FIFO planted in a tier would block a reader).

The way from ``/`` to the root is walked the same way, by descriptors, each time the root is
opened (:func:`open_root_dir`): every directory on it, and every symbolic link (followed only
when its owner and the directory holding it are trusted), is checked against :mod:`.ownership`,
and so is the root itself and each directory opened below it. A root another user took over
after the store opened (a directory on the way made in ``/dev/shm`` by someone else, a link
put in the root's place) is refused at the next save, load or eviction, not only at the open.
:class:`TierTree` also reaches a tree below another root (a ``peer`` tier's replica
directories), so the way from the configured root down is link-free too.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import sys
from typing import Iterator

from tierstore.plugin import IntegrityError, MappedFile, WrittenFile

from .ownership import (DIR_MODE, UnsafeDirectoryError, below_root_fault, check_open_root,
                        entry_fault, root_fault, way_fault)

__all__ = ["TierTree", "exchange_at", "is_dir_at", "mapped_end", "open_dir_at", "open_regular_at",
           "open_root_dir", "remove_at", "root_problem", "written_end"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# The way to a root is walked with O_PATH descriptors: like a path lookup, they need only
# search permission on a directory, not read permission (a /home of mode 0711 is passable).
_WAY_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Symbolic links followed on the way to a root before giving up (the kernel's own limit).
_MAX_LINKS = 40
# O_NONBLOCK: opening a FIFO someone put in place of a file must not wait for a writer
# (regular files ignore the flag; it is cleared once the file is known to be one).
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
# What opening a link with O_NOFOLLOW fails with: ELOOP for a file, ENOTDIR with O_DIRECTORY.
_LINK_ERRNOS = (errno.ELOOP, errno.ENOTDIR)


def open_dir_at(dir_fd: int, name: str, *, create: bool = False, durable: bool = False) -> int:
    """A descriptor of directory ``name`` in the directory open as ``dir_fd``, never through a
    link (a link or a file there: OSError ENOTDIR); made owner-writable first when ``create``
    and missing (made meanwhile by another process is fine: who owns what was found is for
    the caller to check). ``durable``: a directory made here has its entry fsynced."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
    _make_at(dir_fd, name, durable)
    return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def _make_at(dir_fd: int, name: str, durable: bool) -> None:
    """Make directory ``name`` (owner-writable) in ``dir_fd`` unless something is there now;
    ``durable``: fsync its entry when made."""
    try:
        os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
    except FileExistsError:
        return  # made meanwhile (another rank of the node, or someone else: checked next)
    if durable:
        # dir_fd may be an O_PATH descriptor, which cannot be fsynced.
        synced = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            os.fsync(synced)
        finally:
            os.close(synced)


def open_root_dir(path: str, *, create: bool = False, durable: bool = False) -> int:
    """A readable descriptor of directory ``path`` (absolute), reached from ``/`` one
    component at a time without letting the kernel follow a link: each directory and each
    link on the way is checked (:func:`.ownership.entry_fault`, :func:`.ownership.way_fault`)
    before the walk goes on, and a link is followed here, by its target's components, only
    when it passed. ``create``: missing directories are made (owner-writable; their entries
    fsynced when ``durable``), and one found made meanwhile is checked like any other.

    Raises :class:`.ownership.UnsafeDirectoryError` (a PermissionError naming the directory,
    its owner and what to do) when another user could change the way; FileNotFoundError when
    a component is missing (and not ``create``); NotADirectoryError when one is a file. The
    last directory itself is not held to a root's standard here (see ``check_open_root``)."""
    if not path.startswith("/"):
        path = os.path.join(os.getcwd(), path)
    todo = [p for p in reversed(path.split("/")) if p]  # the next component last
    fd = os.open("/", _WAY_FLAGS)
    try:
        here, here_st = "/", os.fstat(fd)
        links = 0
        while todo:
            part = todo.pop()
            if part == ".":
                continue
            if part == "..":  # as the kernel resolves it: the parent of where the walk is
                up = os.open("..", _WAY_FLAGS, dir_fd=fd)
                os.close(fd)
                fd, here = up, os.path.dirname(here)
                here_st = os.fstat(fd)
                continue
            entry = os.path.join(here, part)
            try:
                below = os.open(part, _WAY_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT),
                                            entry) from None
                _make_at(fd, part, durable)
                todo.append(part)  # opened (and checked) as if it had been there
                continue
            except OSError as exc:
                if exc.errno not in _LINK_ERRNOS:
                    raise
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR),
                                             entry) from None
                target = os.readlink(part, dir_fd=fd)
                fault = entry_fault(entry, st, here, here_st, target)
                if fault is not None:
                    raise UnsafeDirectoryError(f"the tier root {path}", fault) from None
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path) from None
                if target.startswith("/"):
                    top = os.open("/", _WAY_FLAGS)
                    os.close(fd)
                    fd, here = top, "/"
                    here_st = os.fstat(fd)
                todo.extend(p for p in reversed(target.split("/")) if p)
                continue
            try:
                st = os.fstat(below)
                fault = entry_fault(entry, st, here, here_st)
                if fault is None and todo:  # something lies below it
                    fault = way_fault(entry, st)
                if fault is not None:
                    raise UnsafeDirectoryError(f"the tier root {path}", fault)
            except BaseException:
                os.close(below)
                raise
            os.close(fd)
            fd, here, here_st = below, entry, st
        # O_PATH descriptors can be neither listed, locked nor synced: reopen the last one.
        return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


def root_problem(root: str) -> str | None:
    """Why ``root`` (an absolute path, which may go through symbolic links and need not exist
    yet) could be changed by another user, as a sentence naming the path, its owner and what
    to do; None when only this user can change it, as far as it exists (what is missing is
    made by tierstore itself, owner-writable, and checked again then). Writes nothing."""
    try:
        fd = open_root_dir(root)
    except UnsafeDirectoryError as exc:
        return exc.fault
    except OSError:
        return None  # missing, a file or unreadable: check_reachable says why, if it matters
    try:
        return root_fault(os.fstat(fd), root)
    finally:
        os.close(fd)


def is_dir_at(dir_fd: int, name: str) -> bool:
    """Whether ``name`` in ``dir_fd`` is a directory itself (a link to one is not)."""
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def remove_at(dir_fd: int, name: str) -> None:
    """Remove ``name`` from the directory open as ``dir_fd``: a directory with its whole tree,
    never following a link on the way; anything else (a link included) is unlinked. Missing
    is fine, and so is a tree partly removed by another process meanwhile."""
    if is_dir_at(dir_fd, name):
        # Descriptor-based on Linux (shutil._use_fd_functions): a link swapped in at the top
        # is refused, and none below it is followed.
        shutil.rmtree(name, ignore_errors=True, dir_fd=dir_fd)
        return
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


# renameat2(2)'s flag that swaps two existing entries in one step (Linux >= 3.15; ext4, xfs,
# btrfs, tmpfs among others). Reached through libc (glibc >= 2.28) or, failing that, the raw
# system call on the architectures whose number is known here.
_RENAME_EXCHANGE = 2
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347}
# What renameat2 fails with where the kernel or the filesystem cannot exchange (NFS, FUSE, an
# old kernel): the caller then replaces in two steps.
_NO_EXCHANGE = (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


def _load_renameat2():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fn = libc.renameat2
    except AttributeError:
        number = _SYS_RENAMEAT2.get(os.uname().machine)
        if number is None:
            return None
        syscall = libc.syscall
        syscall.restype = ctypes.c_long

        def fn(olddirfd, oldpath, newdirfd, newpath, flags):
            return syscall(ctypes.c_long(number), ctypes.c_int(olddirfd), ctypes.c_char_p(oldpath),
                           ctypes.c_int(newdirfd), ctypes.c_char_p(newpath),
                           ctypes.c_uint(flags))
        return fn
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


def exchange_at(src_dir_fd: int, src_name: str, dst_dir_fd: int, dst_name: str) -> bool:
    """Swap entries ``src_name`` (in ``src_dir_fd``) and ``dst_name`` (in ``dst_dir_fd``) in one
    step, so that neither name is ever missing: a crash leaves one state or the other. Entries
    are swapped themselves (a link is moved, not followed). False when this OS, kernel or
    filesystem cannot (nothing changed then); other failures raise OSError (FileNotFoundError
    when either entry is missing)."""
    if _renameat2 is None:
        return False
    if _renameat2(src_dir_fd, os.fsencode(src_name), dst_dir_fd, os.fsencode(dst_name),
                  _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), f"{src_name} <-> {dst_name}")


def open_regular_at(dir_fd: int, name: str, flags: int, mode: int = 0o644) -> int:
    """Descriptor of regular file ``name`` in ``dir_fd`` opened with ``flags``, never through
    a link: a link is OSError ELOOP, anything but a regular file IsADirectoryError or
    OSError EINVAL."""
    fd = os.open(name, flags | _FILE_FLAGS, mode, dir_fd=dir_fd)
    try:
        kind = stat.S_IFMT(os.fstat(fd).st_mode)
        if kind == stat.S_IFDIR:
            raise IsADirectoryError(errno.EISDIR, "is a directory", name)
        if kind != stat.S_IFREG:
            raise OSError(errno.EINVAL, "is not a regular file", name)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _WrittenAt(WrittenFile):
    """A :class:`WrittenFile` over a descriptor opened here (``WrittenFile`` itself opens by
    path, which would follow a link swapped in meanwhile)."""

    def __init__(self, fd: int, path: str, size: int):  # noqa: super() would open the path
        self.path, self.size, self._fd = path, size, fd


class _MappedAt(MappedFile):
    """A :class:`MappedFile` over a descriptor opened here, for the same reason."""

    def __init__(self, fd: int, path: str, size: int):  # noqa: super() would open the path
        self.path, self.size, self._fd = path, size, fd
        held = os.fstat(fd).st_size
        if held < size:
            os.close(fd)
            self._fd = -1
            raise OSError(f"{path} holds {held} bytes, fewer than the {size} expected")


def written_end(fd: int, path: str, size: int) -> WrittenFile:
    """A receiving end writing ``size`` bytes into the open file ``fd`` (``path``, for
    messages); it owns ``fd``."""
    return _WrittenAt(fd, path, size)


def mapped_end(fd: int, path: str, size: int) -> MappedFile:
    """A sending end mapping the open file ``fd`` (``path``, at least ``size`` bytes); it owns
    ``fd`` (closed here when the file is too short)."""
    return _MappedAt(fd, path, size)


class TierTree:
    """The files under one tier root, reached from a descriptor of the root without following
    links (see the module docstring). Paths given to its methods are relative to the root,
    already checked by ``confined`` (plain names, no ``..``); ``""`` is the root.

    ``below`` (a relative path): the tree's root is that directory under ``root``, reached
    link-free from ``root`` (and made, owner-writable, when a method creates). ``durable``:
    the entries of directories made are fsynced (a tier that promises durability and whose
    commit syncs no directory itself)."""

    def __init__(self, root: str, below: str = "", *, durable: bool = False):
        self.base = root
        self.below = [p for p in below.split("/") if p]
        self.durable = durable
        #: the OS path of the tree's root, for messages
        self.root = os.path.join(root, *self.below)

    # -- descriptors ------------------------------------------------------------------------
    def open_root(self, *, create: bool = False) -> int:
        """A descriptor of the root (made first when ``create`` and missing), the way to it
        checked again (:func:`open_root_dir`): FileNotFoundError when missing,
        PermissionError (:class:`.ownership.UnsafeDirectoryError`) when another user could
        change it or the way to it."""
        fd = open_root_dir(self.base, create=create, durable=self.durable)
        try:
            check_open_root(fd, self.base)
        except BaseException:
            os.close(fd)
            raise
        if self.below:
            return self._descend(fd, self.below, create, "")
        return fd

    def remove_tree(self) -> None:
        """Remove the tree's root with everything in it, reached as :meth:`open_root` reaches
        it (a link in the root's place is removed itself). Missing is fine."""
        if self.below:
            holder = self._descend(self.open_root(), self.below[:-1], False, "")
            name = self.below[-1]
        else:
            holder = open_root_dir(os.path.dirname(self.base))
            name = os.path.basename(self.base)
        try:
            remove_at(holder, name)
        finally:
            os.close(holder)

    @contextlib.contextmanager
    def directory(self, rel: str, *, create: bool = False) -> Iterator[int]:
        """A descriptor of directory ``rel`` (made with its parents when ``create``), closed
        when the block ends."""
        fd = self._descend(self.open_root(create=create), _parts(rel), create, rel)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def parent(self, rel: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
        """``(descriptor of the directory holding rel, rel's last name)`` (the parents made
        when ``create``), the descriptor closed when the block ends. ``rel`` is not ``""``."""
        parts = _parts(rel)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "is the tier's root", self.root)
        fd = self._descend(self.open_root(create=create), parts[:-1], create, rel)
        try:
            yield fd, parts[-1]
        finally:
            os.close(fd)

    # -- operations -------------------------------------------------------------------------
    def open_file(self, rel: str, flags: int, *, create_parents: bool = False) -> int:
        """Descriptor of regular file ``rel`` opened with ``flags``; a link there, or on the
        way, is an IntegrityError."""
        with self.parent(rel, create=create_parents) as (dir_fd, name):
            try:
                return open_regular_at(dir_fd, name, flags)
            except OSError as exc:
                raise self.refusal(dir_fd, name, rel, exc) from None

    def status(self, rel: str) -> os.stat_result:
        """The status of ``rel`` itself (FileNotFoundError when missing); a link there or on
        the way is an IntegrityError."""
        if not rel:
            with self.directory("") as fd:
                return os.fstat(fd)
        with self.parent(rel) as (dir_fd, name):
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise self.refusal(dir_fd, name, rel, OSError(errno.ELOOP, "a link", name))
            return st

    def rename(self, src: str, dst: str, *, replace: bool) -> None:
        """Rename ``src`` to ``dst`` (entries themselves: a link is moved, not followed);
        without ``replace``, FileExistsError when ``dst`` exists."""
        with self.parent(src) as (src_fd, src_name), self.parent(dst) as (dst_fd, dst_name):
            if not replace:
                try:
                    os.stat(dst_name, dir_fd=dst_fd, follow_symlinks=False)
                except FileNotFoundError:
                    pass
                else:
                    raise FileExistsError(errno.EEXIST, "already exists",
                                          os.path.join(self.root, dst))
            os.replace(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)

    def exchange(self, a: str, b: str) -> bool:
        """Swap entries ``a`` and ``b`` (both existing) in one step (:func:`exchange_at`);
        False when the filesystem cannot, and nothing changed."""
        with self.parent(a) as (a_fd, a_name), self.parent(b) as (b_fd, b_name):
            return exchange_at(a_fd, a_name, b_fd, b_name)

    def refusal(self, dir_fd: int, name: str, rel: str, exc: OSError) -> OSError | IntegrityError:
        """What to raise for ``exc``, from opening ``name`` in ``dir_fd`` on the way to
        ``rel``: an IntegrityError naming the link when ``name`` is one, else ``exc``."""
        if exc.errno not in _LINK_ERRNOS:
            return exc
        try:
            target = os.readlink(name, dir_fd=dir_fd)
        except OSError:
            return exc  # not a link: a file where a directory was expected
        link = _path_of(dir_fd, name)
        shown = os.path.join(self.root, rel) if rel else self.root
        real, real_root = os.path.realpath(link), os.path.realpath(self.root)
        if real != real_root and not real.startswith(real_root + os.sep):
            what = (f"a symbolic link leads it out of the tier's root {self.root} "
                    f"({link} -> {target}, that is {real})")
        else:
            what = (f"{link} is a symbolic link (to {target}); links inside a tier's root "
                    f"{self.root} are not followed either")
        return IntegrityError(
            f"refusing {shown}: {what}; tierstore never follows a link in a tier. Remove the "
            f"link, or restore the checkpoint from another tier")

    # -- under the hood ---------------------------------------------------------------------
    def _descend(self, fd: int, parts: list[str], create: bool, rel: str) -> int:
        """From the directory open as ``fd`` (taken over: closed here) down through ``parts``,
        link-free, each one this user's (or root's); the last one's descriptor."""
        return _walk_down(fd, parts, create, self.durable,
                          lambda at, name, exc: self.refusal(at, name, rel, exc),
                          self._check_below)

    def _check_below(self, fd: int, at: int, name: str) -> None:
        """Refuse directory ``name`` (open as ``fd``, in ``at``) when another user owns it: it
        was made in a root with the sticky bit before this user made it."""
        st = os.fstat(fd)
        if st.st_uid in (os.geteuid(), 0):
            return  # the common case, without the /proc lookup of the path for the message
        fault = below_root_fault(_path_of(at, name), st, self.root)
        if fault is not None:
            raise UnsafeDirectoryError(f"the tier root {self.root}", fault)


def _walk_down(fd: int, names, create: bool, durable: bool = False, refusal=None,
               check=None) -> int:
    """From the directory open as ``fd`` (taken over: closed here) down through ``names``,
    each opened link-free from its parent (made when ``create``); the last one's descriptor.
    ``refusal(fd, name, error)`` turns a failure into the error raised (default: as it is);
    ``check(below, fd, name)`` raises when directory ``below`` must not be used."""
    try:
        for name in names:
            try:
                below = open_dir_at(fd, name, create=create, durable=durable)
            except OSError as exc:
                if refusal is None:
                    raise
                raise refusal(fd, name, exc) from None
            if check is not None:
                try:
                    check(below, fd, name)
                except BaseException:
                    os.close(below)
                    raise
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd


def _parts(rel: str) -> list[str]:
    return [p for p in rel.split("/") if p]


def _path_of(dir_fd: int, name: str) -> str:
    """The OS path of ``name`` in the directory open as ``dir_fd`` (for messages)."""
    try:
        return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), name)
    except OSError:
        return name
