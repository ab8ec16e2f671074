"""The Store: what ``tierstore.open()`` returns, a facade over the layers below.

It holds one store's parts (plugin host, config, tiers, process groups, the engine's services,
the DCP adapters' service bundles), which :mod:`tierstore.assembly` builds and lets go of, and
offers the Contract's API, nothing else: each method hands the work to the part that owns it.
No part holds the Store.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Iterable

from tierstore import dcp
from tierstore.assembly import assemble, shut_down
from tierstore.config.spec import StoreSpec
from tierstore.engine.drain import PendingCopy, finish_at_exit, report_unfinished
from tierstore.engine.recovery import DrainResumption, missing_copies
from tierstore.engine.saves import SaveLedger
from tierstore.engine.stats import TierFigures
from tierstore.engine.waiting import raise_first_failure_of_any_rank, wait_for_background
from tierstore.errors import DrainError
from tierstore.events import Event, EventKind
from tierstore.format.ids import validate_checkpoint_id
from tierstore.handoff import checkpoint_process_store
from tierstore.preemption import Preemption
from tierstore.tiers.plan import RestorePlan, restore_plan
from tierstore.tiers.reports import (CheckpointInfo, ExportResult, InspectReport, PromoteResult,
                                     ScrubReport, StoreStatus, VerifyReport)

# The DCP adapters (``dcp.writer``, ``dcp.reader``, ``dcp.contents``) and parity are imported
# when a method first uses them: importing DCP takes seconds, which a query of tiers that need
# none (`tierstore ls`) does not wait for.
if TYPE_CHECKING:
    from tierstore.dcp.reader import TierstoreReader
    from tierstore.dcp.writer import TierstoreWriter, WriterServices
    from tierstore.engine.parity import ParityCheck

__all__ = ["Store", "open"]

log = logging.getLogger("tierstore.store")


class Store:
    """Multi-tier checkpoint storage behind DCP. Build one with :func:`tierstore.open`."""

    def __init__(self, config: Any, *, process_group: Any = None,
                 plugins: Iterable[object] = (), hand_off: bool = False,
                 tolerate_unreachable: bool = False, read_only: bool = False,
                 job_token: str | None = None):
        opening = time.perf_counter()
        #: queries only (see :func:`open`): nothing is started that writes to a tier
        self.read_only = read_only
        self._closed = False
        self._parts = parts = assemble(
            config, process_group, tuple(plugins), hand_off=hand_off,
            tolerate_unreachable=tolerate_unreachable, read_only=read_only,
            job_token=job_token, checkpoint_process_services=_checkpoint_process_services)
        # the parts every method uses, by name
        self._ctx, self._ledger, self._stager = parts.ctx, parts.ledger, parts.stager
        self._drainer, self._retention, self._hand_off = (parts.drainer, parts.retention,
                                                          parts.hand_off)
        self._atexit = _exit_handler(weakref.ref(self))
        _call_at_exit(self._atexit)
        # Resuming drains writes to the slower tiers (and on ``manifest-last`` tiers wipes the
        # prefix it starts on): a read-only store, an operator's query beside a live job that
        # may be draining the same checkpoint, leaves that to the job or to `tierstore wait`.
        job, tiers, host = self._ctx.job, self._ctx.tiers, self._ctx.host
        self._resumption = DrainResumption(
            lambda: parts.claims.unclaimed_elsewhere(tiers), self._drainer, parts.health,
            parts.listings, self._retention)
        if job.rank == 0 and not tiers.node_local and not hand_off and not read_only:
            self._resumption.start()  # wait(), pending() and close() wait for it
        if not hand_off and not read_only:  # a process of the job started (or restarted)
            host.event(Event(EventKind.OPENED, rank=job.rank,
                             seconds=time.perf_counter() - opening,
                             detail={"pid": os.getpid(), "world_size": job.world_size}))
        host.store_opened(self)

    @property
    def process_group(self) -> Any:
        """A gloo group the store made for itself (None without torch.distributed, or once
        closed): pass it to ``dcp.save``/``async_save``/``load``."""
        return None if self._closed else self._ctx.groups.main

    # -- DCP ---------------------------------------------------------------------------------
    def writer(self, *, emergency: bool = False) -> TierstoreWriter:
        """A DCP StorageWriter (and AsyncStager) saving into this store.

        ``emergency=True``: save to the fastest tier whatever its ``every``, and queue no drains
        (a process about to exit; the next ``tierstore.open`` queues them)."""
        self._check_open()
        self._check_writable("save")
        return dcp.writer.TierstoreWriter(self._parts.writer_services, emergency=emergency)

    def reader(self) -> TierstoreReader:
        """A DCP StorageReader loading from this store."""
        self._check_open()
        return dcp.reader.TierstoreReader(self._parts.reader_services)

    def _reader_alone(self) -> TierstoreReader:
        """A reader for a load DCP runs in this process only (``inspect``, ``export``)."""
        self._check_open()
        return dcp.reader.TierstoreReader(self._parts.reader_services, alone=True)

    def record_step(self, step: int, seconds: float) -> None:
        """The training code finished step ``step``, which took ``seconds`` of its own (not
        counting saves or loads between steps): a ``step`` event for observers and for
        ``[store] events_log``, from which ``tierstore goodput`` tells productive time from
        time lost to checkpoints, restarts and failures. Cheap: call it every step."""
        ctx = self._ctx
        ctx.host.event(Event(EventKind.STEP, rank=ctx.rank, seconds=float(seconds),
                             detail={"step": int(step)}))

    def should_save(self, step: int) -> bool:
        """Whether a save at ``step`` would go to some tier: with ``every = "auto"`` tiers,
        ask it each step and save when it says so (every rank gets the same answer, without
        talking: the interval in force came with an earlier save's plan). With fixed intervals
        only, whether ``step`` is a multiple of some tier's ``every``. A save made anyway goes
        to the fastest tier."""
        return self._ctx.tiers.due(int(step))

    # -- queries -----------------------------------------------------------------------------
    def latest(self) -> str | None:
        """Newest checkpoint this job can load (every rank's files and DCP's ``.metadata`` on
        some tier). Under torch.distributed a collective: every rank calls it, all get the
        same answer. Waits first for a save of this store in flight: an ``async_save``'s
        collectives run on the same group in DCP's thread, and interleaved with this one they
        would wait for each other until the collective timeout."""
        self._check_open()
        self._ledger.slot.wait_idle()
        return self._parts.catalog.latest()

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint complete on some tier of this process, newest first."""
        self._check_open()
        return self._parts.catalog.list()

    def verify(self, checkpoint_id: str, tier: str | None = None) -> VerifyReport:
        """Re-read ``checkpoint_id`` on one tier (or every tier holding it) and check every
        file's size and checksum against the manifest."""
        self._check_open()
        return self._parts.catalog.verify(checkpoint_id, tier)

    def verify_parity(self, checkpoint_id: str, *, repair: bool = False) -> ParityCheck | None:
        """Collective (a ``peer`` tier with the ``erasure`` strategy): encode the parity of
        ``checkpoint_id`` again from every member's files (each checked against its digest
        first) and compare it with the parity each member holds; with ``repair``, a chunk that
        differs is rewritten. Returns what this rank found (``ok``, ``mismatch``,
        ``repaired``, ``unchecked``, ``missing``), None when no rank holds parity of it. Call
        it after ``store.wait()``, as every rank calls ``latest()``."""
        from tierstore.engine.parity import verify_parity

        self._check_open()
        if repair:
            self._check_writable("repair parity")
        cid = validate_checkpoint_id(checkpoint_id)
        self._ledger.slot.wait_idle()
        ctx = self._ctx
        tier = ctx.tiers.parity_tier
        own = [(t, m) for t in ctx.tiers.read_order() for m in [t.read_manifest(cid)]
               if m is not None]
        return verify_parity(ctx.groups.main, ctx.rank, cid, own, tier, str(ctx.tiers.strategy),
                             lambda phase: ctx.host.phase(phase, cid, tier.name, ctx.rank),
                             ctx.copy_chunk_bytes, repair)

    def pending(self) -> list[PendingCopy]:
        """Copies to slower tiers not finished yet (checkpoint and tier), oldest first. A
        read-only store runs no drains: its answer is the copies missing from the tiers now,
        those a writable open would resume (or the job writing them is making)."""
        if not self.read_only:
            self._resumption.join()
            return self._drainer.pending()
        tiers = self._ctx.tiers
        if self._ctx.rank != 0 or tiers.node_local:
            return []
        return missing_copies(list(tiers), self._parts.health, self._parts.listings)

    def stats(self) -> dict[str, TierFigures]:
        """Per-tier figures of this process since the store was opened: saves, drains, loads
        (count, bytes, seconds, throughput), fallbacks, evictions, failures."""
        return self._parts.stats.snapshot([t.name for t in self._ctx.tiers])

    def status(self) -> StoreStatus:
        """What a failure would cost now, per tier: reachable or not, newest complete
        checkpoint, its age, steps behind the newest anywhere, bytes held, free space; and the
        copies still pending. A tier that does not answer is reported, never fatal."""
        self._check_open()
        return self._parts.catalog.status([(c.checkpoint_id, c.tier) for c in self.pending()])

    def inspect(self, checkpoint_id: str) -> InspectReport:
        """A checkpoint's files per rank, its tensors (fully qualified name, shape, dtype,
        bytes, from DCP's metadata, checked) and the tiers holding a complete copy."""
        self._check_open()
        cid = validate_checkpoint_id(checkpoint_id)
        holders = self._parts.catalog.complete_copies(cid, "inspect")
        whole = [m for _, m in holders if m.parts == 1] or [holders[0][1]]
        return dcp.contents.describe(whole[0], [t.name for t, _ in holders], self._reader_alone())

    def plan(self, checkpoint_id: str, world_size: int | None = None,
             ranks_per_node: int | None = None) -> RestorePlan:
        """Where a restore of ``checkpoint_id`` by a job of ``world_size`` ranks,
        ``ranks_per_node`` per node (default: the shape of the save), would read each file
        from: a node of that job (its own copy or a replica), a shared tier, or nowhere. Looks
        at every node's directories of node-local tiers, as this process sees them (on one
        machine with ``{node}`` paths, or a filesystem every node mounts); writes nothing."""
        self._check_open()
        cid = validate_checkpoint_id(checkpoint_id)
        return restore_plan(self._ctx.config, self._ctx.host, cid, world_size, ranks_per_node)

    def promote(self, checkpoint_id: str, to: str, *, pin: bool = False) -> PromoteResult:
        """Copy a complete checkpoint to tier ``to`` whatever its ``every`` (a milestone to
        object storage), with the drain's checks and commit, from the fastest whole copy that
        copies cleanly; ``pin``: pinned there, so that its ``keep`` never evicts it. A copy
        already complete there is left as it is (pinned if asked)."""
        self._check_open()
        self._check_writable("promote")
        cid = validate_checkpoint_id(checkpoint_id)
        return self._parts.scrubber.promote(cid, self._ctx.tiers.named(to), pin)

    def scrub(self, repair: bool = False) -> ScrubReport:
        """Re-read every copy on every tier (sizes and checksums); ``repair``: replace each bad
        or incomplete copy from a good copy on another tier (checked, committed as that tier's
        protocol says) and re-read it."""
        self._check_open()
        if repair:
            self._check_writable("repair")
        return self._parts.scrubber.scrub(repair)

    def export(self, checkpoint_id: str, fmt: str, path: str) -> ExportResult:
        """Write one consolidated file of a checkpoint from its fastest good copy: ``torch``
        (``torch.save`` of ``{fully qualified name: value}``) or ``safetensors`` (its tensors);
        or ``dcp``, a stock DCP checkpoint directory; shards are joined into whole tensors."""
        self._check_open()
        cid = validate_checkpoint_id(checkpoint_id)
        self._parts.catalog.complete_copies(cid, "export")
        return dcp.contents.export(cid, fmt, path, self._reader_alone())

    # -- maintenance -------------------------------------------------------------------------
    def pin(self, checkpoint_id: str) -> None:
        """Mark a checkpoint so that ``keep`` never deletes it, on every tier holding it."""
        self._check_open()
        self._check_writable("pin")
        self._parts.catalog.set_pinned(checkpoint_id, True)

    def unpin(self, checkpoint_id: str) -> None:
        """Let ``keep`` delete a checkpoint again."""
        self._check_open()
        self._check_writable("unpin")
        self._parts.catalog.set_pinned(checkpoint_id, False)

    def gc(self) -> list[str]:
        """Remove what interrupted saves left on every tier (never a committed checkpoint), and
        on a deduplicated tier the chunks no checkpoint there names."""
        self._check_open()
        self._check_writable("gc")
        return [f"{tier.name}:{name}" for tier in self._ctx.tiers.maintained()
                for name in self._parts.health.ask(tier, "gc", lambda t=tier: self._parts.gc.collect(
                    t, chunks=True), [])]

    def wait(self, timeout: float | None = None, *, all_ranks: bool = False) -> None:
        """Block until every background copy started so far is done (drains, replication);
        raise the first failure since the last ``wait`` (``DrainError``, ``ReplicationError``
        for replication) naming checkpoint, tier and cause; ``TimeoutError`` after ``timeout``
        seconds. A plain ``wait()`` covers this process's work; ``all_ranks=True`` (collective)
        returns on every rank once every rank's is done, raising the first failure of any."""
        self._check_open()
        self._ledger.slot.wait_idle()  # a save in flight queues its drains when it commits
        self._resumption.join()
        self._hand_off.adopt()
        failure: BaseException | None = None
        try:
            wait_for_background(self._drainer, self._parts.replicator,
                                self._parts.publisher.notices, timeout)
        except (DrainError, TimeoutError) as exc:
            if not all_ranks:
                raise
            failure = exc
        if all_ranks:
            raise_first_failure_of_any_rank(failure, self._ctx.groups.main, self._ctx.rank)

    def wait_staging(self, timeout: float | None = None) -> float:
        """Make it safe for training to change the state of the newest ``dcp.async_save``
        (with lazy staging it copies after ``async_save`` returned): on the CPU, block until
        every value has been taken; on CUDA, make the training's current stream wait for the
        device-to-host copies (the host does not wait). Returns the seconds the host waited
        (0.0 when nothing is in flight). Never raises a staging failure: the save's own futures
        carry it."""
        return self._ledger.wait_staging(timeout)

    def hook_optimizer(self, optimizer: Any) -> Any:
        """Make ``optimizer.step()`` first wait for the staging in flight (a step pre-hook
        calling :meth:`wait_staging`): the pattern for lazy staging, where forward and backward
        run while the state is copied and only the optimizer step must wait. Returns the hook's
        handle (``handle.remove()`` takes it off)."""
        return optimizer.register_step_pre_hook(_StagingWait(self._ledger))

    def preemption(self, signals: Iterable[int] = (signal.SIGTERM,)) -> Preemption:
        """Install a handler for ``signals`` (SIGTERM) that turns preemption into an emergency
        checkpoint at a step all ranks agree on; see :class:`tierstore.preemption.Preemption`.
        Collective (every rank, main thread)."""
        self._check_open()
        self._check_writable("save at preemption")
        return Preemption(self._ctx, self._ledger.slot, lambda: self.writer(emergency=True),
                          self.close, signals)

    def close(self, wait: bool = True) -> None:
        """Wait for background work (raising its failures), then release threads, backends and
        process groups. ``wait=False``: do not wait (what is left is listed on stderr; the
        next ``tierstore.open`` resumes drains to shared tiers)."""
        if self._closed:
            return
        ctx = self._ctx
        ctx.host.store_closing(self)
        try:
            if wait:
                self.wait()
            else:
                self._ledger.slot.wait_idle()
                self._resumption.join()
                report_unfinished(self._drainer.pending(), self._drainer.unreported_failures())
        finally:
            self._closed = True
            shut_down(self._parts, wait, self._atexit)

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise RuntimeError(f"cannot {what}: this store was opened read_only (queries "
                               f"only); open it without read_only to change the tiers")

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this store is closed; open a new one with tierstore.open(...)")

    def __repr__(self) -> str:
        return f"<tierstore.Store tiers={[t.name for t in self._ctx.tiers]} rank={self._ctx.rank}>"


class _StagingWait:
    """The optimizer step pre-hook of :meth:`Store.hook_optimizer` (holds the store's ledger,
    not the store)."""

    def __init__(self, ledger: SaveLedger):
        self._ledger = ledger

    def __call__(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._ledger.wait_staging()


def _call_at_exit(handler) -> None:
    """Run ``handler`` when the interpreter exits, while thread pools still take work.

    ``atexit`` handlers run too late for a drain: by then ``concurrent.futures`` has refused new
    work ("cannot schedule new futures after interpreter shutdown"), and so have the object
    store clients built on it (s3fs: aiobotocore's DNS lookups, its uploads), so a drain to S3
    failed at every exit without ``store.close()``. Functions registered with
    ``threading._register_atexit`` run before that, latest first (``concurrent.futures``
    registered its own when imported, before any store is opened). Where that hook is missing
    (another Python), ``atexit``."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(handler)
        return
    try:
        register(handler)
    except RuntimeError:  # the interpreter is already shutting down
        atexit.register(handler)


def _exit_handler(store_ref: "weakref.ref[Store]"):
    """At interpreter exit, finish what an unclosed store still has to drain."""

    def handler() -> None:
        store = store_ref()
        if store is not None and not store._closed:
            finish_at_exit(store._drainer, store._hand_off.adopt,
                           store._ctx.config.exit_timeout)

    return handler


def _checkpoint_process_services(spec: StoreSpec, job: str | None) -> WriterServices:
    """In DCP's checkpoint process: the writer services of this process's store for ``spec``
    (opened on first use). Pickled by reference into handed-off writers."""
    store = checkpoint_process_store(
        spec, lambda s: Store(s.config, plugins=s.resolved_plugins(), hand_off=True,
                              job_token=job))
    return store._parts.writer_services


def open(config: Any, *, process_group: Any = None, plugins: Iterable[object] = (),
         tolerate_unreachable: bool = False, read_only: bool = False) -> Store:
    """Build a store from a TOML file path or a dict of the same shape.

    Validates the whole config (and loads every plugin) before anything is written. Under
    torch.distributed every rank must call it: it creates the store's own gloo groups.
    ``plugins`` registers extra plugin objects (modules or instances with hook implementations).
    A tier whose storage does not answer fails the open (a ConfigError naming it), unless
    ``tolerate_unreachable`` (what the ``tierstore`` command uses): then it is reported
    unreachable and skipped, as a tier that dies later is, and the others work.

    ``read_only``: a store for queries (``list``, ``status``, ``verify``, ``inspect``,
    ``export``, ``scrub`` without repair), safe beside a running job: it resumes no drains,
    runs no background scrub, builds no staging buffers, and takes no lock or lease, so it
    writes nothing to any tier; the methods that would (``writer``, ``promote``, ``pin``,
    ``unpin``, ``gc``, ``scrub(repair=True)``, ``preemption``) raise RuntimeError. What the
    ``tierstore`` command's reading commands use.
    """
    return Store(config, process_group=process_group, plugins=plugins,
                 tolerate_unreachable=tolerate_unreachable, read_only=read_only)
