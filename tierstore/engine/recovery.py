"""Recovery at open: queueing the drains nobody made (an earlier process was killed mid-drain,
or exited first; or a save was made in DCP's checkpoint process)."""

from __future__ import annotations

import logging

from tierstore.engine.drain import DrainJob, Drainer, PendingCopy
from tierstore.engine.health import TierHealth
from tierstore.engine.listings import Listings
from tierstore.tiers.tier import Tier

__all__ = ["queue_missing_copies"]

log = logging.getLogger("tierstore.recovery")


def queue_missing_copies(tiers: list[Tier], drainer: Drainer, health: TierHealth,
                         listings: Listings, before: float = float("inf")) -> None:
    """Queue the copies nobody has made. A copy is missing when a checkpoint is complete on a
    faster tier, absent from a slower tier that takes its step, newer than everything there
    (older ones were evicted by keep), and not queued already. An object store is looked at
    once (``listings``: the look ``latest()`` then reuses).

    ``before``: only checkpoints committed before this time (the store's open) are an earlier
    process's; a later one is this process's own save, whose drain its save queues (the scan
    runs beside the first saves, and must not queue their drains a second time)."""
    queued = set(drainer.pending())
    jobs: dict[str, tuple[Tier, list[Tier], float, object]] = {}
    looks = [health.ask(tier, "resuming drains", lambda t=tier: listings.look(t), None)
             for tier in tiers]
    answered = [None if look is None else look.complete() for look in looks]
    begun = {t.name: {h.checkpoint_id for h in look.holdings}
             for t, look in zip(tiers, looks) if look is not None}
    # A tier that did not answer is neither a source nor a target of this scan.
    tiers = [t for t, c in zip(tiers, answered) if c is not None]
    complete = [c for c in answered if c is not None]
    for j, target in enumerate(tiers):
        on_target = complete[j]
        newest = max((m.committed for m in on_target.values()), default=float("-inf"))
        for i in range(j):
            for cid, manifest in complete[i].items():
                # (due, not takes: a resumed drain is not a save and must not move an auto
                # tier's schedule on this rank alone, which would part it from the others)
                if (manifest.step is None or not target.due(manifest.step)
                        or manifest.committed >= before
                        or cid in on_target or manifest.committed <= newest
                        or PendingCopy(cid, target.name) in queued
                        or cid in begun.get(target.name, ())):
                    continue
                _, targets, _, _ = jobs.setdefault(cid, (tiers[i], [], manifest.committed,
                                                         manifest))
                if target not in targets:
                    targets.append(target)
    for cid, (source, targets, _, manifest) in sorted(jobs.items(), key=lambda kv: kv[1][2]):
        log.info("queueing the drain of %s from '%s' to %s", cid, source.name,
                 ", ".join(f"'{t.name}'" for t in targets))
        drainer.submit(DrainJob(cid, source, targets, manifest.save_token, manifest.files))
