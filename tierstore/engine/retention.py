"""Retention: the only code that evicts (deletes) a committed checkpoint.

The rule, in one place: on a tier with ``keep = N``, a complete checkpoint is evicted when

1. it is not among the N most recently committed complete checkpoints of that tier,
2. it is not pinned (``store.pin``): neither its manifest on that tier, read again under the
   checkpoint's exclusive lock right before the delete, nor what this store was last asked
   (:meth:`Retention.pin_asked`: a pin is told here before it changes any tier, so a pin that
   lands after a pass chose its victims still saves them),
3. nothing in this store still reads it: no drain copying it from that tier, no replication
   sending it, no load reading it (each tells retention what to spare, see :meth:`spare_with`
   and :meth:`loading`), and
4. no other process sharing the directory (a rank of the same node sending it to its peers)
   holds its directory lock; then it is left for the next pass, and
5. it was not committed before the store opened while the open's scan for the drains an
   earlier process left unmade is still running (:meth:`hold_older`): the scan lists first and
   queues after, and a checkpoint evicted between the two would be queued with no source left.

Retention runs after every commit on a tier (a save, a drained copy, a replica) and after each
background job ends on its source, so what was spared is evicted as soon as it is free. Passes
on one tier run one at a time (two would pick the same victim), but a pass on one tier never
waits for a pass on another: a pass lists and deletes on its tier, and on an object store that
answers slowly (retried for up to ``retry_seconds``) that must not stall a save committing on a
healthy tier. A load of a checkpoint waits only for an eviction of that same checkpoint already
under way (it then finds it gone), never for a pass over remote storage. A
failure to evict after a commit is logged and retried at the next pass, never raised into the
commit that already succeeded. Evicted files may be recycled by the backend
(:meth:`tierstore.plugin.Backend.discard`); that is why nothing still reading may be evicted.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

from tierstore.engine.gc import collect_chunks
from tierstore.events import Event, EventKind, Phase
from tierstore.plugin.host import PluginHost
from tierstore.tiers.tier import Tier

__all__ = ["Retention"]

log = logging.getLogger("tierstore.retention")


class Retention:
    """Applies ``keep`` on the tiers of one store (see the module docstring for the rule)."""

    def __init__(self, host: PluginHost, rank: int):
        self._host, self._rank = host, rank
        # Saves (writer thread), drains and replication (their threads) all apply retention:
        # one pass per tier at a time, or two would pick the same victim. One lock per tier,
        # held across that tier's I/O: a slow tier holds up only its own passes.
        self._tier_locks: dict[str, threading.Lock] = {}
        # Guards the counts below and the table of tier locks; never held across I/O, so that
        # a load or a save never waits for a slow tier through it.
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # checkpoint ids being deleted right now: a load of one of them waits for the delete
        # to end (it then finds the checkpoint gone) rather than read a copy going away
        self._evicting: collections.Counter[str] = collections.Counter()
        self._spares: list[Callable[[Tier], set[str]]] = []
        # checkpoint id -> loads of it under way
        self._loading: collections.Counter[str] = collections.Counter()
        # Loads ended by a reader's finalizer: the garbage collector may run it on any thread,
        # inside any lock (this one too), so it only appends here (atomic) and the next
        # retention or load counts it.
        self._loads_released: collections.deque[str] = collections.deque()
        # checkpoint id -> pinned, as this store's pin()/unpin() last asked (under _lock)
        self._pins: dict[str, bool] = {}
        # Held by a pin or unpin from its ask to its last tier's rewrite, and by a drain from
        # its reading of the flag to its rewrite of its copy's: a drain never writes a flag it
        # read before a pin that has finished since (see Drainer._settle_pin).
        self._pinning = threading.RLock()
        # Checkpoints committed before this time are not evicted yet (see hold_older), and
        # the tiers where that spared a victim (a pass runs there again at the release).
        self._held_before: float | None = None
        self._held_on: dict[str, Tier] = {}

    def hold_older(self, before: float) -> None:
        """Spare every checkpoint committed before ``before`` until :meth:`release_older`:
        the open's scan for unmade drains may still queue a copy of one of them."""
        with self._lock:
            self._held_before = before

    def release_older(self) -> None:
        """End :meth:`hold_older`; on each tier where the hold spared a victim, apply ``keep``
        again (what the queued drains do not spare goes now)."""
        with self._lock:
            self._held_before = None
            held_on, self._held_on = list(self._held_on.values()), {}
        for tier in held_on:
            self.apply_quietly(tier)

    def pinning(self) -> threading.RLock:
        """The lock that orders pins, unpins and the flags drains give their copies."""
        return self._pinning

    def ask_pin(self, checkpoint_id: str, pinned: bool | None) -> None:
        """``store.pin``/``unpin`` of ``checkpoint_id`` begins: from now on this store's
        evictions and copies follow it, whatever each tier's manifest says yet. None: forget
        it (a pin that found no copy to change)."""
        with self._lock:
            if pinned is None:
                self._pins.pop(checkpoint_id, None)
            else:
                self._pins[checkpoint_id] = pinned

    def pin_asked(self, checkpoint_id: str) -> bool | None:
        """Whether this store was last asked to pin (True) or unpin (False) ``checkpoint_id``;
        None when it was asked neither."""
        with self._lock:
            return self._pins.get(checkpoint_id)

    def spare_with(self, spared: Callable[[Tier], set[str]]) -> None:
        """Register a source of ids not to evict from a tier yet (a background job's
        ``protected``)."""
        self._spares.append(spared)

    def loading(self, checkpoint_id: str, begins: bool) -> None:
        """Count a load of ``checkpoint_id`` starting (``begins``) or over: while one is under
        way, ``keep`` does not evict that checkpoint from any tier."""
        with self._changed:
            self._count_released_loads()
            if begins:
                self._changed.wait_for(lambda: checkpoint_id not in self._evicting)
            self._count_load(checkpoint_id, 1 if begins else -1)

    def load_released_later(self, checkpoint_id: str) -> None:
        """A load of ``checkpoint_id`` is over, told from a finalizer: safe on any thread and
        inside any lock (it takes none); counted at the next retention or load."""
        self._loads_released.append(checkpoint_id)

    def apply_quietly(self, tier: Tier) -> None:
        """:meth:`apply` after something committed: a failure to evict is logged (and retried
        at the next pass), never raised to the commit that is already done."""
        try:
            self.apply(tier)
        except Exception:
            log.exception("applying keep on tier '%s' failed; the next save retries", tier.name)

    def apply(self, tier: Tier) -> list[str]:
        """Evict what ``keep`` no longer keeps on ``tier``; returns the ids evicted."""
        if tier.config.keep is None:
            return []
        self._host.phase(Phase.RETAIN, None, tier.name, self._rank)
        with self._lock:
            tier_lock = self._tier_locks.setdefault(tier.name, threading.Lock())
        with tier_lock:
            busy: set[str] = set()
            for spared in self._spares:
                busy |= spared(tier)
            complete = tier.complete()
            candidates = tier.retention_victims(complete)
            with self._lock:
                # (read and noted under one lock: a release either comes first, and nothing
                # is held, or after, and its pass on this tier waits for this one's end)
                if self._held_before is not None:
                    held = {cid for cid in candidates
                            if complete[cid].committed < self._held_before}
                    if held:
                        self._held_on[tier.name] = tier
                    busy |= held
            victims = [cid for cid in candidates
                       if cid not in busy and self._evict_unless_loading(tier, cid)]
        for cid in victims:
            self._host.event(Event(EventKind.EVICTED, cid, tier.name, self._rank))
            log.info("evicted %s from tier '%s' (keep = %d)", cid, tier.name, tier.config.keep)
        if victims:
            collect_chunks(tier, self._host, self._rank)  # what only they named
        return victims

    def _evict_unless_loading(self, tier: Tier, checkpoint_id: str) -> bool:
        """Evict ``checkpoint_id`` unless a load of it is under way, decided right before the
        delete under the counts' lock; a load that begins during the delete waits for it."""
        with self._changed:
            self._count_released_loads()
            if checkpoint_id in self._loading:
                return False
            self._evicting[checkpoint_id] += 1
        try:
            return self._evict(tier, checkpoint_id)
        finally:
            with self._changed:
                self._evicting[checkpoint_id] -= 1
                if self._evicting[checkpoint_id] <= 0:
                    del self._evicting[checkpoint_id]
                self._changed.notify_all()

    def _evict(self, tier: Tier, checkpoint_id: str) -> bool:
        """Evict ``checkpoint_id`` from ``tier`` unless another process (a rank sharing the
        directory) still sends it; then the next retention on the tier does."""
        lock = tier.backend.lock_directory(checkpoint_id, exclusive=True)
        if lock is None:
            log.info("not evicting %s from tier '%s' yet: another process is reading it",
                     checkpoint_id, tier.name)
            return False
        try:
            # Pinned since the pass chose it? A pin rewrites the manifest under the shared
            # lock, so what is read under the exclusive one is the flag as it now is.
            if self.pin_asked(checkpoint_id):
                return False
            manifest = tier.read_manifest(checkpoint_id)
            if manifest is not None and manifest.pinned:
                return False
            tier.delete(checkpoint_id, evicted=True)
        except FileNotFoundError:
            return False  # gone meanwhile (gc, or another process sharing the directory)
        finally:
            lock.release()
        return True

    def _count_released_loads(self) -> None:
        while self._loads_released:
            self._count_load(self._loads_released.popleft(), -1)

    def _count_load(self, checkpoint_id: str, change: int) -> None:
        self._loading[checkpoint_id] += change
        if self._loading[checkpoint_id] <= 0:
            del self._loading[checkpoint_id]
