"""Leases: who owns work in progress on a tier without file locks (an object store).

A writer (a save, a drain) holds a *lease* on the prefix it writes: an object
``<prefix>/.tierstore-lease.<id>`` that says until when (wall clock, seconds since the epoch),
renewed by a background thread every third of the lease's length while the writer holds it,
and deleted when it lets go. Garbage collection in any process removes a prefix only when no
lease on it is current; a killed writer's lease stops being renewed and expires, so what it left
is collected after ``lease_seconds`` (plus the clock skew allowed between hosts).

A renewal never outlives its lease: the renewing thread checks that the lease is still held
and marks it as being renewed in one step under the keeper's lock, and letting go of a lease
waits for a renewal of it in flight before deleting the object. Otherwise a renewal that read
the lease as held just before it was let go of would write the object again after its delete,
and that stray lease would keep gc and ``keep`` away from the prefix for ``lease_seconds`` + 60 s.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Callable

from tierstore.plugin import DirectoryLock

__all__ = ["LEASE_PREFIX", "Lease", "LeaseKeeper", "lease_is_current", "lock_by_leases"]

log = logging.getLogger("tierstore.leases")

LEASE_PREFIX = ".tierstore-lease."
#: how far two hosts' clocks may disagree: a lease counts this much longer for others
CLOCK_SKEW_S = 60.0


def lease_is_current(raw: bytes, now: float) -> bool:
    """Whether the lease object ``raw`` still holds at ``now``; an unreadable one does (never
    delete work on a guess)."""
    try:
        expires = float(json.loads(raw)["expires"])
    except (ValueError, KeyError, TypeError):
        return True
    return now < expires + CLOCK_SKEW_S


class Lease(DirectoryLock):
    """A writer's lease on one prefix; ``release()`` stops renewing it and deletes it."""

    def __init__(self, keeper: "LeaseKeeper", path: str):
        self.keeper, self.path = keeper, path

    def release(self) -> None:
        """End the lease (idempotent)."""
        self.keeper.drop(self)


class LeaseKeeper:
    """Writes, renews and deletes the leases of one backend, renewing from one daemon thread.

    ``write(path, data)`` and ``delete(path)`` are the backend's own primitives."""

    def __init__(self, seconds: float, write: Callable[[str, bytes], None],
                 delete: Callable[[str], None]):
        self.seconds = seconds
        self._write, self._delete = write, delete
        self._held: set[Lease] = set()
        # Leases let go of here whose object could not be deleted (the store was down): gc in
        # this process knows they are over, whatever they say.
        self._released: set[str] = set()
        self._lock = threading.Lock()
        # Signalled when a renewal ends: drop() waits on it for a renewal of its lease.
        self._renewed = threading.Condition(self._lock)
        self._renewing: set[Lease] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self, prefix: str) -> Lease:
        """A new lease on ``prefix``, written before this returns."""
        lease = Lease(self, f"{prefix}/{LEASE_PREFIX}{uuid.uuid4().hex[:16]}")
        self._renew(lease)
        with self._lock:
            self._held.add(lease)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tierstore-leases",
                                                daemon=True)
                self._thread.start()
        return lease

    def drop(self, lease: Lease) -> None:
        """Stop renewing ``lease`` and delete it (a failed delete only leaves it to expire)."""
        with self._renewed:
            if lease not in self._held:
                return
            self._held.discard(lease)
            # A renewal of it in flight writes the object: delete after it, not before.
            self._renewed.wait_for(lambda: lease not in self._renewing)
        try:
            self._delete(lease.path)
        except Exception as exc:  # noqa: BLE001 - it expires on its own
            with self._lock:
                self._released.add(lease.path)
            log.warning("could not delete lease %s (%s); it expires in %.0f s", lease.path, exc,
                        self.seconds)

    def released_here(self, path: str) -> bool:
        """Whether the lease object ``path`` is one this process held and let go of."""
        with self._lock:
            return path in self._released

    def close(self) -> None:
        """Stop the renewing thread (the store closes; its writers are done)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _renew(self, lease: Lease) -> None:
        body = {"expires": time.time() + self.seconds, "host": socket.gethostname(),
                "pid": os.getpid()}
        self._write(lease.path, json.dumps(body).encode())

    def _run(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            with self._lock:
                held = list(self._held)
            for lease in held:
                with self._lock:
                    if lease not in self._held:
                        continue  # let go of since the list was taken: its object is deleted
                    self._renewing.add(lease)
                try:
                    self._renew(lease)
                except Exception as exc:  # noqa: BLE001 - a failing store fails the writer too
                    log.warning("could not renew lease %s: %s", lease.path, exc)
                finally:
                    with self._renewed:
                        self._renewing.discard(lease)
                        self._renewed.notify_all()


def lock_by_leases(backend, keeper: "LeaseKeeper", path: str, *,
                   exclusive: bool) -> DirectoryLock | None:
    """``Backend.lock_directory`` for a store without file locks (an object store): shared, a
    lease on prefix ``path`` taken by ``keeper`` and renewed while held; exclusive (gc, keep),
    granted unless some writer's lease on ``path`` is current. ``backend`` lists and reads."""
    if not exclusive:
        return keeper.take(path)
    now = time.time()
    for name in backend.list(path):
        if not name.startswith(LEASE_PREFIX) or keeper.released_here(f"{path}/{name}"):
            continue
        try:
            raw = backend.read_bytes(f"{path}/{name}")
        except FileNotFoundError:
            continue  # released meanwhile
        if lease_is_current(raw, now):
            return None
    return DirectoryLock()
