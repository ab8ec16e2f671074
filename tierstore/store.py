"""The Store: what ``tierstore.open()`` returns.

It owns the plugin manager, the validated config, the tiers of this process and the store's own
process group, and hands out DCP writers and readers bound to them.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import signal
import threading
import weakref
from dataclasses import dataclass
import time
from typing import Any, Iterable

import torch.distributed as dist

from tierstore.version import __version__
from tierstore.config.validate import StoreConfig, load_source, validate_config, validate_store_table
from tierstore.transport.collectives import RankContext, all_gather_object, make_store_group, rank_context
from tierstore.tiers.layout import TierLayout, compute_layouts
from tierstore.engine.drain import DrainJob, Drainer, PendingCopy, report_unfinished
from tierstore.errors import CheckpointNotFound, CommitError, ConfigError, DrainError, PluginError
from tierstore.events import Event, EventKind, Phase
from tierstore.format.ids import step_of, validate_checkpoint_id
from tierstore.format.item_io import register_extension
from tierstore.handoff import StoreSpec
from tierstore.engine.saves import SaveSlot
from tierstore.plugin.options import validate_table
from tierstore.preemption import Preemption
from tierstore.engine.replication import Replicator
from tierstore.tiers.reports import CheckpointInfo, VerifyReport
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.plugin.host import PluginHost, build_plugin_host
from tierstore.dcp.reader import TierstoreReader
from tierstore.tiers.tier import Tier
from tierstore.dcp.writer import TierstoreWriter
from tierstore.engine.stats import TierFigures, TierStats

__all__ = ["Store", "open"]

log = logging.getLogger("tierstore")


class Store:
    """Multi-tier checkpoint storage behind DCP. Build one with :func:`tierstore.open`."""

    def __init__(self, config: Any, *, process_group: Any = None,
                 plugins: Iterable[object] = (), hand_off: bool = False):
        plugins = tuple(plugins)
        self._spec = StoreSpec.of(config, plugins)
        # True in DCP's checkpoint process: saves there leave drains and retention to the
        # training process's store (see tierstore.handoff).
        self._hand_off = hand_off
        self._handed_off = False  # this store gave saves to DCP's checkpoint process
        self._adopt_lock = threading.Lock()
        self.slot = SaveSlot()
        data, source = load_source(config)
        store_table = validate_store_table(data.get("store", {}), source)
        self._stats = TierStats()
        self.host: PluginHost = build_plugin_host(store_table["plugins"],
                                                  f"[store] plugins in {source.name}",
                                                  tuple(plugins),
                                                  {"tierstore.engine.stats": self._stats})
        self.config: StoreConfig = validate_config(data, source, self.host, store_table)
        self.ctx: RankContext = rank_context(process_group)
        self.tiers: list[Tier] = [self._build_tier(tc) for tc in self.config.tiers]
        reg = self.host.lookup("staging", self.config.staging.name)
        self.stager = reg.factory(**self.config.staging.options)
        self._saves = 0
        self._lock = threading.Lock()
        self._retention_lock = threading.Lock()
        # checkpoint id -> loads of it under way (retention spares them)
        self._loading: collections.Counter[str] = collections.Counter()
        # Loads ended by a reader's finalizer: the garbage collector may run it on any thread,
        # inside any lock (this store's retention lock too), so it only appends here (atomic)
        # and the next retention or load counts it.
        self._loads_released: collections.deque[str] = collections.deque()
        # thread ident -> token of the save that thread is running; gc spares these
        self._in_flight: dict[int, str] = {}
        self._closed = False
        self.process_group = make_store_group(process_group)
        # A second group for collectives inside a save (which may run in a background thread
        # while the main thread calls latest() on the first).
        self.save_group = make_store_group(process_group)
        for tier, layout in zip(self.tiers, compute_layouts(self.tiers, self.ctx,
                                                            self.process_group, self.config.source)):
            tier.layout = layout
        self._check_drain_paths()
        self.replicator: Replicator | None = self._build_replicator(process_group)
        self.drainer = Drainer(self, self.config.drain_threads, self.config.drain_chunk_mib << 20,
                               self.config.part_timeout)
        self._atexit = _exit_handler(weakref.ref(self))
        atexit.register(self._atexit)
        if self.ctx.rank == 0 and not self.node_local and not hand_off:
            self._queue_missing_copies()
        self.host.store_opened(self)

    def _queue_missing_copies(self) -> None:
        """Queue the copies nobody has made: those an earlier process did not finish (it was
        killed mid-drain, or exited first) and those of saves made in DCP's checkpoint process.
        A copy is missing when a checkpoint is complete on a faster tier, absent from a slower
        tier that takes its step, newer than everything there (older ones were evicted by
        keep), and not queued already."""
        queued = set(self.drainer.pending())
        jobs: dict[str, tuple[Tier, list[Tier], float]] = {}
        complete = [tier.complete() for tier in self.tiers]
        for j, target in enumerate(self.tiers):
            on_target = complete[j]
            newest = max((m.committed for m in on_target.values()), default=float("-inf"))
            for i in range(j):
                for cid, manifest in complete[i].items():
                    if (manifest.step is None or not target.takes(manifest.step)
                            or cid in on_target or manifest.committed <= newest
                            or PendingCopy(cid, target.name) in queued
                            or target.read_manifest(cid) is not None):
                        continue
                    source, targets, when = jobs.setdefault(cid, (self.tiers[i], [],
                                                                  manifest.committed))
                    if target not in targets:
                        targets.append(target)
        for cid, (source, targets, _) in sorted(jobs.items(), key=lambda kv: kv[1][2]):
            log.info("queueing the drain of %s from '%s' to %s", cid, source.name,
                     ", ".join(f"'{t.name}'" for t in targets))
            manifest = source.read_manifest(cid)
            self.drainer.submit(DrainJob(cid, source, targets, manifest.save_token,
                                         manifest.files))

    def _build_replicator(self, process_group: Any) -> "Replicator | None":
        """The peer tier's replication (strategy checked against the world size, replica tiers
        for the ranks this one holds, a gloo group of its own); None without a peer tier."""
        peers = [t for t in self.tiers if t.backend.replication is not None]
        if not peers:
            return None
        source = self.config.source
        if len(peers) > 1:
            raise ConfigError(
                f"{source.where('tier', peers[1].config.index, 'backend')}: tiers "
                f"{', '.join(repr(t.name) for t in peers)} are all peer tiers; keep one")
        peer = peers[0]
        where = source.where("tier", peer.config.index, "replication")
        table = dict(peer.backend.replication)
        name = table.pop("strategy", None)
        reg = self.host.lookup("replication", name) if isinstance(name, str) else None
        if reg is None:
            raise ConfigError(
                f"{where}: tier '{peer.name}': replication needs 'strategy' naming one of "
                f"{', '.join(self.host.names('replication'))} (got {name!r}), e.g. "
                f"replication = {{ strategy = \"clique\", factor = 2, jump = 1 }}")
        options = validate_table(table, reg.options,
                                 owner=f"tier '{peer.name}' replication strategy '{name}'",
                                 source=source, table_name="tier", index=peer.config.index)
        strategy = reg.factory(**options)
        problem = strategy.check_world_size(self.ctx.world_size)
        if problem:
            raise ConfigError(f"{where}: tier '{peer.name}': {problem}")
        world, rank = self.ctx.world_size, self.ctx.rank
        held = [src for src in range(world) if rank in strategy.holders(src, world)]
        replica_tiers = {src: self._replica_tier(peer, src) for src in held}
        return Replicator(self, peer, strategy, replica_tiers, make_store_group(process_group),
                          self.config.part_timeout, self.config.drain_chunk_mib << 20)

    def _replica_tier(self, peer: Tier, src: int) -> Tier:
        """The tier where this rank keeps rank ``src``'s replicas (beside the peer tier)."""
        backend = peer.backend.replica_backend(src, self.ctx.rank)
        config = dataclasses.replace(peer.config, name=f"{peer.name}:rank-{src}")
        layout = TierLayout(0, 1, (src,), ((src,),))
        return Tier(config, backend, peer.commit, peer.commit_name, layout=layout,
                    codecs=peer.codecs)

    @property
    def replica_tiers(self) -> list[Tier]:
        """Tiers holding the replicas this rank keeps for its peers ([] without a peer tier)."""
        return list(self.replicator.replica_tiers.values()) if self.replicator else []

    def read_tiers(self) -> list[Tier]:
        """Every tier a load may read, fastest first: the replica tiers come right after the
        peer tier (own copy, then replicas kept here, then slower tiers)."""
        out = []
        for tier in self.tiers:
            out.append(tier)
            if self.replicator is not None and tier is self.replicator.peer:
                out += self.replica_tiers
        return out

    @property
    def save_seq(self) -> int:
        """How many saves this store has started (a save's number, for background jobs)."""
        return self._saves

    def hand_off_spec(self) -> StoreSpec:
        """Called when a save goes to DCP's checkpoint process: how that process opens this
        store. Its drains are queued here once it has committed (``adopt_handed_off_saves``)."""
        if self.node_local:
            raise ConfigError(
                "dcp.async_save with AsyncCheckpointerType.PROCESS is not supported with "
                "node-local tiers ({node} or {rank} in a path): their drains are coordinated by "
                "the ranks that saved; use AsyncCheckpointerType.THREAD (the default)"
            )
        self._handed_off = True
        return self._spec

    def adopt_handed_off_saves(self) -> None:
        """Queue the drains (and apply the retention) of saves that DCP's checkpoint process
        committed; a no-op unless this store handed saves to it."""
        if not self._handed_off or self.ctx.rank != 0:
            return
        with self._adopt_lock:  # one scan at a time, or both would queue the same copy
            self._queue_missing_copies()
            for tier in self.tiers:
                self.apply_retention(tier)

    def adopt_handed_off_saves_later(self) -> None:
        """``adopt_handed_off_saves`` in a background thread: listing tiers and deleting what
        ``keep`` drops must not lengthen the training stall of the next ``async_save``."""
        if self._handed_off and self.ctx.rank == 0:
            threading.Thread(target=self.adopt_handed_off_saves, name="tierstore-adopt",
                             daemon=True).start()

    @property
    def node_local(self) -> bool:
        """Whether some tier is split into parts (a directory per node or rank)."""
        return any(t.layout.parts > 1 for t in self.tiers)

    def _check_drain_paths(self) -> None:
        """Each group of a node-local tier is filled by its own leader from the same group's
        directory on a faster tier, so every tier before a node-local one must be node-local
        with the same groups (node-local tiers first, shared ones after)."""
        for j, target in enumerate(self.tiers):
            if target.layout.shared:
                continue
            for source in self.tiers[:j]:
                if source.layout.all_parts != target.layout.all_parts:
                    where = self.config.source.where("tier", target.config.index, "path")
                    what = ("is shared by every rank" if source.layout.shared else
                            f"groups the ranks as {[list(p) for p in source.layout.all_parts]}")
                    raise ConfigError(
                        f"{where}: tier '{target.name}' has a directory per group of ranks "
                        f"{[list(p) for p in target.layout.all_parts]}, but the faster tier "
                        f"'{source.name}' {what}, so drains could not fill it; list node-local "
                        f"tiers first, with the same placeholders ({{node}} or {{rank}}) in their "
                        f"paths, and shared tiers after them"
                    )

    def _build_tier(self, tc) -> Tier:
        reg = self.host.lookup("backend", tc.backend)
        options = tc.expanded_options(self.ctx, reg.options)
        root = str(options.get("path") or options.get("url") or "")
        try:
            backend = reg.factory(root=root, **options)
        except (ConfigError, PluginError):
            raise
        except Exception as exc:
            raise PluginError(
                f"backend '{tc.backend}' ({reg.origin}) failed to start for tier '{tc.name}': "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        problem = backend.check_reachable()
        if problem:
            key = "url" if "url" in options else "path"
            where = self.config.source.where("tier", tc.index, key)
            raise ConfigError(
                f"{where}: tier '{tc.name}': {key} {backend.describe()!r} cannot be used: "
                f"{problem}; point '{key}' at a writable location"
            )
        commit_name = self.config.commit.name if self.config.commit else backend.default_commit
        commit_reg = self.host.lookup("commit", commit_name)
        if commit_reg is None:
            raise PluginError(
                f"backend '{tc.backend}' ({reg.origin}) asks for commit protocol '{commit_name}', "
                f"which no plugin registers; registered: {', '.join(self.host.names('commit'))}"
            )
        options = self.config.commit.options if self.config.commit else {}
        codecs = []
        for choice in tc.codecs:
            codec = self.host.lookup("codec", choice.name).factory(**choice.options)
            register_extension(type(codec.extension()))
            codecs.append(codec)
        return Tier(tc, backend, commit_reg.factory(**options), commit_name, codecs=codecs)

    # -- DCP ---------------------------------------------------------------------------------
    def writer(self, *, emergency: bool = False) -> TierstoreWriter:
        """A DCP StorageWriter (and AsyncStager) saving into this store.

        ``emergency=True``: save to the fastest tier whatever its ``every``, and queue no drains
        (a process about to exit; the next ``tierstore.open`` queues them)."""
        self._check_open()
        return TierstoreWriter(self, emergency=emergency)

    def reader(self) -> TierstoreReader:
        """A DCP StorageReader loading from this store."""
        self._check_open()
        return TierstoreReader(self)

    # -- used by the writer ------------------------------------------------------------------
    def step_for(self, checkpoint_id: str) -> int:
        """The step number ``every`` is counted on: the id's trailing integer, else the count of
        saves made through this store (from 1)."""
        with self._lock:
            self._saves += 1
            count = self._saves
        step = step_of(checkpoint_id)
        return count if step is None else step

    def save_running(self, token: str | None) -> None:
        """Record that this thread now runs the save ``token`` (None: it runs none).

        DCP gives a writer no call when a save fails on another rank, so a save counts as over
        when its thread starts another one or ends; that is what lets gc collect its files."""
        with self._lock:
            if token is None:
                self._in_flight.pop(threading.get_ident(), None)
            else:
                self._in_flight[threading.get_ident()] = token

    def tokens_in_flight(self) -> set[str]:
        """Tokens of saves still running in live threads of this process."""
        alive = {t.ident for t in threading.enumerate()}
        with self._lock:
            return {tok for ident, tok in self._in_flight.items() if ident in alive}

    def first_tier_for(self, step: int) -> Tier:
        """The fastest tier whose ``every`` takes ``step`` (one with every = 1 always does)."""
        return next(t for t in self.tiers if t.takes(step))

    def tiers_for(self, step: int) -> list[Tier]:
        """Every tier that takes ``step``: the first one is saved to, the rest get the drain."""
        return [t for t in self.tiers if t.takes(step)]

    def publish(self, tier: Tier, checkpoint_id: str, staging: str, token: str,
                files: dict[str, FileEntry], step: int, seconds: float,
                all_files: dict[str, FileEntry] | None = None, drain: bool = True) -> Manifest:
        """Write the manifest and make the checkpoint (this rank's part of it, on a node-local
        tier) visible on ``tier``, queue drains to slower tiers, then apply ``keep``.
        ``all_files``: every file of the checkpoint, known on the coordinator."""
        host, rank, layout = self.host, self.ctx.rank, tier.layout
        manifest = Manifest(
            checkpoint_id=checkpoint_id, files=files, world_size=self.ctx.world_size,
            codecs=[c.name for c in tier.config.codecs], step=step, part=layout.part, parts=layout.parts,
            ranks=list(layout.part_ranks), save_token=token,
            plugins={"backend": tier.config.backend, "commit": tier.commit_name,
                     "staging": self.config.staging.name},
            created=time.time() - seconds, tierstore_version=__version__,
        )
        host.phase(Phase.WRITE_MANIFEST, checkpoint_id, tier.name, rank)
        existing = tier.manifest(checkpoint_id)
        if existing is not None and not self.config.overwrite:
            raise CommitError(
                f"checkpoint '{checkpoint_id}' appeared on tier '{tier.name}' while this save "
                f"was running; save under a new id or set [store] overwrite = true"
            )
        if existing is not None:
            manifest.pinned = existing.pinned
        manifest.committed = time.time()
        tier.commit.commit(tier.backend, checkpoint_id, staging, manifest.to_json(),
                           lambda phase: host.phase(phase, checkpoint_id, tier.name, rank))
        host.event(Event(EventKind.COMMITTED, checkpoint_id, tier.name, rank, seconds,
                         manifest.size_bytes, {"step": step}))
        log.info("committed %s on tier '%s' (%d bytes in %.2f s)", checkpoint_id, tier.name,
                 manifest.size_bytes, seconds)
        if self._hand_off:
            return manifest  # the training process's store drains and applies keep
        targets = [t for t in self.tiers_for(step) if t is not tier] if drain else []
        if targets:
            self.drainer.submit(DrainJob(checkpoint_id, tier, targets, token,
                                         all_files or files))
        self.retain_quietly(tier)
        return manifest

    def retain_quietly(self, tier: Tier) -> None:
        """``apply_retention`` after something committed: a failure to evict is logged (and
        retried at the next pass), never raised to the commit that is already done."""
        try:
            self.apply_retention(tier)
        except Exception:
            log.exception("applying keep on tier '%s' failed; the next save retries", tier.name)

    def apply_retention(self, tier: Tier) -> list[str]:
        """Delete what ``keep`` no longer keeps on ``tier``; returns the ids deleted."""
        if tier.config.keep is None:
            return []
        self.host.phase(Phase.RETAIN, None, tier.name, self.ctx.rank)
        # Saves (writer thread) and drains (drain thread) both apply retention; one at a time,
        # or both would pick the same victim.
        with self._retention_lock:
            # Still read by a drain, a replication or a load: evicting them under the reader
            # would also let recycling backends write over pages being read.
            self._count_released_loads()
            busy = self.drainer.protected(tier) | set(self._loading)
            if self.replicator is not None:
                busy |= self.replicator.protected(tier)
            victims = []
            for cid in tier.retention_victims(tier.complete()):
                if cid not in busy and self._evict(tier, cid):
                    victims.append(cid)
        for cid in victims:
            self.host.event(Event(EventKind.EVICTED, cid, tier.name, self.ctx.rank))
            log.info("evicted %s from tier '%s' (keep = %d)", cid, tier.name, tier.config.keep)
        return victims

    def _evict(self, tier: Tier, checkpoint_id: str) -> bool:
        """Evict ``checkpoint_id`` from ``tier`` unless another process (a rank sharing the
        directory) still sends it; then the next retention on the tier does."""
        lock = tier.backend.lock_directory(checkpoint_id, exclusive=True)
        if lock is None:
            log.info("not evicting %s from tier '%s' yet: another process is reading it",
                     checkpoint_id, tier.name)
            return False
        try:
            tier.delete(checkpoint_id, evicted=True)
        except FileNotFoundError:
            return False  # gone meanwhile (gc, or another process sharing the directory)
        finally:
            lock.release()
        return True

    def loading(self, checkpoint_id: str, begins: bool) -> None:
        """Count a load of ``checkpoint_id`` starting (``begins``) or over: while one is under
        way, ``keep`` does not evict that checkpoint from any tier."""
        with self._retention_lock:
            self._count_released_loads()
            self._count_load(checkpoint_id, 1 if begins else -1)

    def load_released_later(self, checkpoint_id: str) -> None:
        """A load of ``checkpoint_id`` is over, told from a finalizer: safe on any thread and
        inside any lock (it takes none); counted at the next retention or load."""
        self._loads_released.append(checkpoint_id)

    def _count_released_loads(self) -> None:
        while self._loads_released:
            self._count_load(self._loads_released.popleft(), -1)

    def _count_load(self, checkpoint_id: str, change: int) -> None:
        self._loading[checkpoint_id] += change
        if self._loading[checkpoint_id] <= 0:
            del self._loading[checkpoint_id]

    def collect_garbage(self, tier: Tier, protect: set[str] = frozenset()) -> list[str]:
        """Remove what interrupted saves left on ``tier`` (sparing saves in flight and the
        tokens in ``protect``); returns the entries removed."""
        removed = tier.leftovers(protect=self.tokens_in_flight() | set(protect))
        for name in removed:
            tier.backend.delete(name)
            self.host.event(Event(EventKind.COLLECTED, None, tier.name, self.ctx.rank,
                                  detail={"entry": name}))
            log.info("removed leftover %s from tier '%s'", name, tier.name)
        return removed

    # -- public API --------------------------------------------------------------------------
    def latest(self) -> str | None:
        """Newest checkpoint this job can load: every rank's files are on some tier (of some
        node, for node-local tiers) with their recorded sizes, and DCP's ``.metadata`` is too;
        checksums are checked while loading, file by file, falling back to the next tier. Under
        torch.distributed this is a collective on the store's group: every rank must call it,
        and all get the same answer."""
        self._check_open()
        views = all_gather_object(self.coverage(), self.process_group)
        world = set(range(self.ctx.world_size))
        best: tuple[float, str] | None = None
        for cid in set().union(*views):
            held = [v[cid] for v in views if cid in v]
            ranks = set().union(*(h.ranks for h in held))
            if ranks >= world and any(h.has_metadata for h in held):
                key = (max(h.committed for h in held), cid)
                best = key if best is None or key > best else best
        return best[1] if best else None

    def coverage(self) -> dict[str, Coverage]:
        """What this process holds of each checkpoint, over all its tiers: the ranks whose
        files are all present (a file may come from any tier), whether ``.metadata`` is, and
        when it was committed."""
        parts: dict[tuple[str, tuple[int, ...]], tuple[Manifest, set[str]]] = {}
        for tier in self.read_tiers():
            for cid in tier.checkpoint_names():
                manifest = tier.read_manifest(cid)
                if manifest is None:
                    continue
                _, present = parts.setdefault((cid, tuple(manifest.ranks)), (manifest, set()))
                present |= tier.present_files(cid, manifest)
        out: dict[str, Coverage] = {}
        for (cid, ranks), (manifest, present) in parts.items():
            if len(present) != len(manifest.files):
                continue
            prev = out.get(cid, Coverage(frozenset(), False, manifest.committed))
            out[cid] = Coverage(prev.ranks | frozenset(ranks),
                                prev.has_metadata or manifest.has_metadata,
                                max(prev.committed, manifest.committed))
        return out

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint complete on some tier of this process, newest first."""
        self._check_open()
        found: dict[str, tuple[list[str], Manifest]] = {}
        for tier in self.tiers:
            for cid, manifest in tier.complete().items():
                names, first = found.setdefault(cid, ([], manifest))
                names.append(tier.name)
        infos = [
            CheckpointInfo(id=cid, tiers=names, size_bytes=m.size_bytes, created=m.created,
                           committed=m.committed, pinned=m.pinned, step=m.step)
            for cid, (names, m) in found.items()
        ]
        return sorted(infos, key=lambda c: (c.committed, c.id), reverse=True)

    def verify(self, checkpoint_id: str, tier: str | None = None) -> VerifyReport:
        """Re-read ``checkpoint_id`` on one tier (or every tier holding it) and check every
        file's size and checksum against the manifest."""
        self._check_open()
        cid = validate_checkpoint_id(checkpoint_id)
        tiers = [self._tier(tier)] if tier else self.tiers
        checked, problems = [], []
        for t in tiers:
            found = t.verify(cid)
            if tier is None and found and found[0].file == "tierstore.json" \
                    and found[0].what.startswith("missing"):
                continue  # not on this tier at all: nothing to report when checking every tier
            checked.append(t.name)
            problems.extend(found)
        return VerifyReport(cid, checked, problems)

    def pin(self, checkpoint_id: str) -> None:
        """Mark a checkpoint so that ``keep`` never deletes it, on every tier holding it."""
        self._set_pinned(checkpoint_id, True)

    def unpin(self, checkpoint_id: str) -> None:
        """Let ``keep`` delete a checkpoint again."""
        self._set_pinned(checkpoint_id, False)

    def _set_pinned(self, checkpoint_id: str, pinned: bool) -> None:
        self._check_open()
        cid = validate_checkpoint_id(checkpoint_id)
        done = [t.name for t in self.tiers if t.set_pinned(cid, pinned)]
        if not done:
            raise CheckpointNotFound(
                f"cannot {'pin' if pinned else 'unpin'} '{cid}': it is not complete on any tier; "
                f"store.list() shows what is stored"
            )

    def gc(self) -> list[str]:
        """Remove what interrupted saves left on every tier (never a committed checkpoint)."""
        self._check_open()
        removed = []
        for tier in self.read_tiers():
            removed += [f"{tier.name}:{n}" for n in self.collect_garbage(tier)]
        return removed

    def wait(self, timeout: float | None = None, *, all_ranks: bool = False) -> None:
        """Block until every background transfer started so far is done (drains to slower
        tiers); raise the first failure since the last ``wait`` as a ``DrainError`` naming the
        checkpoint, the tier and the cause. ``TimeoutError`` when ``timeout`` seconds pass.

        Drains run on the rank that committed the copy they read (rank 0 for a shared tier,
        each node's leader for a node-local one), so a plain ``wait()`` covers this process's
        work. ``all_ranks=True`` (a collective: every rank calls it) returns on every rank once
        every rank's work is done, and raises there the first failure of any rank."""
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        self.slot.wait_idle()  # a save in flight queues its drains when it commits
        self.adopt_handed_off_saves()
        failure: BaseException | None = None
        try:
            try:
                self.drainer.wait(left())
            finally:
                if self.replicator is not None:
                    self.replicator.wait(left())
        except (DrainError, TimeoutError) as exc:
            if not all_ranks:
                raise
            failure = exc
        if all_ranks:
            failures = [f for f in all_gather_object(failure, self.process_group) if f]
            if failures:
                raise failures[0]

    def stats(self) -> dict[str, TierFigures]:
        """Per-tier figures of this process since the store was opened: saves, drains, loads
        (count, bytes, seconds, throughput), fallbacks, evictions, failures."""
        return self._stats.snapshot([t.name for t in self.tiers])

    def pending(self) -> list[PendingCopy]:
        """Copies to slower tiers not finished yet (checkpoint and tier), oldest first."""
        return self.drainer.pending()

    def preemption(self, signals: Iterable[int] = (signal.SIGTERM,)) -> Preemption:
        """Install a handler for ``signals`` (SIGTERM) that turns preemption into an emergency
        checkpoint at a step all ranks agree on; see :class:`tierstore.preemption.Preemption`.
        Collective (every rank, main thread)."""
        self._check_open()
        return Preemption(self, signals)

    def close(self, wait: bool = True) -> None:
        """Wait for background work (raising its failures), then release the drain threads,
        backends and the store's process group. ``wait=False``: do not wait for drains (what is
        left is listed on stderr; the next ``tierstore.open`` resumes drains to shared tiers)."""
        if self._closed:
            return
        self.host.store_closing(self)
        try:
            if wait:
                self.wait()
            else:
                self.slot.wait_idle()
                report_unfinished(self.drainer.pending(), self.drainer.unreported_failures())
        finally:
            self._closed = True
            atexit.unregister(self._atexit)
            self.drainer.close()
            if self.replicator is not None:
                self.replicator.close(timeout=None if wait else 0)
            self.stager.close()
            for tier in [*self.tiers, *self.replica_tiers]:
                tier.backend.close()
            if dist.is_initialized():
                groups = [self.process_group, self.save_group]
                if self.replicator is not None:
                    groups.append(self.replicator.group)
                for group in groups:
                    if group is not None:
                        dist.destroy_process_group(group)
            self.process_group = self.save_group = None

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise ValueError(f"no tier named {name!r}; tiers: {', '.join(t.name for t in self.tiers)}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this store is closed; open a new one with tierstore.open(...)")

    def __repr__(self) -> str:
        return f"<tierstore.Store tiers={[t.name for t in self.tiers]} rank={self.ctx.rank}>"


@dataclass(frozen=True)
class Coverage:
    """What one process holds of a checkpoint (see ``Store.coverage``)."""

    ranks: frozenset[int]
    has_metadata: bool
    committed: float


def _exit_handler(store_ref: "weakref.ref[Store]"):
    """At interpreter exit, finish what an unclosed store still has to drain (for at most
    ``[store] exit_timeout`` seconds) and say on stderr what did not reach which tier."""

    def handler() -> None:
        store = store_ref()
        if store is None or store._closed:
            return
        failures: list[DrainError] = []
        try:
            store.adopt_handed_off_saves()
            store.drainer.wait(store.config.exit_timeout)
        except TimeoutError:
            pass
        except DrainError as exc:
            failures.append(exc)
        report_unfinished(store.drainer.pending(), failures)

    return handler


def open(config: Any, *, process_group: Any = None, plugins: Iterable[object] = ()) -> Store:
    """Build a store from a TOML file path or a dict of the same shape.

    Validates the whole config (and loads every plugin) before anything is written. Under
    torch.distributed every rank must call it: it creates the store's own gloo group.
    ``plugins`` registers extra plugin objects (modules or instances with hook implementations).
    """
    return Store(config, process_group=process_group, plugins=plugins)
