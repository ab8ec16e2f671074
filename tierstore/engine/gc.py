"""Garbage collection: removing what interrupted saves, drains and deletes left on a tier
(hidden staging directories, marked prefixes), never a committed checkpoint and never work in
progress: a save in flight in this process (its token), or a directory any writer still holds
(``Tier.begin_save`` locks it; the lock dies with its process)."""

from __future__ import annotations

import logging
from collections.abc import Collection

from tierstore.engine.saves import SaveLedger
from tierstore.events import Event, EventKind, Phase
from tierstore.plugin.host import PluginHost
from tierstore.tiers.tier import Tier

__all__ = ["GarbageCollector"]

log = logging.getLogger("tierstore.gc")


class GarbageCollector:
    """Collects leftovers on the tiers of one store, sparing its saves in flight."""

    def __init__(self, host: PluginHost, rank: int, ledger: SaveLedger):
        self._host, self._rank, self._ledger = host, rank, ledger

    def collect(self, tier: Tier, protect: Collection[str] = ()) -> list[str]:
        """Remove what interrupted saves left on ``tier`` (sparing saves in flight and the
        tokens in ``protect``); returns the entries removed."""
        removed = []
        for name in tier.leftovers(protect=self._ledger.tokens_in_flight() | set(protect)):
            self._host.phase(Phase.COLLECT, None, tier.name, self._rank, entry=name)
            if tier.remove_leftover(name):
                removed.append(name)
        for name in removed:
            self._host.event(Event(EventKind.COLLECTED, None, tier.name, self._rank,
                                   detail={"entry": name}))
            log.info("removed leftover %s from tier '%s'", name, tier.name)
        return removed
