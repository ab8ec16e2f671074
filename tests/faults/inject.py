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
from tierstore_plugins.obstore_backend import ObstoreBackend  # (imports obstore only when used)

import tierstore
from tierstore import Phase

__all__ = ["BALLAST", "FAULTS", "FIRST_FULL", "FULL_FAULTS", "GC_ROW", "Injector",
           "fill_filesystem", "leave_free", "row_of"]

#: The fault kinds, in the table's column order. The second line are the kinds of issue 25:
#: a ``tierstore`` command run beside a drain held at its fault point (``cli``), the drain's
#: source file corrupted or removed under it (``corrupt-source``, ``vanish-source``), the S3
#: server frozen for a few seconds (``flaky``: SIGSTOP, then SIGCONT), a drain's retention on
#: the slow tier stalled while the job saves (``stall``). ``race``: no fault at all, the column of
#: the race kinds (``backtoback``, ``auto``, ``pins``: tests/faults/races.py), where the library's
#: own concurrency is the adversary. ``cotenant`` and ``fuzz``: the columns of the hostile
#: kinds (tests/faults/cotenant.py: a second user plants links and directories under the tier
#: roots; tests/faults/fuzz.py: one field of a manifest or ``.metadata`` replaced).
FAULTS = ("raise", "sigkill", "enospc", "tmpfs-full", "first-full", "eio", "slow",
          "server-death", "cli", "corrupt-source", "vanish-source", "flaky", "stall", "race",
          "cotenant", "fuzz")

#: How long a ``stall`` holds a drain's retention on the slow tier (seconds): the first
#: deletion of that retention sleeps this long.
STALL_S = 3.0
#: How long a ``tierstore`` command beside a live drain may take before it counts as hung.
CLI_TIMEOUT = 60.0
#: The commands a ``cli`` trial runs beside the drain (by the trial's nth).
CLI_COMMANDS = ("ls", "status", "verify")

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
    if operation in ("scrub", "promote") and not in_drain_thread():
        return f"{operation}/{phase}"  # the operator's copies (Drainer.copy_now, this thread)
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
        #: set by the job (workload.run_job): where new kinds write what they saw
        self.journal = None
        self.place = None
        self.scenario = None
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

    def deleting(self, path: str) -> None:
        """Called by the faulty backends before each deletion: a ``stall`` armed by a
        retention in this thread stalls it here (see ``_strike``)."""
        if getattr(self, "_stall_thread", None) == threading.get_ident():
            self._stall_thread = None
            start = time.time()
            time.sleep(STALL_S)
            self._note("stalled", f"{start:.3f}", f"{time.time():.3f}", path)

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
            self._strike(row, checkpoint_id, what)

    def _note(self, *words: object) -> None:
        if self.journal is not None:
            self.journal.write(*words)

    def _strike(self, row: str, checkpoint_id: str | None = None,
                what: str | None = None) -> None:
        where = f"injected at {row} #{self.nth}"
        if self.fault == "cli":
            # Only once the job's main thread waits for this drain (the save that queued it
            # has returned, its own retention done) are the tiers still but for the command.
            deadline = time.monotonic() + 20
            while self.operation != "wait" and time.monotonic() < deadline:
                time.sleep(0.01)
            self._note(*run_cli_beside(self.scenario, self.place, checkpoint_id,
                                       CLI_COMMANDS[self.nth % len(CLI_COMMANDS)]))
            return
        if self.fault in ("corrupt-source", "vanish-source"):
            self._note(*spoil_source(self.place.fast, checkpoint_id, what, self.fault))
            return
        if self.fault == "flaky":
            freeze(self.server_pid, 3 * self.delay)
            return
        if self.fault == "stall":
            # The stall strikes inside retention: at the next deletion this thread makes on
            # the tier (an eviction), where the store may hold its locks.
            self._stall_thread = threading.get_ident()
            return
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


def spoil_source(fast: str, cid: str | None, name: str | None, fault: str) -> list[str]:
    """Flip a byte of (``corrupt-source``) or remove (``vanish-source``) the file ``name`` of
    ``cid`` on the first tier at ``fast``, as a drain is about to copy it; the journal line
    that says so (``spoiled fast CID NAME``, or ``error`` when there was nothing to spoil)."""
    path = os.path.join(fast, cid or "-", name or "-")
    try:
        if fault == "vanish-source":
            os.remove(path)
        else:
            fd = os.open(path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                at = size // 2
                byte = os.pread(fd, 1, at)
                os.pwrite(fd, bytes([byte[0] ^ 0xFF]) if byte else b"x", at)
            finally:
                os.close(fd)
    except OSError as exc:
        return ["note", f"{fault}: nothing to spoil at {path}: {exc}"]
    return ["spoiled", "fast", cid, name, fault]


def freeze(pid: int | None, seconds: float) -> None:
    """Stop the S3 server (SIGSTOP) and let it go on after ``seconds`` (SIGCONT, from a thread
    that ends with it): a flaky object store that does not answer for a while."""
    if pid is None:
        raise ValueError("flaky needs the server's pid")
    os.kill(pid, signal.SIGSTOP)

    def wake():
        time.sleep(seconds)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    threading.Thread(target=wake, name="faults-wake", daemon=True).start()


def tier_snapshot(tiers: list[dict]) -> dict[str, tuple[int, int]]:
    """Every file and directory on the directory tiers of ``tiers`` (hidden ones included):
    {tier/relative path: (size, mtime_ns)} (directories: (-1, 0))."""
    out = {}
    for tier in tiers:
        root = tier.get("path")
        if root is None:
            continue
        for d, dirs, names in os.walk(root):
            for n in dirs:
                out[f"{tier['name']}/{os.path.relpath(os.path.join(d, n), root)}/"] = (-1, 0)
            for n in names:
                try:
                    st = os.lstat(os.path.join(d, n))
                except FileNotFoundError:
                    continue
                out[f"{tier['name']}/{os.path.relpath(os.path.join(d, n), root)}"] = \
                    (st.st_size, st.st_mtime_ns)
    return out


def toml_text(config: dict) -> str:
    """``config`` (a store's config as the matrix builds it: scalars, lists, one level of
    tables and arrays of tables) as TOML."""
    import json as _json

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return _json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{_json.dumps(k)} = {value(x)}" for k, x in v.items()) + "}"
        raise TypeError(f"no TOML for {v!r}")

    lines = []
    for key, table in config.items():
        for entry in table if isinstance(table, list) else [table]:
            lines.append(f"[[{key}]]" if isinstance(table, list) else f"[{key}]")
            lines += [f"{k} = {value(v)}" for k, v in entry.items()]
            lines.append("")
    return "\n".join(lines)


def run_cli_beside(scenario, place, cid: str | None, command: str) -> list[str]:
    """Run ``tierstore COMMAND`` (a new process, on the same tiers, plain backends) while this
    drain waits at its fault point, the rest of the job waiting for it: the command must end in
    time, succeed, and change nothing on any tier. The journal line: ``cli ...`` when it kept
    to that, ``broken ...`` (a violation) when not."""
    import subprocess
    import sys

    config = scenario.config(place, faulty=False)
    toml = os.path.join(os.path.dirname(place.journal), "cli.toml")
    with open(toml, "w") as f:
        f.write(toml_text(config))
    if command == "verify" and cid is None:
        command = "status"  # (a retention names no checkpoint)
    args = [sys.executable, "-m", "tierstore.cli", command, toml, "--json"]
    if command == "verify":
        args.insert(-1, cid or "-")
    before = tier_snapshot(config["tier"])
    started = time.monotonic()
    env = dict(os.environ)
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=CLI_TIMEOUT,
                              env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return ["broken", f"tierstore {command} beside a live drain of {cid} did not finish "
                          f"in {CLI_TIMEOUT:.0f} s"]
    seconds = time.monotonic() - started
    after = tier_snapshot(config["tier"])
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if changed:
        return ["broken", f"tierstore {command} beside a live drain of {cid} changed "
                          f"{len(changed)} entries on the tiers: {changed[:6]}"]
    if done.returncode != 0:
        return ["broken", f"tierstore {command} beside a live drain of {cid} exited "
                          f"{done.returncode}: {(done.stderr or done.stdout)[-300:]}"]
    return ["cli", command, cid, "ok", f"{seconds:.2f}s"]


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
    """``base`` with each ``delete`` announced to the active injector first (and each
    ``discard``, an eviction, to a ``stall`` armed in the calling thread)."""

    class Announcing(base):
        __doc__ = f"The built-in {base.__name__}, announcing each deletion (fault injection)."

        def delete(self, path: str) -> None:
            if _active is not None:
                _active.gc_deletes(path)
                _active.deleting(path)
            super().delete(path)

        def discard(self, path: str) -> None:  # an eviction (Tier.delete(evicted=True))
            if _active is not None:
                _active.deleting(path)
            super().discard(path)

    Announcing.__name__ = Announcing.__qualname__ = f"Faulty{base.__name__}"
    return Announcing


#: backend name -> class: the built-in backends under ``faults-<name>``.
FAULTY_BACKENDS = {"faults-local": _announcing(LocalBackend),
                   "faults-memory": _announcing(MemoryBackend),
                   "faults-fsspec": _announcing(FsspecBackend),
                   "faults-obstore": _announcing(ObstoreBackend)}


@tierstore.hookimpl
def tierstore_register_backends(register):
    """Register :data:`FAULTY_BACKENDS` (pass this module in ``plugins=``)."""
    for name, cls in FAULTY_BACKENDS.items():
        register(name, cls)
