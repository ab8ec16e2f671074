"""Garbage collection: removing what interrupted saves, drains and deletes left on a tier
(hidden staging directories, marked prefixes), never a committed checkpoint and never work in
progress: a save in flight in this process (its token), or a directory any writer still holds
(``Tier.begin_save`` locks it; the lock dies with its process). An orphan part, a node-local
part whose checkpoint the coordinator never committed (see ``tierstore.engine.publish``), is
such a leftover too, though it has a manifest: nothing can ever load it."""

from __future__ import annotations

import logging
from collections.abc import Collection

from tierstore.engine.saves import SaveLedger
from tierstore.events import Event, EventKind, Phase
from tierstore.plugin.host import PluginHost
from tierstore.tiers.tier import Tier

__all__ = ["GarbageCollector", "collect_chunks"]

log = logging.getLogger("tierstore.gc")


class GarbageCollector:
    """Collects leftovers on the tiers of one store, sparing its saves in flight."""

    def __init__(self, host: PluginHost, rank: int, ledger: SaveLedger):
        self._host, self._rank, self._ledger = host, rank, ledger

    def collect(self, tier: Tier, protect: Collection[str] = (), *,
                chunks: bool = False) -> list[str]:
        """Remove what interrupted saves left on ``tier`` (sparing saves in flight and the
        tokens in ``protect``); returns the entries removed. On a deduplicated tier the chunks
        nothing names any more go too, after a leftover went or when ``chunks`` asks (the
        operator's ``gc``)."""
        removed = []
        for name in tier.leftovers(protect=self._ledger.tokens_in_flight() | set(protect)):
            self._host.phase(Phase.COLLECT, None, tier.name, self._rank, entry=name)
            if tier.remove_leftover(name) and self._gone(tier, name):
                removed.append(name)
        for name in removed:
            self._host.event(Event(EventKind.COLLECTED, None, tier.name, self._rank,
                                   detail={"entry": name}))
            log.info("removed leftover %s from tier '%s'", name, tier.name)
        if removed or chunks:
            collect_chunks(tier, self._host, self._rank, force=chunks)
        return removed

    def _gone(self, tier: Tier, name: str) -> bool:
        """Whether leftover ``name`` is really gone after its delete: a backend may remove a
        tree as far as it can and stay quiet about the rest (a file it may not unlink), and gc
        reports only what it removed. What is left is said (a warning, a ``failed`` event)
        and tried again by the next gc."""
        left = tier.backend.list(name)
        if not left:
            return True
        log.warning("tier '%s': could not remove all of leftover %s: %d entr%s left in it "
                    "(%s); the next gc tries again", tier.name, name, len(left),
                    "y" if len(left) == 1 else "ies", ", ".join(left[:5]))
        self._host.event(Event(EventKind.FAILED, None, tier.name, self._rank,
                               detail={"entry": name, "left": left,
                                       "error": "leftover not removed completely"}))
        return False

    def collect_orphan(self, tier: Tier, checkpoint_id: str) -> bool:
        """Remove the orphan part ``checkpoint_id`` from ``tier`` (the caller established that
        its checkpoint was never committed), unless another process still holds it; returns
        whether it was removed."""
        self._host.phase(Phase.COLLECT, checkpoint_id, tier.name, self._rank, entry=checkpoint_id)
        lock = tier.backend.lock_directory(checkpoint_id, exclusive=True)
        if lock is None:
            log.info("tier '%s': not collecting the orphan part %s yet: another process holds "
                     "it", tier.name, checkpoint_id)
            return False
        try:
            tier.delete(checkpoint_id)
        except FileNotFoundError:
            return False
        finally:
            lock.release()
        self._host.event(Event(EventKind.COLLECTED, checkpoint_id, tier.name, self._rank,
                               detail={"entry": checkpoint_id, "orphan_part": True}))
        log.info("removed %s from tier '%s': a part of a save that was never committed",
                 checkpoint_id, tier.name)
        return True


def collect_chunks(tier: Tier, host: PluginHost, rank: int, force: bool = False) -> None:
    """On a deduplicated tier, remove the chunks nothing there names any more (after an
    eviction or a leftover's removal; ``force``: the operator's ``gc``, even where no pass is
    due), with a ``collected`` event saying how many; a failure is logged, never raised (the
    next pass collects)."""
    try:
        done = tier.collect_chunks(force)
    except Exception:  # noqa: BLE001 - what is not collected now is collected later
        log.exception("tier '%s': collecting unreferenced chunks failed; the next pass "
                      "tries again", tier.name)
        return
    if done is None or not done.chunks:
        return
    host.event(Event(EventKind.COLLECTED, None, tier.name, rank,
                     nbytes=done.nbytes, detail={"chunks": done.chunks}))
    log.info("tier '%s': removed %d chunks (%d bytes) no checkpoint names any more",
             tier.name, done.chunks, done.nbytes)
