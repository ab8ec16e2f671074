"""The Store: what ``tierstore.open()`` returns.

It owns the plugin manager, the validated config, the tiers of this process and the store's own
process group, and hands out DCP writers and readers bound to them.
"""

from __future__ import annotations

import atexit
import logging
import socket
import threading
import weakref
import time
from typing import Any, Iterable

import torch.distributed as dist

from . import __version__
from .config import StoreConfig, load_source, validate_config, validate_store_table
from .dist import RankContext, all_gather_object, make_store_group, rank_context
from .drain import DrainJob, Drainer, PendingCopy, report_unfinished
from .errors import CheckpointNotFound, CommitError, ConfigError, DrainError, PluginError
from .events import Event, EventKind, Phase
from .ids import step_of, validate_checkpoint_id
from .info import CheckpointInfo, VerifyReport
from .manifest import FileEntry, Manifest
from .plugin_manager import PluginHost, build_plugin_host
from .reader import TierstoreReader
from .tier import Problem, Tier
from .writer import TierstoreWriter
from tierstore_plugins.stats import TierFigures, TierStats

__all__ = ["Store", "open"]

log = logging.getLogger("tierstore")


class Store:
    """Multi-tier checkpoint storage behind DCP. Build one with :func:`tierstore.open`."""

    def __init__(self, config: Any, *, process_group: Any = None,
                 plugins: Iterable[object] = ()):
        data, source = load_source(config)
        store_table = validate_store_table(data.get("store", {}), source)
        self._stats = TierStats()
        self.host: PluginHost = build_plugin_host(store_table["plugins"],
                                                  f"[store] plugins in {source.name}",
                                                  tuple(plugins),
                                                  {"tierstore_plugins.stats": self._stats})
        self.config: StoreConfig = validate_config(data, source, self.host, store_table)
        self.ctx: RankContext = rank_context(process_group)
        self.tiers: list[Tier] = [self._build_tier(tc) for tc in self.config.tiers]
        reg = self.host.lookup("staging", self.config.staging.name)
        self.stager = reg.factory(**self.config.staging.options)
        self._saves = 0
        self._lock = threading.Lock()
        # thread ident -> token of the save that thread is running; gc spares these
        self._in_flight: dict[int, str] = {}
        self._closed = False
        self.process_group = make_store_group(process_group)
        self._check_shared_roots()
        self.drainer = Drainer(self, self.config.drain_threads, self.config.drain_chunk_mib << 20)
        self._atexit = _exit_handler(weakref.ref(self))
        atexit.register(self._atexit)
        if self.ctx.rank == 0:
            self._resume_drains()
        self.host.store_opened(self)

    def _resume_drains(self) -> None:
        """Queue the copies an earlier process did not finish (it was killed mid-drain, or
        exited first): a checkpoint complete on a faster tier, missing on a slower tier that
        takes its step, and newer than everything there (older ones were evicted by keep)."""
        jobs: dict[str, tuple[Tier, list[Tier], float]] = {}
        complete = [tier.complete() for tier in self.tiers]
        for j, target in enumerate(self.tiers):
            on_target = complete[j]
            newest = max((m.committed for m in on_target.values()), default=float("-inf"))
            for i in range(j):
                for cid, manifest in complete[i].items():
                    if (manifest.step is None or not target.takes(manifest.step)
                            or cid in on_target or manifest.committed <= newest
                            or target.read_manifest(cid) is not None):
                        continue
                    source, targets, when = jobs.setdefault(cid, (self.tiers[i], [],
                                                                  manifest.committed))
                    if target not in targets:
                        targets.append(target)
        for cid, (source, targets, _) in sorted(jobs.items(), key=lambda kv: kv[1][2]):
            log.info("resuming the drain of %s from '%s' to %s", cid, source.name,
                     ", ".join(f"'{t.name}'" for t in targets))
            self.drainer.submit(DrainJob(cid, source, targets))

    def _check_shared_roots(self) -> None:
        """Under torch.distributed, every rank must see each tier at the same directory on the
        same host: the coordinator publishes the checkpoint for all ranks with one rename.
        Per-node tiers ({node}, {rank} or node-local disks) need per-node commits, which come
        with the tier pipeline; refuse them clearly instead of losing other nodes' files."""
        if self.process_group is None:
            return
        mine = [(socket.gethostname(), t.backend.describe()) for t in self.tiers]
        views = all_gather_object(mine, self.process_group)
        for i, tier in enumerate(self.tiers):
            seen = {v[i] for v in views}
            if len(seen) > 1:
                where = self.config.source.where("tier", tier.config.index, "path")
                places = ", ".join(sorted(f"{h}:{r}" for h, r in seen))
                dist.destroy_process_group(self.process_group)
                self.process_group = None
                raise ConfigError(
                    f"{where}: tier '{tier.name}' resolves to different directories on different "
                    f"ranks ({places}); this version commits a checkpoint with one rename by the "
                    f"coordinator, so every rank must share the tier's directory: use a path "
                    f"without {{rank}}/{{node}} on a filesystem all ranks see"
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
            where = self.config.source.where("tier", tc.index, "path")
            raise ConfigError(
                f"{where}: tier '{tc.name}': path {backend.describe()!r} cannot be used: {problem}; "
                f"point 'path' at a writable directory"
            )
        commit_name = self.config.commit.name if self.config.commit else backend.default_commit
        commit_reg = self.host.lookup("commit", commit_name)
        if commit_reg is None:
            raise PluginError(
                f"backend '{tc.backend}' ({reg.origin}) asks for commit protocol '{commit_name}', "
                f"which no plugin registers; registered: {', '.join(self.host.names('commit'))}"
            )
        options = self.config.commit.options if self.config.commit else {}
        return Tier(tc, backend, commit_reg.factory(**options), commit_name)

    # -- DCP ---------------------------------------------------------------------------------
    def writer(self) -> TierstoreWriter:
        """A DCP StorageWriter (and AsyncStager) saving into this store."""
        self._check_open()
        return TierstoreWriter(self)

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
                files: dict[str, FileEntry], step: int, seconds: float) -> Manifest:
        """Write the manifest and make the checkpoint visible on ``tier``, then apply ``keep``."""
        host, rank = self.host, self.ctx.rank
        manifest = Manifest(
            checkpoint_id=checkpoint_id, files=files, world_size=self.ctx.world_size,
            codecs=list(tier.config.codecs), step=step,
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
        targets = [t for t in self.tiers_for(step) if t is not tier]
        if targets:
            self.drainer.submit(DrainJob(checkpoint_id, tier, targets))
        self.apply_retention(tier)
        return manifest

    def apply_retention(self, tier: Tier) -> list[str]:
        """Delete what ``keep`` no longer keeps on ``tier``; returns the ids deleted."""
        if tier.config.keep is None:
            return []
        self.host.phase(Phase.RETAIN, None, tier.name, self.ctx.rank)
        busy = self.drainer.protected(tier)  # still being copied to slower tiers
        victims = [v for v in tier.retention_victims(tier.complete()) if v not in busy]
        for cid in victims:
            tier.delete(cid)
            self.host.event(Event(EventKind.EVICTED, cid, tier.name, self.ctx.rank))
            log.info("evicted %s from tier '%s' (keep = %d)", cid, tier.name, tier.config.keep)
        return victims

    def collect_garbage(self, tier: Tier) -> list[str]:
        """Remove what interrupted saves left on ``tier``; returns the entries removed."""
        removed = tier.leftovers(protect=self.tokens_in_flight())
        for name in removed:
            tier.backend.delete(name)
            self.host.event(Event(EventKind.COLLECTED, None, tier.name, self.ctx.rank,
                                  detail={"entry": name}))
            log.info("removed leftover %s from tier '%s'", name, tier.name)
        return removed

    # -- public API --------------------------------------------------------------------------
    def latest(self) -> str | None:
        """Newest checkpoint this store can load: every file of it is on some tier with its
        recorded size (checksums are checked while loading, file by file, falling back to the
        next tier). Under torch.distributed this is a collective on the store's group: every
        rank must call it and all get the same answer, counting only ids every rank can load."""
        self._check_open()
        mine = {cid: m.committed for cid, m in self.loadable().items()}
        views = all_gather_object(mine, self.process_group)
        common = set(views[0]).intersection(*views[1:])
        if not common:
            return None
        return max(common, key=lambda cid: (max(v[cid] for v in views), cid))

    def loadable(self) -> dict[str, Manifest]:
        """Checkpoints whose every file is on some tier of this process (sizes matching)."""
        found: dict[str, tuple[Manifest, set[str]]] = {}
        for tier in self.tiers:
            for cid in tier.checkpoint_names():
                manifest = found[cid][0] if cid in found else tier.read_manifest(cid)
                if manifest is None:
                    continue
                _, present = found.setdefault(cid, (manifest, set()))
                present |= tier.present_files(cid, manifest)
        return {cid: m for cid, (m, present) in found.items() if len(present) == len(m.files)}

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
        for tier in self.tiers:
            removed += [f"{tier.name}:{n}" for n in self.collect_garbage(tier)]
        return removed

    def wait(self, timeout: float | None = None) -> None:
        """Block until every background transfer started so far is done (drains to slower
        tiers); raise the first failure since the last ``wait`` as a ``DrainError`` naming the
        checkpoint, the tier and the cause. ``TimeoutError`` when ``timeout`` seconds pass."""
        self._check_open()
        self.drainer.wait(timeout)

    def stats(self) -> dict[str, TierFigures]:
        """Per-tier figures of this process since the store was opened: saves, drains, loads
        (count, bytes, seconds, throughput), fallbacks, evictions, failures."""
        return self._stats.snapshot([t.name for t in self.tiers])

    def pending(self) -> list[PendingCopy]:
        """Copies to slower tiers not finished yet (checkpoint and tier), oldest first."""
        return self.drainer.pending()

    def close(self) -> None:
        """Wait for background work (raising its failures), then release the drain threads,
        backends and the store's process group."""
        if self._closed:
            return
        self.host.store_closing(self)
        try:
            self.wait()
        finally:
            self._closed = True
            atexit.unregister(self._atexit)
            self.drainer.close()
            self.stager.close()
            for tier in self.tiers:
                tier.backend.close()
            if self.process_group is not None and dist.is_initialized():
                dist.destroy_process_group(self.process_group)
                self.process_group = None

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


def _exit_handler(store_ref: "weakref.ref[Store]"):
    """At interpreter exit, finish what an unclosed store still has to drain (for at most
    ``[store] exit_timeout`` seconds) and say on stderr what did not reach which tier."""

    def handler() -> None:
        store = store_ref()
        if store is None or store._closed:
            return
        failures: list[DrainError] = []
        try:
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
