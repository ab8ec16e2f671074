"""``Store.writer()``: the DCP StorageWriter (and AsyncStager) that saves into the first tier.

Call sequence (DCP's): ``reset`` (all ranks) -> ``set_up_storage_writer`` (all) ->
``prepare_local_plan`` (all) -> ``prepare_global_plan`` (coordinator) -> ``write_data`` (all) ->
``finish`` (coordinator). Errors a user can act on (bad id, id exists) are raised in ``reset``,
which DCP lets through unwrapped.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import mmap
import pickle
import time
import uuid
from concurrent.futures import Future as ConcurrentFuture, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tierstore.engine.context import StoreContext
from tierstore.engine.existing import Holding, holdings, whole_copies
from tierstore.engine.gc import GarbageCollector
from tierstore.engine.interval import IntervalChooser
from tierstore.engine.preparation import TierPreparation
from tierstore.engine.publish import Publisher
from tierstore.engine.replication import ReplicationJob, Replicator
from tierstore.engine.saves import SaveLedger, save_call_watch
from tierstore.dcp.spill import Spill, SpilledRecord, SpillIndex, SpillReader
from tierstore.engine.watchdog import Watchdog
from tierstore.errors import CommitError
from tierstore.events import Event, EventKind, Phase
from tierstore.format.ids import is_valid_checkpoint_id, validate_checkpoint_id
from tierstore.format.item_io import (HashingWriter, ItemLocation, block_bytes_for, item_size,
                                      split_items, write_items)
from tierstore.format.manifest import METADATA_NAME, FileEntry
from tierstore.engine.claims import TierClaims, refuse
from tierstore.plugin.bases import Stager
from tierstore.plugin.staging import StagingJob
from tierstore.tiers.tier import Tier
from tierstore.format.entry_fields import entry_fields, entry_from_fields
from tierstore.transport.collectives import all_gather_message, broadcast_message
from tierstore.transport.shapes import (as_bool, as_dict, as_int, as_list, as_str, as_tuple,
                                        optional)

__all__ = ["TierstoreWriter", "WriterServices"]

log = logging.getLogger("tierstore.dcp.writer")


@dataclass(frozen=True)
class WriterServices:
    """What a writer may use of its store (never the store itself)."""

    context: StoreContext
    ledger: SaveLedger
    stager: Stager
    publisher: Publisher
    gc: GarbageCollector
    replicator: Replicator | None
    #: called when DCP pickles the writer for its checkpoint process: returns a picklable
    #: callable that gives that process's services for the same store
    hand_off: Callable[[], Callable[[], "WriterServices"]]
    #: queue, in the background, what saves handed to DCP's checkpoint process left to do
    adopt_later: Callable[[], None]
    #: told when a save starts and ends (``[store] watchdog``); None in DCP's checkpoint process
    watchdog: Watchdog | None = None
    #: chooses the intervals of ``every = "auto"`` tiers (None: the store has none)
    intervals: IntervalChooser | None = None
    #: the job's claims on its tiers' directories, taken before its first save
    claims: TierClaims | None = None
    #: makes the remote tiers' clients ready, in the background, once the job saves
    preparation: TierPreparation | None = None


@dataclass(frozen=True)
class _PlanData:
    """What the coordinator tells every rank in its plan: file prefix, the save's token, the
    intervals (in steps) of the ``every = "auto"`` tiers for the saves after this one, and the
    checkpoint id and first tier of the coordinator's save (every rank checks it saves the
    same: DCP pairs whatever saves the ranks make)."""

    prefix: str
    token: str
    intervals: tuple[tuple[str, int], ...] = ()
    checkpoint_id: str = ""
    tier: str = ""


@dataclass
class _SaveState:
    checkpoint_id: str
    step: int
    tier: Tier
    started: float
    #: the slower tiers that take this save (its drains; the peer tier among them replicates
    #: it), decided once in ``reset`` on every rank alike: an ``every = "auto"`` schedule
    #: changes when it takes a save, so it is asked once per save, never again later
    slower: tuple[Tier, ...] = ()
    token: str | None = None
    staging: str | None = None
    set_up: bool = False
    drain: bool = True  # queue copies to slower tiers after the commit (not for emergency saves)
    seq: int = 0  # the store's save counter at reset
    spill: SpillIndex | None = None  # where a budgeted staging put the tensors' records
    watch: int | None = None  # the watchdog's token of this save
    # save tokens of what was left of this id on its tier at reset, judged no loadable copy
    # (tierstore.engine.existing): the commit replaces them
    replaces: frozenset[str] = frozenset()


class TierstoreWriter(StorageWriter, AsyncStager):
    """Saves a checkpoint into the fastest tier that takes it, atomically.

    Reusable across saves; one save at a time per writer (``reset`` starts the next one).
    """

    # dcp.async_save need not call synchronize_staging: stage() returns a finished copy, or
    # (lazy staging) a future DCP waits on itself.
    _synchronize_after_execute = False

    def __init__(self, services: WriterServices | None, *, emergency: bool = False):
        self._services = services
        # In DCP's checkpoint process: how to get this process's services (see __getstate__).
        self._reopen: Callable[[], WriterServices] | None = None
        self._emergency = emergency
        self._save: _SaveState | None = None
        self._rank = 0
        self._is_coordinator = True
        # The spilled records of the save staged last (budgeted staging), until its reset
        # takes them; a save that was not staged here (dcp.save) has none.
        self._staged_spill: SpillIndex | None = None

    # -- DCP's process executor pickles the writer to its checkpoint process ------------------
    def __getstate__(self) -> dict[str, Any]:
        """Runs in the training process, in the thread that hands this save to DCP's checkpoint
        process and waits for its answer: that thread now carries the save. The checkpoint
        process opens the same store (same config and plugins) to write the first tier; this
        process queues the drains to slower tiers once the save is committed."""
        services = self._services
        spill = self._staged_spill
        if services is None:
            return {"reopen": self._reopen, "emergency": self._emergency, "spill": spill}
        # The checkpoint process takes the spill; a later save through this writer here (a
        # dcp.save) must not find it.
        self._staged_spill = None
        services.ledger.slot.carried_here()
        return {"reopen": services.hand_off(), "emergency": self._emergency, "spill": spill}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(None, emergency=state["emergency"])  # type: ignore[misc]
        self._reopen = state["reopen"]
        self._staged_spill = state.get("spill")

    # -- AsyncStager ---------------------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | ConcurrentFuture:
        """Copy ``state_dict`` to host memory with the store's staging plugin (async_save):
        the staged tree when the copy is done (eager), or a future of it (lazy staging, which
        makes ``dcp.async_save`` return DCP's ``AsyncSaveResponse`` at once).

        Waits first for the store's previous save to finish (one save in flight): its files may
        still be written from the same staging buffers."""
        services = self._services
        ctx, ledger = services.context, services.ledger
        ctx.host.phase(Phase.STAGE, rank=ctx.rank)
        waited = ledger.slot.staged()
        ledger.release_spill()  # the save before is over
        ledger.staging = None  # (its staged tree must not outlive a change of buffers)
        self._staged_spill = None
        try:
            job = services.stager.start(state_dict, self._open_spill)
        except BaseException:
            ledger.release_spill()
            ledger.slot.release_pending()
            raise
        ledger.staging = job
        job.on_done(lambda j: self._staging_done(j, waited))
        job.run()
        if job.lazy:
            return job.future
        return job.result()

    def _open_spill(self) -> Spill:
        """The spill of a budgeted staging: on the store's first tier, owned by the store until
        this save is over."""
        spill = Spill(self._services.context.tiers[0])
        self._services.ledger.keep_spill(spill)
        return spill

    def _staging_done(self, job: StagingJob, waited: float) -> None:
        services = self._services
        ctx, ledger = services.context, services.ledger
        stats = job.stats
        detail = {"waited_s": waited, "reused": stats.reused, "lazy": job.lazy,
                  "waves": stats.waves, "buffer_bytes": stats.buffer_bytes}
        if job.error is not None:
            ledger.release_spill()
            ledger.slot.release_pending()
            ctx.host.event(Event(EventKind.FAILED, rank=ctx.rank, seconds=stats.seconds,
                                 detail={"during": "staging", "error": str(job.error), **detail}))
            return
        self._staged_spill = stats.extra.get("spill")
        ledger.slot.staging_done()
        # After the copy, not beside it: the scan and keep's deletes would compete for CPU.
        services.adopt_later()
        ctx.host.event(Event(EventKind.STAGED, rank=ctx.rank, seconds=stats.seconds,
                             nbytes=stats.nbytes, detail=detail))

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns a finished copy or a future DCP waits on."""

    def close(self) -> None:
        """Nothing to release; staging buffers belong to the store."""

    # -- StorageWriter -------------------------------------------------------------------------
    def reset(self, checkpoint_id=None) -> None:
        """Start a save: validate the id, pick the first tier that takes it, refuse an id that
        already exists there (unless ``overwrite``)."""
        if self._services is None:  # unpickled in DCP's checkpoint process
            self._services = self._reopen()
        ledger = self._services.ledger
        ledger.slot.carried_here()  # waits for another thread's save still in flight
        try:
            self._begin(checkpoint_id)
        except BaseException:
            ledger.slot.over()  # refused: this save is over before it began
            raise

    def _begin(self, checkpoint_id) -> None:
        """``reset``'s work, once the save is this thread's: the id, the tiers that take it,
        whether it exists already (settling node-local parts on the way)."""
        services = self._services
        ctx, ledger = services.context, services.ledger
        cid = validate_checkpoint_id(checkpoint_id)
        if services.preparation is not None:
            services.preparation.start()  # (the first save's drains will need the clients)
        step = ledger.step_for(cid)
        # Which tiers take this save, decided here, once, on every rank (every rank resets
        # every save with the same step and the same intervals in force): the first one is
        # saved to, the others drained to. An emergency save goes to the fastest tier only.
        tier, *slower = ([ctx.tiers[0]] if self._emergency
                         else ctx.tiers.take_save(step))
        ctx.host.phase(Phase.SAVE_BEGIN, cid, tier.name, ctx.rank)
        # Claimed before anything is looked at: another job's checkpoints there are not this
        # job's, whether the id exists there or not.
        refused = services.claims.take(ctx.tiers) if services.claims is not None else None
        held: list[Holding] = []
        if not ctx.config.overwrite:
            # The first tier and slower tiers on this machine's filesystems are asked now; a
            # remote tier (an object store) is asked by the drain before it copies, so a slow or
            # dead server never stands between training and its fast tier. Only a copy that
            # could load counts (tierstore.engine.existing): a leftover is replaced.
            held = holdings([tier, *(s for s in slower if s.backend.local_path("") is not None)],
                            cid, services.publisher.is_pending)
        if ctx.tiers.node_local and ctx.groups.io is not None:
            # Ranks see different directories: decide together, before DCP's collectives, so
            # that no rank raises while the others go on (and hang in them).
            exists, refused = self._settle_parts(cid, held, refused)
        else:
            # One directory per tier (this machine's, or one every rank shares): the ranks
            # find the same there.
            exists = whole_copies(held)
        refuse(refused)
        if exists:
            raise CommitError(
                f"checkpoint '{cid}' already exists on {exists[0]}; save under a new id, or "
                f"set [store] overwrite = true to replace it")
        ledger.save_running(None)  # a new save on this thread: any earlier one is over
        self._over()
        self._save = _SaveState(cid, step, tier, time.perf_counter(), tuple(slower),
                                drain=not self._emergency,
                                seq=ledger.save_seq, spill=self._staged_spill,
                                replaces=frozenset(h.token for h in held if h.tier == tier.name))
        self._staged_spill = None
        if services.watchdog is not None:
            self._save.watch = services.watchdog.begin(f"save of '{cid}'")

    def _settle_parts(self, cid: str, held: list[Holding], refused: str | None
                      ) -> tuple[list[str], str | None]:
        """Collective (every rank, in ``reset``): settle the pending parts of node-local tiers
        (``tierstore.engine.publish``) and agree whether ``cid`` exists. Each group's leader
        names its pending parts (id and save token); the coordinator's rank says, for each,
        whether it committed that id under that token (:meth:`Publisher.committed`: yes, no,
        or unknown); a committed part is confirmed, a part of a save whose coordinator failed
        is an orphan that gc removes now (so that saving its id again succeeds everywhere), and
        an unknown one stays pending until a later save. Returns where ``cid`` exists, the same list
        on every rank (:func:`~tierstore.engine.existing.whole_copies` over every rank's
        ``held``, a pending part counting when its save committed), and why the first rank
        whose tiers refuse the save (``refused``: another job holds one) refused it."""
        services = self._services
        ctx = services.context
        group = ctx.groups.io
        mine = {}
        for t in ctx.tiers:
            layout = t.layout
            if layout.shared or layout.leader != ctx.rank or layout.part == layout.part_of(0):
                continue
            try:
                mine[t.name] = services.publisher.pending_parts(t)
            except Exception:  # noqa: BLE001 - never raise on one rank only: settled next time
                log.warning("tier '%s': could not list its pending parts", t.name, exc_info=True)
        gathered = all_gather_message([[_holding_fields(h) for h in held], mine, refused],
                                      group, _held_from,
                                      "the copies and pending parts a rank holds")
        refused = next((r for _, _, r in gathered if r is not None), None)
        if refused is not None:
            # Another job's directory: its pending parts are not this job's to settle.
            return [], refused
        asked = sorted({(pid, token) for _, pending, _ in gathered for parts in pending.values()
                        for pid, token in parts.items()}
                       | {(cid, h.token) for found, _, _ in gathered for h in found
                          if h.pending})
        verdicts: list = []
        if asked:
            # The coordinator's rank judges every pending part by its own commits of that id,
            # wherever they are on this machine: a part's own tier is not enough, since rank
            # 0's copy on a slower tier may still be on its way there (its drain runs behind
            # the saves), and "not there yet" is not "never committed".
            if ctx.rank == 0:
                verdicts = [services.publisher.committed(pid, token) for pid, token in asked]
            verdicts = broadcast_message(verdicts, group, 0,
                                         lambda v: _verdicts_from(v, len(asked)),
                                         f"{len(asked)} verdicts on pending parts")
        answer = dict(zip(asked, verdicts))
        for name, parts in mine.items():
            for pid, token in parts.items():
                committed = answer.get((pid, token))
                if committed is None:  # unknown: the part stays pending
                    continue
                tier = ctx.tiers.named(name)
                try:
                    if committed:
                        services.publisher.confirm(tier, pid)
                    else:
                        services.gc.collect_orphan(tier, pid)
                except Exception:  # noqa: BLE001 - never raise on one rank only
                    log.warning("tier '%s': settling the part %s failed; the next save "
                                "tries again", name, pid, exc_info=True)
        return whole_copies([h for found, _, _ in gathered for h in found],
                            lambda h: not h.pending or answer.get((cid, h.token)) is True), refused

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Remember this rank's role; refuse a save that did not come with a checkpoint id
        (DCP calls ``reset`` only when one is given), and a multi-rank save without collectives
        (``use_collectives=False``) before anything is written."""
        save = self._require_save()
        if save.set_up:
            self._save = None
            self._require_save()
        if kwargs.get("use_collectives", True) is False and _world_size() > 1:
            self._over()
            self._save = None
            self._services.ledger.save_running(None)
            self._services.ledger.slot.over()
            raise CommitError(
                f"checkpoint '{save.checkpoint_id}': dcp.save(..., use_collectives=False) makes "
                f"every rank commit on its own, which would keep one rank's data under the id "
                f"and lose the others'; tierstore commits a checkpoint once, for all ranks. "
                f"Save with collectives (the default), or, to save one process's state alone, "
                f"use no_dist=True with a checkpoint id of its own. Nothing was written")
        save.set_up = True
        self._is_coordinator = is_coordinator
        self._rank = kwargs.get("rank") or 0

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: choose the save's token and each rank's file prefix."""
        save = self._require_save()
        token = uuid.uuid4().hex[:16]
        intervals = self._choose_intervals()
        return [dataclasses.replace(p, storage_data=_PlanData(
                    f"__{i}_", token, intervals, save.checkpoint_id, save.tier.name))
                for i, p in enumerate(plans)]

    def _choose_intervals(self) -> tuple[tuple[str, int], ...]:
        """Coordinator: the auto tiers' intervals, to travel with the plan to every rank."""
        chooser = self._services.intervals
        return tuple(sorted(chooser.choose().items())) if chooser is not None else ()

    def _adopt_intervals(self, intervals: tuple[tuple[str, int], ...]) -> None:
        """Every rank: put the coordinator's intervals in force for the next saves."""
        tiers = self._services.context.tiers
        for name, every in intervals:
            tier = tiers.named(name)
            if tier.schedule is not None:
                tier.schedule.adopt(every)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into files in the tier's staging directory, in parallel,
        hashing on the way; each file is durable when this returns."""
        save = self._require_save()
        wrote = False
        try:
            data: _PlanData = plan.storage_data
            if getattr(planner, "_enable_plan_caching", False):
                # With DCP's plan caching, a rank whose plan did not change gets the first
                # save's plan back, token included: every save's token comes from the first
                # rank of the store's group instead (one small broadcast per save).
                # The auto tiers' intervals go with it, for the same reason.
                token, intervals, cid, tier = broadcast_message(
                    [uuid.uuid4().hex[:16],
                     [list(i) for i in self._choose_intervals()]
                     if self._services.context.rank == 0 else [],
                     save.checkpoint_id, save.tier.name],
                    self._services.context.groups.main, 0, _save_told_from,
                    "a save's token, intervals, id and tier")
                data = dataclasses.replace(data, token=token, intervals=intervals,
                                           checkpoint_id=cid, tier=tier)
            self._adopt_intervals(data.intervals)
            fut = self._write_data(save, dataclasses.replace(plan, storage_data=data), planner)
            wrote = True
            return fut
        finally:
            self._queue_replication(save, wrote)

    def _write_data(self, save: _SaveState, plan: SavePlan, planner: SavePlanner
                    ) -> Future[list[WriteResult]]:
        data: _PlanData = plan.storage_data
        services, tier = self._services, save.tier
        ctx, ledger = services.context, services.ledger
        save.token = data.token
        ledger.save_running(data.token)
        layout, rank = tier.layout, ctx.rank
        if rank == layout.leader:
            services.gc.collect(tier)  # what interrupted saves left in this directory
        save.staging = tier.begin_save(save.checkpoint_id, data.token)
        # Ranks that do not commit this directory let go of it once their save is over.
        ledger.hold_until_over(lambda staging=save.staging: tier.end_writing(staging))
        buckets: list[list[WriteItem]] = []
        spilled: SpillReader | None = None
        # Where a tier deduplicates, each file's items' offsets go in its manifest entry: a
        # drain to that tier cuts the file's chunks there too.
        record_cuts = any(t.config.dedup for t in ctx.tiers)

        def write_file(n: int) -> list[WriteResult]:
            relative = f"{data.prefix}{n}.distcp"
            ctx.host.phase(Phase.WRITE_FILE, save.checkpoint_id, tier.name, self._rank,
                             file=relative)
            started = time.perf_counter()
            needed = sum(item_size(i) for i in buckets[n])
            with tier.open_write(f"{save.staging}/{relative}", needed) as raw:
                out = HashingWriter(raw, tier.keyring.new_hasher(), block_bytes_for(needed),
                                    tier.keyring.new_hasher)
                if record_cuts:  # (large items on pages: their chunks load mapped)
                    out.align_items = mmap.PAGESIZE
                results = write_items(out, buckets[n], planner, relative,
                                      [c.extension() for c in tier.codecs],
                                      written_before=spilled)
            spans = [[r.storage_data.info.offset, *r.storage_data.raw_span] for r in results
                     if r.storage_data.raw_span is not None]
            entry = FileEntry(out.offset, out.hasher.hexdigest(), self._rank, spans or None,
                              out.block_bytes, out.blocks(),
                              cuts=list(out.cuts) if record_cuts else None)
            first = results[0]
            results[0] = dataclasses.replace(
                first, storage_data=ItemLocation(first.storage_data.info, (relative, entry)))
            ctx.host.event(Event(EventKind.WRITTEN, save.checkpoint_id, tier.name, self._rank,
                                   time.perf_counter() - started, entry.size, {"file": relative}))
            return results

        results: list[WriteResult] = []
        failure: BaseException | None = None
        try:
            self._check_same_save(save, data)
            items = plan.items
            if save.spill is not None:  # a budgeted staging's records
                if _can_adopt(save.spill, tier):
                    items, results = self._adopt_spill_files(save, data.prefix, items)
                spilled = SpillReader(ctx.tiers.named(save.spill.tier), save.spill)
            buckets = split_items(items, ctx.config.io_threads)
            if len(buckets) <= 1:
                for n in range(len(buckets)):
                    results += write_file(n)
            else:
                with ThreadPoolExecutor(len(buckets), thread_name_prefix="tierstore-write") as pool:
                    for part in pool.map(write_file, range(len(buckets))):
                        results += part
        except BaseException as exc:
            failure = exc
            if save.staging is not None and len(layout.part_ranks) == 1:
                # This rank alone writes the directory: what the save wrote goes now (a full
                # tier gets its room back). Where other ranks write too, it stays hidden until
                # the next save's (or gc's) collection removes it; readers never see it.
                self._abort_quietly(save)
        if save.spill is not None:
            if spilled is not None:
                spilled.close()
            self._drop_spill(save.spill)
        try:
            if layout.parts > 1:
                # Every rank takes part, failed or not, so that no rank waits forever.
                self._publish_part(save, results, failure)
        finally:
            if failure is not None or not self._is_coordinator:
                ledger.save_running(None)  # only the coordinator has more to do (finish)
                ledger.slot.over()  # a dcp.save's thread goes on: other threads may too
                self._over()

        if failure is not None:
            raise failure
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    @staticmethod
    def _check_same_save(save: _SaveState, data: _PlanData) -> None:
        """Refuse to write when this rank's save is not the coordinator's: DCP pairs whatever
        saves the ranks make, and the commit would list files under an id, or on a tier, that
        this rank never wrote there. Raised inside the write, so that every rank of a node's
        part still takes part in publishing it (and the save fails on every rank)."""
        if data.checkpoint_id and (data.checkpoint_id, data.tier) != (save.checkpoint_id,
                                                                        save.tier.name):
            raise CommitError(
                f"this rank saves checkpoint '{save.checkpoint_id}' to tier "
                f"'{save.tier.name}', but the coordinator (rank 0) saves "
                f"'{data.checkpoint_id}' to tier '{data.tier}': every rank must save the same "
                f"checkpoint id at the same step (with every = \"auto\", ask "
                f"store.should_save(step) on every rank at every step and save when it says "
                f"so). Nothing of this save was committed")

    def _adopt_spill_files(self, save: _SaveState, prefix: str, items: list[WriteItem]
                           ) -> tuple[list[WriteItem], list[WriteResult]]:
        """A budgeted staging spilled its waves to this very tier as DCP records: a spill file
        all of whose records this rank's plan writes becomes a data file as it is (renamed into
        the save's directory, its checksum taken when it was written), so the state is written
        once. Returns the items left to write and the results of those adopted. (A file with a
        record DCP's plan gave to another rank, a replicated item, is copied from instead.)"""
        spill, tier, ctx = save.spill, save.tier, self._services.context
        by_file: dict[str, list[tuple[WriteItem, SpilledRecord]]] = {}
        for item in items:
            record = spill.find(item.index.fqn, item.index.offset)
            if record is not None and item.type != WriteItemType.BYTE_IO:
                by_file.setdefault(record.file, []).append((item, record))
        records_in = collections.Counter(r.file for r in spill.records.values())
        taken: set[int] = set()
        results: list[WriteResult] = []
        for name, pairs in by_file.items():
            if len(pairs) != records_in[name] or name not in spill.files:
                continue
            relative = f"{prefix}{name.removesuffix('.rec')}.distcp"
            with tier.writing(f"{save.staging}/{relative}", spill.files[name][0]):
                tier.backend.rename(f"{spill.directory}/{name}", f"{save.staging}/{relative}")
            pairs.sort(key=lambda pair: pair[1].offset)
            mine = [WriteResult(index=item.index, size_in_bytes=rec.length,
                                storage_data=_spilled_location(relative, rec))
                    for item, rec in pairs]
            spans = [[r.storage_data.info.offset, *r.storage_data.raw_span] for r in mine
                     if r.storage_data.raw_span is not None]
            size, checksum = spill.files[name]
            entry = FileEntry(size, checksum, self._rank, spans or None)
            mine[0] = dataclasses.replace(mine[0], storage_data=dataclasses.replace(
                mine[0].storage_data, file=(relative, entry)))
            ctx.host.event(Event(EventKind.WRITTEN, save.checkpoint_id, tier.name, self._rank,
                                 0.0, size, {"file": relative, "from": "spill"}))
            results += mine
            taken.update(id(item) for item, _ in pairs)
        return [i for i in items if id(i) not in taken], results

    def _abort_quietly(self, save: _SaveState) -> None:
        """Remove what the failed save wrote to its tier; a failure to is logged (gc collects
        what is left), never raised over the save's own error."""
        try:
            save.tier.abort_save(save.checkpoint_id, save.staging)
        except Exception:  # noqa: BLE001
            log.warning("tier '%s': removing %s of the failed save of '%s' failed; gc will "
                        "collect it", save.tier.name, save.staging, save.checkpoint_id,
                        exc_info=True)

    def _drop_spill(self, spill: SpillIndex) -> None:
        """The spilled records are in the data files now (or the write failed): remove them.
        The store that spilled them owns the spill; in DCP's checkpoint process, which only
        read it, its files are deleted and the owner lets go of the directory later."""
        ledger = self._services.ledger
        if ledger.release_spill(spill.directory):
            return
        try:
            self._services.context.tiers.named(spill.tier).backend.delete(spill.directory)
        except Exception:  # the owner removes it when the save is over, or gc does
            log.warning("removing the staging spill %s failed", spill.directory, exc_info=True)

    def _queue_replication(self, save: _SaveState, wrote: bool) -> None:
        """Every rank, once per save the peer tier takes (so that the ranks' replication jobs
        pair up): send this rank's files to its peers once they are committed."""
        replicator = self._services.replicator
        if replicator is None or not save.drain or \
                not any(t is replicator.peer for t in (save.tier, *save.slower)):
            return
        replicator.submit(ReplicationJob(save.checkpoint_id, save.tier, save.step,
                                         save.token or "", wrote, save.seq))

    def _publish_part(self, save: _SaveState, results: list[WriteResult],
                      failure: BaseException | None) -> None:
        """Node-local first tier: every rank shares what it wrote (a collective on the store's
        io group); each group's leader then publishes the group's part, except the
        coordinator's group, which ``finish`` publishes with the global ``.metadata``."""
        services, tier = self._services, save.tier
        layout, rank = tier.layout, services.context.rank
        mine = [r.storage_data.file for r in results if r.storage_data.file is not None]
        gathered = all_gather_message(
            [rank, failure is None, [[rel, entry_fields(e)] for rel, e in mine]],
            services.context.groups.io, _written_from, "what a rank wrote")
        if failure is not None:
            return
        failed = [r for r, ok, _ in gathered if not ok]
        if failed:
            if rank == layout.leader:
                log.info("not publishing %s: ranks %s failed to write", save.checkpoint_id,
                         failed)
            return
        if rank != layout.leader:
            if save.drain and mine:  # its own files go to the shared tiers from this rank
                services.publisher.copy_own_files(
                    tier, save.checkpoint_id, save.token,
                    {rel: entry for _, _, entries in gathered for rel, entry in entries},
                    save.slower, save_call_watch())
            return
        if layout.part == layout.part_of(0):
            return
        files = {rel: entry for r, _, entries in gathered if r in layout.part_ranks
                 for rel, entry in entries}
        try:
            # Pending: the checkpoint exists only once the coordinator's finish commits it.
            services.publisher.publish(tier, save.checkpoint_id, save.staging, save.token, files,
                                       save.step, seconds=time.perf_counter() - save.started,
                                       drain=save.slower if save.drain else (), pending=True,
                                       replaces=save.replaces)
        except BaseException:
            tier.abort_save(save.checkpoint_id, save.staging)
            raise

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write ``.metadata`` and the manifest, publish atomically, apply ``keep``
        (on a node-local tier: for the coordinator's group; the other groups published theirs in
        ``write_data``)."""
        save = self._require_save()
        services, tier = self._services, save.tier
        files: dict[str, FileEntry] = {}
        storage_md = {}
        for rank_results in results:
            for wr in rank_results:
                loc: ItemLocation = wr.storage_data
                storage_md[wr.index] = loc.info  # plain DCP storage info: stock readers load it
                if loc.file is not None:
                    files[loc.file[0]] = loc.file[1]
        all_files = files
        if tier.layout.parts > 1:
            ours = set(tier.layout.part_ranks)
            files = {rel: e for rel, e in files.items() if e.rank in ours}
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = storage_md
        metadata.storage_meta = StorageMeta(checkpoint_id=save.checkpoint_id, save_id=save.token)
        try:
            services.context.host.phase(Phase.WRITE_METADATA, save.checkpoint_id, tier.name,
                                        self._rank)
            raw = pickle.dumps(metadata)
            tier.write_bytes(f"{save.staging}/{METADATA_NAME}", raw)
            files[METADATA_NAME] = all_files[METADATA_NAME] = FileEntry(
                len(raw), tier.keyring.digest(raw), None)
            services.publisher.publish(tier, save.checkpoint_id, save.staging, save.token, files,
                                       save.step, seconds=time.perf_counter() - save.started,
                                       all_files=all_files,
                                       drain=save.slower if save.drain else (),
                                       replaces=save.replaces)
        except BaseException:
            tier.abort_save(save.checkpoint_id, save.staging)
            # the nodes stop waiting for word of its commit
            services.publisher.tell_failed(tier, save.checkpoint_id, save.token)
            raise
        finally:
            services.ledger.save_running(None)
            services.ledger.slot.over()
            self._over()
            self._save = None

    def storage_meta(self) -> StorageMeta | None:
        save = self._save
        return StorageMeta(checkpoint_id=save.checkpoint_id) if save else None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return is_valid_checkpoint_id(checkpoint_id)

    def _over(self) -> None:
        """This rank's part of the current save is over (for the watchdog)."""
        save, services = self._save, self._services
        if save is not None and services is not None and services.watchdog is not None:
            services.watchdog.end(save.watch)
            save.watch = None

    def _require_save(self) -> _SaveState:
        if self._save is None:
            raise RuntimeError(
                "the tierstore writer was used without a checkpoint id; call "
                "dcp.save(sd, storage_writer=store.writer(), checkpoint_id='step-100')"
            )
        return self._save


def _spilled_location(relative: str, record: SpilledRecord) -> ItemLocation:
    """Where an adopted spill file (now ``relative``) holds ``record``'s item."""
    raw = None if record.raw is None else (record.offset + record.raw[0], record.raw[1])
    return ItemLocation(_StorageInfo(relative, record.offset, record.length), raw_span=raw)


def _can_adopt(spill: SpillIndex, tier: Tier) -> bool:
    """Whether the save's tier can take the spill's files as its data files: the same tier,
    with no codecs (the records are plain), and renames within it; not a deduplicated tier,
    whose data files are chunks."""
    return (spill.tier == tier.name and not tier.codecs and tier.backend.supports_rename
            and not tier.config.dedup)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# -- what ranks tell each other about a save, as plain data (never a pickle) -----------------

def _holding_fields(h: Holding) -> list:
    """``h`` as plain data: its fields in order."""
    return [h.tier, h.where, h.shared, h.token, list(h.ranks), h.world_size, h.has_metadata,
            h.pending]


def _holding_from(value: Any) -> Holding:
    """The :class:`Holding` :func:`_holding_fields` made ``value`` of."""
    tier, where, shared, token, ranks, world, has_metadata, pending = as_tuple(
        value, as_str, as_str, as_bool, as_str, lambda v: as_list(v, lambda r: as_int(r, 0)),
        lambda v: as_int(v, 1), as_bool, as_bool)
    return Holding(tier, where, shared, token, tuple(ranks), world, has_metadata, pending)


def _held_from(value: Any) -> tuple[list[Holding], dict[str, dict[str, str]], str | None]:
    """What one rank holds of a checkpoint, the pending parts it leads and why its tiers
    refuse the save (see ``_settle_parts``), from the plain data it sent."""
    return as_tuple(value, lambda v: as_list(v, _holding_from),
                    lambda v: as_dict(v, as_str, lambda p: as_dict(p, as_str, as_str)),
                    optional(as_str))


def _verdicts_from(value: Any, count: int) -> list[bool | None]:
    """The coordinator's ``count`` verdicts on pending parts (committed, not, unknown)."""
    verdicts = as_list(value, optional(as_bool))
    if len(verdicts) != count:
        raise ValueError(f"{len(verdicts)} verdicts for {count} parts")
    return verdicts


def _save_told_from(value: Any) -> tuple[str, tuple[tuple[str, int], ...], str, str]:
    """A save's token, the auto tiers' intervals, its id and first tier, as rank 0 sent them."""
    token, intervals, cid, tier = as_tuple(
        value, as_str, lambda v: as_list(v, lambda i: as_tuple(i, as_str, lambda n: as_int(n, 1))),
        as_str, as_str)
    return token, tuple(intervals), cid, tier


def _written_from(value: Any) -> tuple[int, bool, list[tuple[str, FileEntry]]]:
    """What one rank wrote of a save (its rank, whether it succeeded, its files' entries)."""
    rank, ok, files = as_tuple(value, lambda v: as_int(v, 0), as_bool,
                               lambda v: as_list(v, lambda f: as_tuple(f, as_str, lambda e: e)))
    return rank, ok, [(rel, entry_from_fields(e, rel)) for rel, e in files]
