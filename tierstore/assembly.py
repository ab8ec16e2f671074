"""One store wired together: the plugin host, the config, the tiers, the process groups, the
engine's services and the DCP adapters' service bundles, built in order by :func:`assemble`
into plain :class:`StoreParts`, and let go of in order by :func:`shut_down`.

What needs torch.distributed or DCP is imported when it is built, and the adapters' bundles when
first asked for: importing them takes seconds, and a store that only answers queries on tiers
without replication or codecs (``tierstore ls``, ``tierstore status``) never needs them.

The :class:`~tierstore.store.Store` is a facade over these parts: it holds them and hands each
call to the part that owns it. No part holds the Store.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
from concurrent import futures
from typing import TYPE_CHECKING, Any, Callable

from tierstore.config.spec import StoreSpec
from tierstore.config.validate import load_config
from tierstore.engine.catalog import Catalog
from tierstore.engine.claims import TierClaims, agree_job_token
from tierstore.engine.context import Groups, StoreContext
from tierstore.engine.drain import Drainer
from tierstore.engine.events_log import EventsLog
from tierstore.engine.gc import GarbageCollector
from tierstore.engine.health import TierHealth
from tierstore.engine.interval import IntervalChooser
from tierstore.engine.listings import Listings
from tierstore.engine.parts import KnownCommits
from tierstore.engine.preparation import TierPreparation
from tierstore.engine.publish import Publisher
from tierstore.engine.retention import Retention
from tierstore.engine.saves import SaveLedger
from tierstore.engine.scrub import BackgroundScrub, Scrubber
from tierstore.engine.stats import TierStats
from tierstore.engine.watchdog import Watchdog
from tierstore.handoff import HandOff
from tierstore.tiers.build import build_tiers
from tierstore.transport.collectives import make_store_group, rank_context

if TYPE_CHECKING:
    from tierstore.dcp.reader import ReaderServices
    from tierstore.dcp.writer import WriterServices
    from tierstore.engine.replication import Replicator

__all__ = ["StoreParts", "assemble", "shut_down"]

#: seconds closing waits for the background threads of finished drains to end
_THREADS_END_S = 5.0


@dataclasses.dataclass
class StoreParts:
    """Everything one store is made of (see the module's docstring)."""

    spec: StoreSpec
    ctx: StoreContext
    stats: TierStats
    watchdog: Watchdog
    events_log: EventsLog
    intervals: IntervalChooser
    claims: TierClaims
    ledger: SaveLedger
    retention: Retention
    gc: GarbageCollector
    drainer: Drainer
    replicator: Replicator | None
    stager: Any
    health: TierHealth
    listings: Listings
    catalog: Catalog
    scrubber: Scrubber
    background_scrub: BackgroundScrub | None
    hand_off: HandOff
    publisher: Publisher

    @functools.cached_property
    def writer_services(self) -> WriterServices:
        """What the store's writers use (built on first use: see the module's docstring)."""
        from tierstore.dcp.writer import WriterServices

        intervals = self.intervals
        return WriterServices(self.ctx, self.ledger, self.stager, self.publisher, self.gc,
                              self.replicator, self.hand_off.reopen_callable,
                              self.hand_off.adopt_later, self.watchdog,
                              intervals if intervals.active else None, self.claims,
                              TierPreparation(list(self.ctx.tiers)))

    @functools.cached_property
    def reader_services(self) -> ReaderServices:
        """What the store's readers use (built on first use: see the module's docstring)."""
        from tierstore.dcp.reader import ReaderServices

        return ReaderServices(self.ctx, self.retention, self.ledger.slot, self.catalog,
                              self.health, self.watchdog, self.listings)


def assemble(config: Any, process_group: Any, plugins: tuple, *, hand_off: bool,
             tolerate_unreachable: bool, read_only: bool, job_token: str | None,
             checkpoint_process_services: Callable[[StoreSpec, str | None], WriterServices]
             ) -> StoreParts:
    """Build a store's parts from ``config`` (see :func:`tierstore.open` for the arguments);
    ``checkpoint_process_services`` gives the writer services of DCP's checkpoint process (a
    handed-off save's). Starts the watchdog and the background scrub; a failed build leaves
    no process group behind."""
    spec = StoreSpec.of(config, plugins)
    stats, watchdog, events_log, intervals = TierStats(), Watchdog(), EventsLog(), IntervalChooser()
    config, host = load_config(config, plugins, {"tierstore.engine.stats": stats,
                                                 "tierstore.engine.watchdog": watchdog,
                                                 "tierstore.engine.events_log": events_log,
                                                 "tierstore.engine.interval": intervals})
    job = rank_context(process_group)
    # A read-only store (a query beside the job) logs nothing: `tierstore ls` run during a
    # job must not read as one of its restarts.
    if config.events_log and not read_only:
        events_log.start(config.events_log)
    # A read-only store never saves, so it never builds the buffers a save stages into.
    stager = None if read_only else host.lookup("staging", config.staging.name).factory(
        **config.staging.options)
    # Two groups: collectives inside a save or load (maybe in a background thread) never
    # interleave with latest() on the main one.
    timeout = config.collective_timeout
    main = make_store_group(process_group, timeout)
    io = make_store_group(process_group, timeout)
    # The job's token for claiming its tiers' directories before its first save (DCP's
    # checkpoint process is given its job's); a store that never saves claims nothing.
    claims = TierClaims(None if read_only else job_token or agree_job_token(main))
    unreachable: dict[str, str] = {}
    try:
        tiers = build_tiers(config, host, job, main, unreachable, tolerate_unreachable)
    except BaseException:
        destroy_groups(main, io)
        events_log.stop()
        raise
    replication = (make_store_group(process_group, timeout) if tiers.strategy is not None
                   else None)
    ctx = StoreContext(config, host, job, tiers, Groups(main, io, replication))
    intervals.configure([t.name for t in tiers], [t.name for t in tiers if t.auto], job.rank,
                        host, config.mtbf_hours, config.events_log)
    ledger, retention, commits = SaveLedger(), Retention(host, job.rank), KnownCommits()
    gc = GarbageCollector(host, job.rank, ledger)
    drainer = Drainer(ctx, retention, gc, commits)
    replicator = None
    if tiers.strategy is not None:
        from tierstore.engine.replication import Replicator

        replicator = Replicator(ctx, retention, ledger)
    health = TierHealth(host, job.rank)
    for name, why in unreachable.items():
        health.mark_down(tiers.named(name), "open()", why)
    listings = Listings()
    catalog = Catalog(ctx, retention, health, listings)
    scrubber = Scrubber(ctx, drainer, retention, health, catalog)
    background_scrub = None
    if config.scrub_every_s and job.rank == 0 and not hand_off and not read_only:
        background_scrub = BackgroundScrub(scrubber, config.scrub_every_s, host, job.rank)
    handing = HandOff(spec, tiers, job.rank, drainer, retention, health,
                      checkpoint_process_services, listings, claims.job)
    publisher = Publisher(ctx, drainer, retention, commits, in_checkpoint_process=hand_off)
    watchdog.start(config.watchdog, host, job.rank)
    if background_scrub is not None:
        background_scrub.start()
    return StoreParts(spec, ctx, stats, watchdog, events_log, intervals, claims, ledger,
                      retention, gc, drainer, replicator, stager, health, listings, catalog,
                      scrubber, background_scrub, handing, publisher)


def shut_down(parts: StoreParts, wait: bool, exit_handler: Callable[[], None]) -> None:
    """Release what ``parts`` hold, in order: threads, staging buffers, claims, backends,
    process groups (``wait``: give finished drains' threads a moment to end);
    ``exit_handler`` is taken off the interpreter's exit."""
    ctx = parts.ctx
    atexit.unregister(exit_handler)
    parts.watchdog.stop()
    if parts.background_scrub is not None:
        parts.background_scrub.close()
    parts.health.close()
    # Every drain is done when waited for: their threads end now, not at exit.
    parts.drainer.close(timeout=_THREADS_END_S if wait else 0)
    if parts.replicator is not None:
        parts.replicator.close(timeout=None if wait else 0)
    if parts.publisher.notices is not None:
        parts.publisher.notices.close(timeout=_THREADS_END_S if wait else 0)
    staging = parts.ledger.staging
    if staging is not None:  # a lazy copy still running reads the buffers
        futures.wait([staging.future])
    parts.ledger.release_spill()
    if parts.stager is not None:
        parts.stager.close()
    parts.claims.release()  # after the drains: they write to the tiers too
    for tier in [*ctx.tiers, *ctx.tiers.all_replicas,
                 *([ctx.tiers.parity_tier] if ctx.tiers.parity_tier else [])]:
        tier.backend.close()
    destroy_groups(ctx.groups.main, ctx.groups.io, ctx.groups.replication)
    parts.events_log.stop()


def destroy_groups(*groups: Any) -> None:
    """Destroy a store's own process groups (None: no group)."""
    made = [group for group in groups if group is not None]
    if not made:  # none without torch.distributed, which is then not even imported
        return
    import torch.distributed as dist

    if dist.is_initialized():
        for group in made:
            dist.destroy_process_group(group)


