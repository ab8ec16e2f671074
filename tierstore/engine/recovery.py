"""Recovery at open: queueing the drains nobody made (an earlier process was killed mid-drain,
or exited first; or a save was made in DCP's checkpoint process)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from tierstore.engine.drain import DrainJob, Drainer, PendingCopy
from tierstore.engine.health import TierHealth
from tierstore.engine.listings import Listings
from tierstore.tiers.tier import Tier

__all__ = ["queue_missing_copies", "missing_copies", "DrainResumption"]

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


class _MissingCopies:
    """What :func:`queue_missing_copies` hands a drainer, kept as a list instead of copied:
    how a read-only store says which copies are pending without making them."""

    def __init__(self) -> None:
        self.copies: list[PendingCopy] = []

    def pending(self) -> list[PendingCopy]:
        return []  # nothing is queued in a read-only store

    def submit(self, job) -> None:
        self.copies += [PendingCopy(job.checkpoint_id, t.name) for t in job.targets]


def missing_copies(tiers: list[Tier], health: TierHealth, listings: Listings) -> list[PendingCopy]:
    """The copies :func:`queue_missing_copies` would queue now, without queuing them (a
    read-only store's answer to ``pending()``: the copies a writable open would resume, or
    that the job writing them is making)."""
    missing = _MissingCopies()
    queue_missing_copies(tiers, missing, health, listings)  # type: ignore[arg-type]
    return missing.copies


class DrainResumption:
    """The scan for the drains an earlier process left unmade, run once, off the open's path,
    in a thread of its own: it looks at every tier (on an object store a listing and the
    manifests, a look ``latest()`` then reuses) and queues what it finds. Checkpoints older
    than the open are spared by ``keep`` until the scan ends (its drains spare them from
    then on)."""

    def __init__(self, tiers: Callable[[], list[Tier]], drainer: Drainer, health: TierHealth,
                 listings: Listings, retention) -> None:
        #: the tiers to scan, asked for in the scan (which may ask each tier who holds it)
        self._tiers = tiers
        self._args = (drainer, health, listings)
        self._retention = retention
        self._opened_at = time.time()  # the scan resumes what was committed before this
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the scan."""
        self._retention.hold_older(self._opened_at)
        self._thread = threading.Thread(target=self._scan, daemon=True, name="tierstore-resume")
        self._thread.start()

    def join(self) -> None:
        """Wait for the scan (its drains are queued once it ends); at once when not started."""
        if self._thread is not None:
            self._thread.join()

    def _scan(self) -> None:
        try:
            queue_missing_copies(self._tiers(), *self._args, before=self._opened_at)
        except Exception:  # noqa: BLE001 - the next open scans again
            log.exception("could not look for the drains an earlier process left unmade")
        finally:
            # What the scan queued is spared by its drains from now on: keep applies again.
            self._retention.release_older()
