"""``[store] events_log``: every event of every rank, appended to one file as JSON lines.

What ``tierstore goodput`` turns into a goodput report, and what a user greps after a bad night.
Each line is one :class:`~tierstore.events.Event` as a JSON object (its fields, plus ``pid``),
written with a single ``write(2)`` on a file opened ``O_APPEND``: the ranks of a node, and the
runs of a job restarted after a failure, append to the same file without ever interleaving
within a line. A line cut short by a process killed in its write is the only damage a reader has
to expect (and skips). Logging never fails the job: a write that fails is reported once and the
log goes quiet.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading

from tierstore.events import Event
from tierstore.plugin import hookimpl

__all__ = ["EventsLog"]

log = logging.getLogger(__name__)


class EventsLog:
    """An observer (a plugin object) that appends each event it sees to a file, once
    :meth:`start` named the file; before that, and after :meth:`stop`, it logs nothing (a
    read-only store, a query beside the job, never starts it)."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._path: str | None = None
        self._guard = threading.Lock()

    def start(self, path: str) -> None:
        """Append to ``path`` from now on (made with its directory if missing)."""
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        with self._guard:
            self._fd, self._path = fd, path

    def stop(self) -> None:
        """Log nothing more; close the file."""
        with self._guard:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @hookimpl
    def tierstore_event(self, event: Event) -> None:
        """Append ``event`` as one JSON line (the store's observer hook)."""
        self.append(event)

    def append(self, event: Event) -> None:
        """Append ``event`` as one JSON line: the one place the log's line format is made
        (a job that logs without a store, as the simulator's stock job does, calls this)."""
        if self._fd is None:
            return
        record = dataclasses.asdict(event)
        record["pid"] = os.getpid()
        line = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
        with self._guard:
            if self._fd is None:
                return
            try:
                os.write(self._fd, line)
            except OSError as exc:
                log.warning("events log %s: cannot append (%s); no more events are logged",
                            self._path, exc)
                os.close(self._fd)
                self._fd = None
