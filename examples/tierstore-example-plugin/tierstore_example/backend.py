"""Backend ``example-dir``: a directory on a POSIX filesystem, written from scratch with ``os``
and ``shutil``. Files are fsynced on close and renames are atomic, so the default commit
protocol ``atomic`` (write into a hidden directory, rename into place) works."""

from __future__ import annotations

import io
import os
import shutil
from typing import IO

from tierstore.plugin import Backend, Option

__all__ = ["ExampleDirBackend"]


class _DurableFile(io.FileIO):
    """A file opened for writing whose ``close()`` fsyncs it first."""

    def close(self) -> None:
        """fsync, then close (once)."""
        if not self.closed:
            try:
                os.fsync(self.fileno())
            finally:
                super().close()


class ExampleDirBackend(Backend):
    """A tier in a local directory (``path``)."""

    options = (Option("path", str, required=True, expand=True,
                      description="directory of the tier; may use {rank}, {local_rank}, {node}"),)
    default_commit = "atomic"
    supports_rename = True
    durable = True

    def __init__(self, root: str, path: str | None = None):
        self.root = os.path.abspath(path or root)

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/")) if path else self.root

    def check_reachable(self) -> str | None:
        """None when the root (or its nearest existing parent) is a writable directory."""
        probe = self.root
        while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe):
            return f"{probe} is not a directory, so {self.root} cannot be created"
        if not os.access(probe, os.W_OK | os.X_OK):
            return f"{probe} is not writable by this user"
        return None

    def open_write(self, path: str) -> IO[bytes]:
        """Create or truncate ``path``; fsynced on close."""
        return _DurableFile(self._abs(path), "w")

    def open_read(self, path: str) -> IO[bytes]:
        """Open ``path`` for reading (seekable, with readinto)."""
        return open(self._abs(path), "rb", buffering=0)

    def size(self, path: str) -> int | None:
        """Size of the regular file ``path``; None when missing or a directory."""
        try:
            st = os.stat(self._abs(path))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return None if os.path.isdir(self._abs(path)) else st.st_size

    def list(self, path: str) -> list[str]:
        """Names directly under the directory ``path``; [] when it is missing."""
        try:
            return sorted(os.listdir(self._abs(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def makedirs(self, path: str) -> None:
        """Create ``path`` and its parents."""
        os.makedirs(self._abs(path), exist_ok=True)

    def delete(self, path: str) -> None:
        """Remove a file or a whole tree; missing is fine."""
        target = self._abs(path)
        try:
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            else:
                os.remove(target)
        except (FileNotFoundError, NotADirectoryError):
            pass

    def rename(self, src: str, dst: str, *, replace: bool = False) -> None:
        """Move ``src`` to ``dst`` atomically; FileExistsError when ``dst`` exists, unless
        ``replace`` (files only)."""
        if not replace and os.path.lexists(self._abs(dst)):
            raise FileExistsError(f"{self._abs(dst)} exists")
        os.replace(self._abs(src), self._abs(dst))

    def sync_dir(self, path: str) -> None:
        """fsync the directory ``path`` so the names in it survive a power loss."""
        try:
            fd = os.open(self._abs(path), os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def local_path(self, path: str) -> str | None:
        """The OS path of ``path`` (stock DCP can read the tier directly)."""
        return self._abs(path)

    def describe(self) -> str:
        """Where the tier is, for messages."""
        return f"example-dir {self.root}"
