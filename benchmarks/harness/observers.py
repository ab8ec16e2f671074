"""Observers a benchmark passes to ``tierstore.open(plugins=[...])`` to time what a store does
in the background: each tier's drain, and the staging copy of an async save."""

from __future__ import annotations

import threading
import time
from typing import Any

import tierstore
from tierstore.events import EventKind


class DrainTimer:
    """Keeps each tier's drain_finished event (its seconds, bytes and ``at``) and the process
    CPU time used between that tier's drain_started and drain_finished."""

    def __init__(self) -> None:
        """No drain seen yet."""
        self.finished: dict[str, Any] = {}
        self.cpu: dict[str, float] = {}
        self._cpu0: dict[str, float] = {}
        self._lock = threading.Lock()

    @tierstore.hookimpl
    def tierstore_event(self, event) -> None:
        """Note the drains' starts and ends; ignore the rest."""
        with self._lock:
            if event.kind == EventKind.DRAIN_STARTED:
                self._cpu0[event.tier] = time.process_time()
            elif event.kind == EventKind.DRAIN_FINISHED:
                self.cpu[event.tier] = time.process_time() - self._cpu0.pop(event.tier, 0.0)
                self.finished[event.tier] = event


class StagedEvents:
    """Keeps the ``staged`` events of async saves (the staging plugin's copy: its seconds, the
    seconds ``stage()`` waited for the previous save, whether the buffers were reused)."""

    def __init__(self) -> None:
        """No event seen yet."""
        self.events: list[Any] = []
        self._lock = threading.Lock()

    def __reduce__(self):
        """Pickles as a fresh, empty observer: with DCP's process executor the store's plugins
        travel to its checkpoint process, which stages nothing."""
        return (StagedEvents, ())

    @tierstore.hookimpl
    def tierstore_event(self, event) -> None:
        """Keep ``staged`` events; ignore the rest."""
        if event.kind == EventKind.STAGED:
            with self._lock:
                self.events.append(event)

    def take(self) -> Any:
        """The newest ``staged`` event (None when there is none), every one kept so far
        forgotten."""
        with self._lock:
            newest = self.events[-1] if self.events else None
            self.events.clear()
            return newest
