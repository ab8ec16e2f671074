"""Where faults strike and what they do.

A fault point is a *row* (the operation and the phase: ``save/write_file``, ``drain/publish``,
``load/read_file``, ...) and the *nth* time that row is announced in the job. Phases come
through tierstore's own ``tierstore_phase`` hook (the :class:`Injector` plugin). ``gc`` announces
no phase, so the job's tiers use backends that announce each deletion gc makes
(``gc/delete_leftover``): the ``faults-*`` backends registered here, the built-in ones with that
one call added. The checker opens the same tiers with the plain built-in backends.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from typing import Callable

from tierstore_plugins.fsspec_backend import FsspecBackend
from tierstore_plugins.local import LocalBackend, MemoryBackend

import tierstore
from tierstore import Phase

__all__ = ["BALLAST", "FAULTS", "FIRST_FULL", "FULL_FAULTS", "GC_ROW", "Injector",
           "fill_filesystem", "leave_free", "row_of"]

#: The fault kinds, in the table's column order.
FAULTS = ("raise", "sigkill", "enospc", "tmpfs-full", "first-full", "eio", "slow",
          "server-death")

#: The first tier's own tmpfs is left with room for the save that begins, give or take a few
#: pages (``Trial.room``): the operator's disk that is almost full (see :func:`leave_free`).
FIRST_FULL = "first-full"

#: Faults that fill a real filesystem: a save that fails after them must say the tier is full.
FULL_FAULTS = ("tmpfs-full", FIRST_FULL)

#: The row of gc's deletions (tierstore announces no phase there; see the module docstring).
GC_ROW = "gc/delete_leftover"

#: The file that fills a tmpfs in tmpfs-full trials (beside the tiers, never inside one).
BALLAST = "ballast"

# Threads of the drain (tierstore/engine/drain.py): a phase announced there belongs to a drain
# whatever the job's main thread is doing meanwhile.
_DRAIN_THREADS = ("tierstore-drain", "tierstore-copy")

#: The injector of this process (the faulty backends report gc's deletions to it).
_active: "Injector | None" = None


def in_drain_thread() -> bool:
    """Whether the calling thread is one of tierstore's drain threads."""
    return threading.current_thread().name.startswith(_DRAIN_THREADS)


def row_of(phase: str, operation: str) -> str:
    """The row of ``phase`` announced while the job's main thread runs ``operation``."""
    if phase.startswith("drain_") or in_drain_thread():
        return f"drain/{phase}"
    return f"{operation}/{phase}"


class Injector:
    """A ``tierstore_phase`` plugin that counts announcements per row and strikes once, at the
    ``nth`` announcement of ``row`` (with ``checkpoint_id``: of that checkpoint only).

    ``fault`` is one of :data:`FAULTS`, or None to only count (a dry run). ``operation`` is set
    by the job around each of its steps; ``on_fire`` is told before the fault strikes. With
    ``tier``, only announcements on that tier count. :data:`FIRST_FULL` leaves the free space
    of ``mount`` at what the checkpoint being saved takes there (``sizes``, by id) plus
    ``room`` blocks."""

    def __init__(self, row: str | None = None, nth: int = 0, fault: str | None = None, *,
                 checkpoint_id: str | None = None, delay: float = 0.5, mount: str | None = None,
                 server_pid: int | None = None, on_fire: Callable[[str], None] = print,
                 tier: str | None = None, sizes: dict[str, int] | None = None, room: int = 0):
        global _active
        self.row, self.nth, self.fault, self.checkpoint_id = row, nth, fault, checkpoint_id
        self.delay, self.mount, self.server_pid, self.on_fire = delay, mount, server_pid, on_fire
        self.tier, self.sizes, self.room = tier, sizes or {}, room
        self.operation = "open"
        self.counts: dict[str, int] = {}
        self.fired = False
        self._matches = 0
        self._lock = threading.Lock()
        _active = self

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail):
        """Count the announcement; strike if it is the chosen one."""
        if phase == Phase.COLLECT:
            # Whether a save's gc finds a leftover depends on the timing of the saves before
            # it, so a seed does not say whether it is reached; gc's deletions are the row
            # GC_ROW (store.gc() in the main thread), through the faulty backends.
            return
        self.at(row_of(phase, self.operation), checkpoint_id, detail.get("file") or tier)

    def gc_deletes(self, path: str) -> None:
        """Called by the faulty backends before each deletion: one made by ``store.gc()`` (in
        the job's main thread) is the row :data:`GC_ROW`."""
        if self.operation == "gc" and not in_drain_thread():
            self.at(GC_ROW, None, path)

    def at(self, row: str, checkpoint_id: str | None, what: str | None) -> None:
        """The job reached ``row`` (of ``checkpoint_id``, on ``what``)."""
        with self._lock:
            self.counts[row] = self.counts.get(row, 0) + 1
            strike = (not self.fired and self.fault is not None and row == self.row
                      and (self.checkpoint_id is None or checkpoint_id == self.checkpoint_id)
                      and (self.tier is None or what == self.tier))
            if strike:
                self._matches += 1
                strike = self._matches == self.nth
                self.fired = self.fired or strike
        if strike:
            self.on_fire(f"{self.fault} at {row} #{self.nth} ({checkpoint_id}, {what})")
            self._strike(row, checkpoint_id)

    def _strike(self, row: str, checkpoint_id: str | None = None) -> None:
        where = f"injected at {row} #{self.nth}"
        if self.fault == "raise":
            raise RuntimeError(f"injected fault ({where})")
        if self.fault in ("enospc", "eio"):
            code = errno.ENOSPC if self.fault == "enospc" else errno.EIO
            raise OSError(code, f"{os.strerror(code)} ({where})")
        if self.fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # the signal is on its way; nothing after this point may run
        elif self.fault == "slow":
            time.sleep(self.delay)
        elif self.fault == "tmpfs-full":
            fill_filesystem(self.mount)
        elif self.fault == FIRST_FULL:
            block = os.statvfs(self.mount).f_frsize
            leave_free(self.mount, self.sizes[checkpoint_id] + self.room * block)
        elif self.fault == "server-death":
            kill_and_wait(self.server_pid)
        else:
            raise ValueError(f"unknown fault {self.fault!r}")


def fill_filesystem(mount: str) -> None:
    """Fill the filesystem at ``mount`` to the last byte with :data:`BALLAST`, so that the next
    write on it fails with a real ENOSPC."""
    with open(os.path.join(mount, BALLAST), "ab", buffering=0) as f:
        st = os.statvfs(mount)
        try:
            os.posix_fallocate(f.fileno(), os.fstat(f.fileno()).st_size,
                               st.f_bavail * st.f_frsize)
        except OSError:
            pass  # what fallocate could not take, the writes below do
        chunk = b"\0" * 4096
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return


def leave_free(mount: str, nbytes: int) -> None:
    """Leave ``nbytes`` free on the filesystem at ``mount`` (none when negative): a
    :data:`BALLAST` file takes the rest (tmpfs counts whole pages, as ``nbytes`` should)."""
    st = os.statvfs(mount)
    extra = st.f_bavail * st.f_frsize - max(nbytes, 0)
    if extra <= 0:
        return
    with open(os.path.join(mount, BALLAST), "ab", buffering=0) as f:
        os.posix_fallocate(f.fileno(), os.fstat(f.fileno()).st_size, extra)


def kill_and_wait(pid: int | None, timeout: float = 10.0) -> None:
    """SIGKILL ``pid`` (the S3 server, not our child) and wait until it is gone, so that what
    follows meets a dead server rather than a dying one."""
    if pid is None:
        raise ValueError("server-death needs the server's pid")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return  # dead; its parent reaps it
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.01)


# -- backends that announce gc's deletions -------------------------------------------------------

def _announcing(base: type) -> type:
    """``base`` with each ``delete`` announced to the active injector first."""

    class Announcing(base):
        __doc__ = f"The built-in {base.__name__}, announcing each deletion (fault injection)."

        def delete(self, path: str) -> None:
            if _active is not None:
                _active.gc_deletes(path)
            super().delete(path)

    Announcing.__name__ = Announcing.__qualname__ = f"Faulty{base.__name__}"
    return Announcing


#: backend name -> class: the built-in backends under ``faults-<name>``.
FAULTY_BACKENDS = {"faults-local": _announcing(LocalBackend),
                   "faults-memory": _announcing(MemoryBackend),
                   "faults-fsspec": _announcing(FsspecBackend)}


@tierstore.hookimpl
def tierstore_register_backends(register):
    """Register :data:`FAULTY_BACKENDS` (pass this module in ``plugins=``)."""
    for name, cls in FAULTY_BACKENDS.items():
        register(name, cls)
