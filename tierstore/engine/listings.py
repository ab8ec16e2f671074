"""One look at a shared object store serves every question a restart asks of it.

A restart asks a tier what it holds three times in its first seconds: the scan that resumes
unfinished drains (at open), ``latest()``, and the load that follows (which copies are there).
On an object store each look is a LIST and a GET per manifest, and at a thousand ranks whatever
a process asks is asked a thousand times: so one rank looks (the tier's leader) and tells the
others (``latest()`` gathers what it found, a load broadcasts the manifests it needs), and that
rank looks once for all three questions. :class:`Listings` keeps the last look at each tier
with an inventory (object stores: ``Backend.inventory``) and answers from it while it is fresh:
taken at the tier's current ``changes`` count (this process has committed, pinned or deleted
nothing there since) and at most :data:`MAX_AGE_S` old. Other processes' changes in that time
(another job's ``gc``, a checkpoint process's commit) are seen at the next look; a load that
finds a file gone fails on it and falls back to another tier, as with any copy lost under it.

Tiers without an inventory (local directories, tmpfs) are asked afresh every time: a stat per
file costs nothing remote.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from tierstore.format.manifest import Manifest
from tierstore.tiers.tier import Holding, Tier

__all__ = ["Listings", "MAX_AGE_S", "TierLook"]

#: seconds a look at an object store answers for (a restart's open, latest() and load fit)
MAX_AGE_S = 30.0


@dataclass(frozen=True)
class TierLook:
    """What one tier held at one look: its checkpoints with a manifest."""

    tier: str
    #: ``Tier.changes`` when the look was taken
    changes: int
    #: ``time.monotonic()`` when it was taken
    taken: float
    holdings: tuple[Holding, ...]

    def complete(self) -> dict[str, Manifest]:
        """Every checkpoint complete at the look, by id."""
        return {h.checkpoint_id: h.manifest for h in self.holdings if h.complete}

    def holding(self, checkpoint_id: str) -> Holding | None:
        """The holding of ``checkpoint_id`` (complete or not), or None."""
        return next((h for h in self.holdings if h.checkpoint_id == checkpoint_id), None)


class Listings:
    """The last look at each tier with an inventory, reused while fresh (module docstring)."""

    def __init__(self, max_age_s: float = MAX_AGE_S):
        #: how long a look answers for; 0: every question looks afresh (a store whose saves
        #: another process commits, DCP's checkpoint process, sets it: this process's
        #: ``changes`` counts do not see those commits)
        self.max_age_s = max_age_s
        self._looks: dict[str, TierLook] = {}
        self._guard = threading.Lock()
        # one lock per tier: callers asking at once wait for the one look in progress
        self._looking: dict[str, threading.Lock] = {}

    def look(self, tier: Tier) -> TierLook:
        """What ``tier`` holds: a fresh look's answer, or a new look (raises what the tier
        raises; callers ask through ``TierHealth``)."""
        with self._guard:
            lock = self._looking.setdefault(tier.name, threading.Lock())
        with lock:
            kept = self._fresh(tier)
            if kept is not None:
                return kept
            changes = tier.changes
            holdings, remote = tier.holdings()
            look = TierLook(tier.name, changes, time.monotonic(), tuple(holdings))
            if remote:  # (a local tier is asked afresh: that costs nothing remote)
                with self._guard:
                    self._looks[tier.name] = look
            return look

    def complete(self, tier: Tier) -> dict[str, Manifest]:
        """Every checkpoint complete on ``tier``, by id (see :meth:`look`)."""
        return self.look(tier).complete()

    def kept(self, tier: Tier) -> TierLook | None:
        """The fresh look at ``tier`` this store holds, if any (no I/O)."""
        with self._guard:
            return self._fresh(tier)

    def _fresh(self, tier: Tier) -> TierLook | None:
        look = self._looks.get(tier.name)
        if look is None or look.changes != tier.changes \
                or time.monotonic() - look.taken > self.max_age_s:
            return None
        return look

