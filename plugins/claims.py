"""One job per tier directory: the claim a saving job holds on a local tier's directory.

Two jobs that save into one directory replace each other's checkpoints of the same id, and
each restores from the other's (``store.latest()`` sees them all). Nothing in a checkpoint says
which job wrote it, and the default ``memory`` path (``/dev/shm/tierstore-<uid>/{node}``) is
the same for every job of a user on a node: two jobs started side by side without a ``path``
of their own share it. Observed: one job's drain found its step-8 file holding the other job's
bytes (same size, another digest), and one job's checkpoints drained into the other's disk tier.

So the processes of the job that saves into a directory claim it, and another job's first
save there is refused with a clear error before it writes anything. A claim is a small file
named after the directory's device and inode, in this user's own claims directory on this
machine (:data:`CLAIMS_DIR`, made and checked like a ``memory`` tier's root: another user's is
refused). It names the claiming job (its token; the first claimant's pid and host, for
messages), and every process of the job that writes the directory holds a shared ``flock`` on
it while its store is open. Outside the tier, so a tier holds checkpoints only; by inode, so
every path to one directory is one claim. The lock goes with the process: a killed job leaves a
file nobody holds, which the next job takes over; the last process of a job to let go removes
the file. Every step is made under an exclusive ``flock`` of the claims directory, held for a
few system calls, so that two jobs claiming at once cannot both find the file free (``flock``
cannot turn an exclusive lock into a shared one atomically).

Claims are per machine: processes on other hosts sharing a network filesystem are not seen.

A job restarted after a failure (every process of the old one gone) claims the directory
again and finds its checkpoints, as before. Readers (``read_only`` stores, the ``tierstore``
command's queries) claim nothing; a store's scan for unmade drains at open only asks
(:func:`holder_of`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import tempfile
from typing import Iterator

from tierstore.plugin import DirectoryLock

from .safe_fs import TierTree, open_regular_at

__all__ = ["CLAIMS_DIR", "claim_root", "holder_of"]

#: this user's claims on this machine (tmpfs where there is one: claims need no durability)
CLAIMS_DIR = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                          f"tierstore-claims-{os.geteuid()}")
#: more than a claim's record ever takes; what a file holds beyond it is not read
_RECORD_MAX = 4096


def _key(root_fd: int) -> str:
    """The claim file's name for the directory open as ``root_fd``."""
    st = os.fstat(root_fd)
    return f"{st.st_dev:x}-{st.st_ino:x}"


@contextlib.contextmanager
def _claims_locked(create: bool) -> Iterator[int]:
    """The claims directory, open and exclusively locked (the claims' mutex)."""
    fd = TierTree(CLAIMS_DIR).open_root(create=create)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # (the lock goes with it)


class _Claim(DirectoryLock):
    """A shared ``flock`` on a claim file, held until :meth:`release`."""

    def __init__(self, fd: int, key: str):
        self._fd, self._key = fd, key

    def release(self) -> None:
        """Let go of the claim; the last holder removes the file."""
        if self._fd < 0:
            return
        try:
            with _claims_locked(create=False) as dir_fd:
                os.close(self._fd)
                self._fd = -1
                _remove_if_free(dir_fd, self._key)
        except OSError:
            pass  # the file stays: the next claim takes it over
        finally:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def claim_root(root_fd: int, job: str) -> DirectoryLock | str:
    """Claim the directory open as ``root_fd`` for job ``job``: a lock to hold while the job
    may write there, or, when live processes of another job (or another store of this
    process) hold it, who they are, in words. OSError when the claim cannot be made."""
    key = _key(root_fd)
    with _claims_locked(create=True) as dir_fd:
        fd = open_regular_at(dir_fd, key, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            holder = _claim_file(fd, job)
        except BaseException:
            os.close(fd)
            raise
        if holder is not None:
            os.close(fd)
            return holder
        return _Claim(fd, key)


def holder_of(root_fd: int, job: str) -> str | None:
    """Who, other than job ``job``, holds the directory open as ``root_fd``, in words; None
    when nobody else does. Asks without claiming and writes nothing."""
    key = _key(root_fd)
    try:
        with _claims_locked(create=False) as dir_fd:
            try:
                fd = open_regular_at(dir_fd, key, os.O_RDONLY)
            except FileNotFoundError:
                return None  # never claimed, or let go
            try:
                if _free(fd):
                    return None
                record = _read_record(fd)
            finally:
                os.close(fd)
    except FileNotFoundError:
        return None  # nothing was ever claimed on this machine
    return None if record.get("job") == job else _describe(record)


def _lock_if_free(fd: int) -> bool:
    """Take an exclusive lock of the claim file ``fd`` if nobody holds it (never waiting);
    whether it was taken."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        return False
    return True


def _free(fd: int) -> bool:
    """Whether nobody holds the claim file ``fd`` (an exclusive lock taken and dropped)."""
    if not _lock_if_free(fd):
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def _remove_if_free(dir_fd: int, key: str) -> None:
    """Under the mutex: remove claim file ``key`` when nobody holds it any more."""
    try:
        fd = open_regular_at(dir_fd, key, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        if _free(fd):
            os.unlink(key, dir_fd=dir_fd)
    finally:
        os.close(fd)


def _claim_file(fd: int, job: str) -> str | None:
    """Under the mutex: take the claim file ``fd`` for ``job`` (its shared lock held on
    return), or say who holds it for another job."""
    if _lock_if_free(fd):
        # Nobody holds it (never claimed, or every process of the last job is gone): ours.
        data = json.dumps({"job": job, "pid": os.getpid(),
                           "host": socket.gethostname()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    else:
        # Held: by this job's other processes (the ranks of a node), or by another job.
        record = _read_record(fd)
        if record.get("job") != job:
            return _describe(record)
    fcntl.flock(fd, fcntl.LOCK_SH)  # (no claimant can come between: we hold the mutex)
    return None


def _read_record(fd: int) -> dict:
    """What the claim file says (untrusted: anything unreadable is an unknown holder)."""
    try:
        record = json.loads(os.pread(fd, _RECORD_MAX, 0))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _describe(record: dict) -> str:
    """Who holds a claim, as its record says, in words."""
    pid, host = record.get("pid"), record.get("host")
    if not isinstance(pid, int) or not isinstance(host, str):
        return "another job (its claim names no process)"
    if pid == os.getpid() and host == socket.gethostname():
        return (f"another store of this process (pid {pid}) that is still open; close it "
                f"before opening a new one on the same tier")
    return f"another job (its first process: pid {pid} on host {host[:64]!r})"
