"""Saves handed to DCP's checkpoint process (``AsyncCheckpointerType.PROCESS``).

DCP pickles the storage writer and sends it to a long-lived process of its own, which calls it
like any writer. The writer carries a callable (picklable by reference) that opens the same
store there from a :class:`~tierstore.config.spec.StoreSpec` (the config and the plugins, by
reference); that store writes and commits the first tier and leaves drains to slower tiers and
retention to the training process, whose store owns the drain threads, ``wait()`` and the exit
handler. :class:`HandOff` is the training process's side: it adopts what the checkpoint process
committed.

Layer: process edges, beside ``tierstore.preemption``, under ``tierstore.store`` and above the
DCP adapters; it never imports the store (the store passes what opens one).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from tierstore.config.spec import StoreSpec
from tierstore.engine.drain import Drainer
from tierstore.engine.health import TierHealth
from tierstore.engine.listings import Listings
from tierstore.engine.recovery import queue_missing_copies
from tierstore.engine.retention import Retention
from tierstore.errors import ConfigError
from tierstore.tiers.tierset import TierSet

__all__ = ["HandOff", "checkpoint_process_store"]


class HandOff:
    """The training process's side of saves handed to DCP's checkpoint process."""

    def __init__(self, spec: StoreSpec, tiers: TierSet, rank: int, drainer: Drainer,
                 retention: Retention, health: TierHealth,
                 reopen: Callable[[StoreSpec, str | None], Any],
                 listings: Listings, job: str | None):
        self._spec, self._tiers, self._rank, self._health = spec, tiers, rank, health
        self._job = job  # the job's token: the checkpoint process claims tiers with it
        self._listings = listings
        self._drainer, self._retention, self._reopen = drainer, retention, reopen
        self._handed_off = False  # this store gave saves to DCP's checkpoint process
        self._lock = threading.Lock()

    def reopen_callable(self) -> Callable[[], Any]:
        """Called when a save goes to DCP's checkpoint process: a picklable callable that gives
        that process its services for this store. Its drains are queued here once it has
        committed (:meth:`adopt`)."""
        if self._tiers.node_local:
            raise ConfigError(
                "dcp.async_save with AsyncCheckpointerType.PROCESS is not supported with "
                "node-local tiers ({node} or {rank} in a path): their drains are coordinated by "
                "the ranks that saved; use AsyncCheckpointerType.THREAD (the default)"
            )
        self._handed_off = True
        # Another process commits from now on: a look at a tier may miss its commits.
        self._listings.max_age_s = 0.0
        return functools.partial(self._reopen, self._spec, self._job)

    def adopt(self) -> None:
        """Queue the drains (and apply the retention) of saves that DCP's checkpoint process
        committed; a no-op unless this store handed saves to it."""
        if not self._handed_off or self._rank != 0:
            return
        with self._lock:  # one scan at a time, or both would queue the same copy
            queue_missing_copies(list(self._tiers), self._drainer, self._health,
                                 self._listings)
            for tier in self._tiers:
                self._retention.apply(tier)

    def adopt_later(self) -> None:
        """:meth:`adopt` in a background thread: listing tiers and deleting what ``keep`` drops
        must not lengthen the training stall of the next ``async_save``."""
        if self._handed_off and self._rank == 0:
            threading.Thread(target=self.adopt, name="tierstore-adopt", daemon=True).start()


_stores: dict[str, Any] = {}
_stores_lock = threading.Lock()


def checkpoint_process_store(spec: StoreSpec, open_store: Callable[[StoreSpec], Any]) -> Any:
    """The store of this (checkpoint) process for ``spec``, opened with ``open_store`` on first
    use and kept for the process's later saves.

    Opening is collective under torch.distributed; DCP calls ``writer.reset`` on every rank in
    the same order, which is where this runs."""
    with _stores_lock:
        store = _stores.get(spec.key)
        if store is None:
            store = _stores[spec.key] = open_store(spec)
        return store
