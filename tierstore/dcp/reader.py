"""``Store.reader()``: the DCP StorageReader that loads a checkpoint from the fastest tier.

Call sequence (DCP's): ``reset`` (all ranks) -> ``read_metadata`` (all) -> ``set_up_storage_reader``
(all) -> ``prepare_local_plan`` (all) -> ``prepare_global_plan`` (coordinator) -> ``read_data``
(all). Finding the checkpoint and checking its metadata happen in ``reset``, whose errors reach
the user unwrapped.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierstore.dcp.shared_reads import READER_RANK, job_wide, shared_manifests, shared_result
from tierstore.dcp.peer_fetch import (FetchedFile, PeerFetchPlan, Servable, fetch_from_peers,
                                      held_here, local_sources, node_tiers, schedule_plans,
                                      servable_fields, servable_from_fields, servable_here,
                                      wanted_from_peers)
from tierstore.engine.catalog import Catalog
from tierstore.engine.context import StoreContext
from tierstore.engine.health import TierHealth
from tierstore.engine.listings import Listings
from tierstore.engine.parity import rebuild_lost
from tierstore.engine.retention import Retention
from tierstore.engine.watchdog import Watchdog
from tierstore.engine.saves import SaveSlot
from tierstore import errors
from tierstore.errors import CheckpointNotFound, IntegrityError, TierstoreError
from tierstore.events import FROM_PEERS, Event, EventKind, Phase
from tierstore.format.signing import Keyring
from tierstore.format.ids import is_valid_checkpoint_id, validate_checkpoint_id
from tierstore.format.item_io import (BufferReader, FileReadError, LoadUndo, MappedCopy,
                                      check_blocks, map_checked, needed_ranges, read_items,
                                      read_runs, runs_bytes)
from tierstore.format.manifest import MANIFEST_NAME, METADATA_NAME, FileEntry, Manifest
from tierstore.format.metadata import load_metadata
from tierstore.tiers.parity_sets import parity_of
from tierstore.tiers.tier import Tier
from tierstore.transport.collectives import (all_gather_message, all_reduce_max,
                                             broadcast_with_bytes)
from tierstore.transport.messages import MessageError
from tierstore.transport.shapes import as_dict, as_int, as_list, as_str, as_tuple, optional

__all__ = ["TierstoreReader", "ReaderServices"]

log = logging.getLogger("tierstore.dcp.reader")

#: how much of each failing rank's message the others are told (the rest is in its own error)
_TOLD_CHARS = 2000


@dataclass(frozen=True)
class _LoadRanks:
    """``LoadPlan.storage_data`` of a load without peers to fetch from: the rank of the
    store's group a plan comes from on the way to the coordinator, and on the way back whether
    DCP's plan exchange went through every rank of that group once (``together``). Only then
    do the ranks agree on the load's outcome in ``read_data``: a load DCP runs in one process
    (``no_dist``: ``Store.export``, a rank loading alone) has no one to agree with."""

    rank: int
    together: bool = False


@dataclass(frozen=True)
class ReaderServices:
    """What a reader may use of its store (never the store itself)."""

    context: StoreContext
    #: loads tell retention what they read, so ``keep`` spares it
    retention: Retention
    #: a load waits for the store's save in flight
    slot: SaveSlot
    catalog: Catalog
    #: tiers that fail to answer are left out of a load's sources
    health: TierHealth
    #: told when a load starts and ends (``[store] watchdog``)
    watchdog: Watchdog | None = None
    #: the looks at object stores ``latest()`` took, whose manifests a load reuses
    listings: Listings | None = None


class TierstoreReader(StorageReader):
    """Loads a checkpoint, checking every file against its manifest while reading it."""

    def __init__(self, services: ReaderServices, *, alone: bool = False):
        """``alone``: DCP runs this load in this process only (``Store.export``, ``inspect``),
        not on every rank of the store's group together: it reads everything itself."""
        self._services = services
        self._alone = alone
        self._checkpoint_id: str | None = None
        self._sources: list[tuple[Tier, Manifest]] = []
        self._metadata: Metadata | None = None
        self._rank = 0
        self._fresh = False
        #: files (or blocks of them) peers sent for this load, by relative path
        self._fetched: dict[str, FetchedFile] = {}
        #: files this load reads in part, from a copy checked block by block: their runs
        self._runs: dict[str, list[tuple[int, int]]] = {}
        #: local copies checked from their mapped pages, read from them (by relative path)
        self._mapped: dict[str, MappedCopy] = {}
        # They are checked when DCP prepares the plan and read in read_data: a load that DCP
        # abandons in between (another rank failed its plan) and then drops this reader must
        # not keep their pages mapped and their directories locked against keep.
        weakref.finalize(self, _close_copies, self._mapped)
        #: this load's read items per file (set by prepare_local_plan)
        self._per_file: dict[str, list[ReadItem]] | None = None
        #: where each file's read starts (see _first_good_copy), set by prepare_local_plan
        self._firsts: dict[str, tuple[int, list[str], bool]] = {}
        #: the files this rank asks peers for: the entry it goes by, and the ranges
        self._wanted: tuple[dict[str, FileEntry], dict[str, list[tuple[int, int]]]] = ({}, {})
        #: what each rank can serve to peers of this load's copies (node-local tiers only)
        self._holders: list[dict[str, FileEntry | None]] = []
        #: files of this load's checkpoint present on the job-wide tiers, as the rank that
        #: read their manifests for all found them (no rank asks each file's size again)
        self._present: dict[str, set[str]] = {}
        #: slower tiers whose manifests this load has not read yet (see _reset), and whether
        #: a copy there may be mixed with the sources (its save token, codecs, .metadata)
        self._deferred: list[Tier] = []
        self._mixable = None
        self._deferring = threading.Lock()
        # Releases the id kept from eviction while this loads: at the end of read_data, at
        # the next reset, or when DCP fails in between and drops the reader.
        self._protection: weakref.finalize | None = None
        self._watch: int | None = None  # the watchdog's token of the load in flight

    def _stop_protecting(self) -> None:
        watchdog = self._services.watchdog
        if watchdog is not None:
            watchdog.end(self._watch)
            self._watch = None
        if self._protection is not None:
            self._protection()  # runs once, however often called
            self._protection = None

    def reset(self, checkpoint_id=None) -> None:
        """Find the tiers holding a complete copy of ``checkpoint_id`` and read its metadata;
        ``keep`` spares it until this load has read its data."""
        cid = validate_checkpoint_id(checkpoint_id)
        self._stop_protecting()
        self._unmap()  # an earlier load that DCP abandoned between its plan and its read
        retention = self._services.retention
        retention.loading(cid, begins=True)
        self._protection = weakref.finalize(self, retention.load_released_later, cid)
        if self._services.watchdog is not None:
            self._watch = self._services.watchdog.begin(f"load of '{cid}'")
        try:
            self._reset(cid)
        except BaseException:
            self._stop_protecting()
            raise

    def _reset(self, cid: str) -> None:
        services = self._services
        ctx = services.context
        ctx.host.phase(Phase.LOAD_BEGIN, cid, None, ctx.rank)
        services.slot.wait_idle()  # never load beside a save of this store in flight
        self._present = {}
        order = ctx.tiers.read_order()
        peers = ctx.tiers.node_local and ctx.groups.main is not None
        # With nodes to fetch from, the slower shared tiers after the node-local ones (an
        # object store) are read only for what no node holds: their manifests are read when
        # the nodes' copies do not cover the checkpoint, or when a file has no good copy on
        # them, and not by every rank at every restart (each with a client to make).
        eager = node_tiers(ctx) if peers else order
        deferred = [t for t in order if not any(t is e for e in eager)]
        sources, rejected = self._manifests(cid, eager, together=True)
        if peers and ctx.tiers.parity_tier is not None and self._rebuild_from_parity(
                cid, sources):
            sources, rejected = self._manifests(cid, eager)  # with the rebuilt copy
        if peers or not self._shares():
            raw, codecs, problems, token = self._local_metadata(
                cid, self._metadata_sources(sources))
        else:
            # Every tier is the whole job's: one rank reads .metadata, and every rank checks
            # what it got against the manifest's entry when it parses it (load_metadata).
            raw, codecs, problems, token = shared_result(
                ctx, lambda: self._local_metadata(cid, sources))
        self._fetched = {}
        servable: list[list[Servable]] = []
        if peers:
            # With a directory per node, only the coordinator's node has .metadata, and one
            # rank may find nothing while others do: decide together, so that no rank goes on
            # into DCP's collectives while another has raised.
            try:
                raw, codecs, token, servable = self._share_metadata(cid, raw, codecs, token,
                                                                    sources)
            except CheckpointNotFound:
                if not deferred:
                    raise
                # Every rank got here alike (the decision is on gathered views): the slower
                # tiers hold what the nodes do not; decide again with them.
                more, more_rejected = self._manifests(cid, deferred, together=True)
                sources, rejected, deferred = sources + more, rejected + more_rejected, []
                raw, codecs, problems, token = self._local_metadata(
                    cid, self._metadata_sources(sources))
                raw, codecs, token, servable = self._share_metadata(cid, raw, codecs, token,
                                                                    sources)
        elif not sources and rejected:
            raise IntegrityError(
                f"checkpoint '{cid}' has no copy to trust: " + "; ".join(rejected)
                + ". Restore it from another copy, or load another checkpoint "
                  "(store.latest() gives the newest loadable one)")
        elif not sources:
            available = [c.id for c in services.catalog.list()[:5]]
            hint = (f"newest available: {', '.join(available)}" if available
                    else "no checkpoint is stored yet")
            raise CheckpointNotFound(
                f"checkpoint '{cid}' is not complete on any tier "
                f"({', '.join(t.name for t in ctx.tiers)}); {hint}. store.latest() gives the "
                f"newest loadable one"
            )
        elif raw is None:
            raise IntegrityError(
                f"checkpoint '{cid}': no tier has a good copy of {METADATA_NAME} ("
                + "; ".join(problems) + f"); run store.verify('{cid}') for details"
            )
        # Files can only be mixed between copies that share this metadata: a tier with other
        # codecs holds the same checkpoint at other offsets, and a part written by another
        # save of the same id (overwrite, a node whose part is stale) holds other bytes.
        keyring = self._services.context.config.keyring

        def mixable(save_token, its_codecs, metadata_entry) -> bool:
            return save_token == token and (
                _matches(keyring, raw, metadata_entry) if metadata_entry is not None
                else list(its_codecs) == list(codecs))

        sources = [(t, m) for t, m in sources
                   if mixable(m.save_token, m.codecs, m.files.get(METADATA_NAME))]
        self._deferred, self._mixable = deferred, mixable
        # What each rank may serve to the others, of the copies every rank's load may read.
        self._holders = [_merged_files(s.files for s in theirs
                                       if mixable(s.save_token, s.codecs, s.metadata))
                         for theirs in servable]
        self._checkpoint_id = cid
        self._sources = sources
        # Every copy left in sources has these very bytes: name them all.
        self._metadata = load_metadata(raw, (
            ", ".join(f"tier '{t.name}'" for t, m in sources if m.has_metadata)
            or "a peer rank's tier") + f": {cid}/{METADATA_NAME}")
        self._fresh = True

    def _rebuild_from_parity(self, cid: str, sources: list[tuple[Tier, Manifest]]) -> bool:
        """Collective: rebuild the files of ranks whose node lost them from their parity sets
        (tierstore.engine.parity) before the load looks for copies; whether this rank got a
        rebuilt copy."""
        ctx = self._services.context
        tiers = ctx.tiers
        covered: dict[str, list[int]] = {}
        for tier, manifest in sources:
            if len(self._present_files(tier, cid, manifest)) == len(manifest.files):
                covered.setdefault(manifest.save_token, []).extend(manifest.ranks)
        mine = {"covered": {t: sorted(set(r)) for t, r in covered.items()},
                "parity": parity_of(tiers.parity_tier, cid)}
        own_root = tiers.peer.backend.replica_backend(ctx.rank, ctx.rank).root
        rebuilt = next(t for t in tiers.found_replicas if t.backend.root == own_root)
        got = rebuild_lost(
            ctx.groups.main, ctx.rank, ctx.job.world_size, cid, mine, sources,
            tiers.parity_tier, rebuilt,
            lambda phase: ctx.host.phase(phase, cid, rebuilt.name, ctx.rank),
            ctx.copy_chunk_bytes)
        if got is None:
            return False
        # The rebuilt set keeps what the peer tier keeps (this load's id is spared).
        self._services.retention.apply_quietly(rebuilt)
        ctx.host.event(Event(EventKind.REBUILT, cid, rebuilt.name, ctx.rank,
                             nbytes=got[1].size_bytes,
                             detail={"files": sorted(got[1].files), "from_parity": True}))
        return True

    def _metadata_sources(self, sources: list[tuple[Tier, Manifest]]
                          ) -> list[tuple[Tier, Manifest]]:
        """The sources this rank reads ``.metadata`` from. In a load of node-local tiers that
        every rank runs together, the job-wide tiers' copy is read by one rank only: the ranks
        agree on the metadata afterwards and take it from the lowest rank that has it
        (``_share_metadata``), so the others would read the same object for nothing."""
        ctx = self._services.context
        if not self._shares() or ctx.rank == READER_RANK:
            return sources
        return [(t, m) for t, m in sources if not job_wide(ctx, t)]

    def _present_files(self, tier: Tier, cid: str, manifest: Manifest) -> set[str]:
        """The files of ``manifest`` stored on ``tier``: as the reading rank found them on a
        job-wide tier, else asked here."""
        known = self._present.get(tier.name)
        return set(known) if known is not None else tier.present_files(cid, manifest)

    def _shares(self) -> bool:
        """Whether every rank of the store's group runs this load together (so one rank may
        read a job-wide tier's small files for all: :mod:`tierstore.dcp.shared_reads`)."""
        return self._services.context.groups.main is not None and not self._alone

    def _manifests(self, cid: str, tiers: list[Tier], together: bool = False
                   ) -> tuple[list[tuple[Tier, Manifest]], list[str]]:
        """The checked manifests of ``cid`` on ``tiers`` (in their order), and why the copies
        not trusted were not (each also said in a ``rejected`` event). Every tier with a
        manifest is a source, even one missing a file: files are read one by one from the
        fastest tier that has a good copy. ``together``: every rank of the load calls this
        with the same tiers (a collective), and one rank reads the job-wide tiers' manifests
        for all."""
        services = self._services
        told = (shared_manifests(services.context, services.health, services.listings, cid,
                                 tiers)
                if together and self._shares() and services.listings is not None else {})
        sources, rejected = [], []
        for tier in tiers:
            if tier.name in told:
                found = told[tier.name]
                if found is None:
                    continue  # it did not answer the reading rank: no source, as if here
                raw, why, present = found
                manifest, why = ((None, why) if raw is None
                                 else tier.manifest_from(cid, raw))
                if manifest is not None:
                    self._present[tier.name] = set(present)
            else:
                manifest, why = services.health.ask(
                    tier, "load", lambda t=tier: t.checked_manifest(cid), (None, None))
            if manifest is not None:
                sources.append((tier, manifest))
            elif why is not None:
                self._reject(cid, tier, why)
                rejected.append(f"tier '{tier.name}': {why}")
        return sources, rejected

    def _read_deferred(self) -> bool:
        """Add the slower tiers this load has not consulted yet to its sources (those whose
        copy may be mixed with them); whether this call read any. Thread-safe: the reading
        threads call it when a file has no good copy on the sources so far."""
        with self._deferring:
            deferred, self._deferred = self._deferred, []
            if not deferred:
                return False
            more, _ = self._manifests(self._checkpoint_id, deferred)
            self._sources.extend((t, m) for t, m in more
                                 if self._mixable(m.save_token, m.codecs,
                                                  m.files.get(METADATA_NAME)))
            return True

    def _sources_from(self, start: int):
        """``(index, (tier, manifest))`` of the sources from ``start`` on, then of the slower
        tiers not consulted yet (read now, once, when a file needs them)."""
        n = start
        while True:
            if n >= len(self._sources):
                self._read_deferred()  # (or another reading thread just did)
                if n >= len(self._sources):
                    return
            yield n, self._sources[n]
            n += 1

    def _reject(self, cid: str, tier: Tier, why: str, file: str = MANIFEST_NAME) -> None:
        """A copy on ``tier`` failed its checks: say so (warning and ``rejected`` event)."""
        ctx = self._services.context
        log.warning("checkpoint %s: not trusting tier '%s': %s", cid, tier.name, why)
        ctx.host.event(Event(EventKind.REJECTED, cid, tier.name, ctx.rank,
                             detail={"file": file, "error": why}))

    def _local_metadata(self, cid: str, sources: list[tuple[Tier, Manifest]]
                        ) -> tuple[bytes | None, list[str], list[str], str | None]:
        """The first copy of ``.metadata`` on this process's tiers that matches its manifest,
        the codecs of that copy, what was wrong with the others, and the save token of that
        copy (the save whose files a load may read)."""
        problems = []
        for tier, manifest in sources:
            entry = manifest.files.get(METADATA_NAME)
            if entry is None:
                continue  # a node-local part without the coordinator's metadata
            try:
                raw = tier.backend.read_bytes(f"{cid}/{METADATA_NAME}")
            except (OSError, IntegrityError) as exc:
                problems.append(f"tier '{tier.name}': {exc}")
                continue
            if not _matches(tier.keyring, raw, entry):
                problems.append(f"tier '{tier.name}': {METADATA_NAME} does not match its manifest")
                continue
            return raw, manifest.codecs, problems, manifest.save_token
        return None, [], problems or ["no tier holds it"], None

    def _share_metadata(self, cid: str, raw: bytes | None, codecs: list[str],
                        token: str | None, sources: list[tuple[Tier, Manifest]]
                        ) -> tuple[bytes, list[str], str, list[list[Servable]]]:
        """Collective: check that every rank's files are held by some rank (on any tier, a
        replica included) and take the metadata (its codecs and save token) from the lowest
        rank that has it; only files of that save count. Raises the same
        ``CheckpointNotFound`` on every rank otherwise. Also returns what each rank can serve
        to the others (gathered here, so that a load fetching from peers later gathers once,
        not twice)."""
        ctx = self._services.context
        tiers, group = ctx.tiers, ctx.groups.main
        by_token: dict[str, set[int]] = {}
        absent: dict[str, set[str]] = {}  # files an incomplete copy lists but lacks, by save
        saved_world = None
        for tier, manifest in sources:
            present = self._present_files(tier, cid, manifest)
            if len(present) == len(manifest.files):
                by_token.setdefault(manifest.save_token, set()).update(manifest.ranks)
            else:
                absent.setdefault(manifest.save_token, set()).update(set(manifest.files) - present)
            saved_world = manifest.world_size
        status = all_gather_message(
            [token if raw is not None else None, {t: sorted(r) for t, r in by_token.items()},
             saved_world, [servable_fields(s) for s in servable_here(ctx, cid, sources)]],
            group, _status_from, "what a rank holds of the checkpoint")
        token = next((t for t, *_ in status if t is not None), None)
        # The save whose files the load reads is the one of the .metadata it found; with no
        # good .metadata anywhere there is none to go by, and a complete copy of any save of
        # this id counts (otherwise every rank would be named as missing, not only the ranks
        # whose files are gone).
        ours = (lambda t: t == token) if token is not None else (lambda t: True)
        covered = {r for _, b, *_ in status for t, ranks in b.items() if ours(t) for r in ranks}
        saved_world = next((w for _, _, w, *_ in status if w is not None), None)
        names = ", ".join(t.name for t in tiers)
        if saved_world is None:
            raise CheckpointNotFound(
                f"checkpoint '{cid}' is on no tier of any rank ({names}); store.latest() gives "
                f"the newest loadable one")
        # Whatever this job's size (DCP reshards): every file of the save must be held by some
        # rank, and the ranks that need one get it from a holder (peer_fetch).
        missing = sorted(set(range(saved_world)) - covered)
        holders = [r for r, (has, *_) in enumerate(status) if has is not None]
        if missing or not holders:
            why = []
            if missing:
                # The files named are those an incomplete copy lists that no rank holds: a
                # node lost whole leaves no list, and then only its ranks are named. Every
                # rank decided alike (on gathered views), so every rank gathers this too:
                # only on the way to this error, not at every load.
                lacking = all_gather_message(
                    {t: sorted(files) for t, files in absent.items()}, group,
                    lambda v: as_dict(v, as_str, lambda fs: set(as_list(fs, as_str))),
                    "the files a rank lacks, by save")
                held = {rel for *_, servable in status for s in servable
                        if ours(s.save_token) for rel in s.files}
                gone = sorted({rel for lacks in lacking for t, files in lacks.items()
                               if ours(t) for rel in files} - held)
                why.append(f"the files of rank(s) {missing} are on no tier of any rank"
                           + (f" ({', '.join(gone)} on none)" if gone else "")
                           + " and no peer holds a replica of them"
                           + (", nor could parity rebuild them" if tiers.parity_tier is not None
                              else ""))
            if not holders:
                why.append(f"no rank has a good copy of {METADATA_NAME}")
            raise CheckpointNotFound(
                f"checkpoint '{cid}' cannot be loaded by this job: {'; '.join(why)} ({names}); "
                f"store.latest() gives the newest loadable one")
        src = holders[0]
        # .metadata's bytes beside the message, as they are (inside it: base64, a third more).
        codecs, raw = broadcast_with_bytes(
            list(codecs) if ctx.rank == src else None, raw if ctx.rank == src else None, group,
            src, lambda v: None if v is None else as_list(v, as_str), "a list of codecs")
        if raw is None or codecs is None:
            raise MessageError(f"rank {src} said it holds {METADATA_NAME} of checkpoint "
                               f"'{cid}' and then sent none; every rank of a job must run the "
                               f"same tierstore")
        return raw, codecs, token, [s for *_, s in status]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP calls reset only when a checkpoint id is given; never reuse the previous load's.
        fresh, self._fresh = self._fresh, False
        if self._metadata is None or not fresh:
            raise RuntimeError("the tierstore reader needs a checkpoint id: "
                               "dcp.load(sd, storage_reader=store.reader(), checkpoint_id=...)")
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self._metadata = metadata
        self._rank = kwargs.get("rank") or 0

    def _peers(self) -> bool:
        """Whether this load may fetch from peers (node-local tiers in a distributed job)."""
        ctx = self._services.context
        return ctx.tiers.node_local and ctx.groups.main is not None

    def _here(self) -> int:
        """How many of the sources count as this node's (the rest are slower shared tiers)."""
        ctx = self._services.context
        return len(local_sources(ctx, self._sources)) if self._peers() else len(self._sources)

    def _pool(self, files: int) -> ThreadPoolExecutor | None:
        """Threads to check or read ``files`` files with (None: this thread alone). Reading
        from RAM and checking digests is CPU work: more threads than this rank's share of the
        node's CPUs only take turns with the other ranks' (and slow them)."""
        ctx = self._services.context
        workers = min(ctx.config.io_threads, ctx.job.cpu_share(), max(1, files))
        return (ThreadPoolExecutor(workers, thread_name_prefix="tierstore-read")
                if workers > 1 else None)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Check this node's copies of the files the plan reads (those blocks of them it
        reads), and with peers, carry to the coordinator what this rank needs of the files no
        copy here holds good (in ``storage_data``: DCP's plan exchange carries it, and the
        coordinator schedules the transfers; see :mod:`tierstore.dcp.peer_fetch`)."""
        self._unmap()
        self._fetched = {}
        storage_data = self._metadata.storage_data
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(storage_data[req.storage_index].relative_path, []).append(req)
        self._per_file = per_file
        self._firsts = self._check_local(list(per_file))
        ctx = self._services.context
        if not self._peers():
            if ctx.groups.io is None:
                return plan
            return dataclasses.replace(plan, storage_data=_LoadRanks(ctx.rank))
        self._wanted = self._wants(self._firsts)
        return dataclasses.replace(plan, storage_data=PeerFetchPlan(
            self._services.context.rank, self._wanted[1]))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The coordinator schedules every peer transfer of the load (each rank gets those it
        takes part in with its plan); without peers, it tells every rank whether the load is
        one of every rank of the store's group (they then agree on its outcome)."""
        asked = [p.storage_data for p in plans]
        if all(isinstance(a, _LoadRanks) for a in asked):
            # Every rank of the store's group, once each: DCP's read step runs on all of them.
            together = (sorted(a.rank for a in asked)
                        == list(range(self._services.context.job.world_size)))
            return [dataclasses.replace(p, storage_data=_LoadRanks(a.rank, together))
                    for p, a in zip(plans, asked)]
        if not self._peers() or not all(isinstance(a, PeerFetchPlan) for a in asked):
            return plans
        return [dataclasses.replace(p, storage_data=a)
                for p, a in zip(plans, schedule_plans(asked, self._holders))]

    def _check_local(self, files: list[str]) -> dict[str, tuple[int, list[str], bool]]:
        """Where reading each of ``files`` starts: this node's copies checked (see
        :meth:`_first_good_copy`), every file of the load before any byte lands."""
        here = self._here()
        pool = self._pool(len(files))
        try:
            found = (map if pool is None else pool.map)(
                lambda r: self._first_good_copy(r, 0, here), files)
            return dict(zip(files, found))
        finally:
            if pool is not None:
                pool.shutdown(wait=True)

    def _wants(self, firsts: dict[str, tuple[int, list[str], bool]]
               ) -> tuple[dict[str, FileEntry], dict[str, list[tuple[int, int]]]]:
        """What this rank asks its peers for: the files with no good copy here."""
        ctx, cid = self._services.context, self._checkpoint_id
        here = self._here()
        if ctx.config.verify_on_load:
            missing = {r for r, (start, _, _) in firsts.items() if start >= here}
        else:  # unchecked: a copy of the right size counts
            local = self._sources[:here]
            missing = {r for r in firsts if held_here(cid, r, local) is None}
        return wanted_from_peers(self._sources, missing, self._holders, self._needed_ranges)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's items, files in parallel, each from the first tier whose copy
        matches the manifest. All or nothing on every rank: when the load is one of every rank
        of the store's group, nothing lands in any rank's state dict before every rank's files
        are read and checked (:meth:`_agree`, one small collective); a failure on any rank
        raises on every rank, and every rank's state dict is left as it was."""
        try:
            return self._read_data(plan, planner)
        finally:
            self._stop_protecting()

    def _together(self, plan: LoadPlan) -> bool:
        """Whether every rank of the store's group runs this load's read step, and so can agree
        on its outcome: with peers, the reads are collective already (:mod:`peer_fetch`);
        without, DCP's plan exchange said so (:class:`_LoadRanks`)."""
        if self._services.context.groups.io is None:
            return False
        if self._peers():
            return True
        mark = plan.storage_data
        return isinstance(mark, _LoadRanks) and mark.together

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        ctx = self._services.context
        started = time.perf_counter()
        # Decided before anything can fail: a rank that skipped the agreement below would
        # leave the others waiting in it.
        together = self._together(plan)
        # A load is all or nothing, whatever mix of tiers serves its files. Local copies were
        # checked first (prepare_local_plan, from their mapped pages: no copy; only the
        # blocks this rank reads, of a file it needs part of). Their bytes, like those peers
        # sent and the checked blocks of a copy read in part, are already checked and in
        # memory: they reach no destination until every file of the load is good (undo.apply
        # copies them in, the one copy a read makes anyway), so a later file's failure has
        # nothing of theirs to undo. Copies that cannot be checked before they are read
        # (streams) are read once, straight into their destinations with the old bytes kept
        # (holding their bytes back instead would cost the same buffer and copy): any failure
        # puts those back (LoadUndo).
        undo = LoadUndo()
        pool: ThreadPoolExecutor | None = None

        def each(fn, items):
            return list(map(fn, items)) if pool is None else list(pool.map(fn, items))

        def drop() -> None:
            if pool is not None:
                # Every reading thread has stopped before the state dict is put back.
                pool.shutdown(wait=True, cancel_futures=True)
            undo.restore()
            self._unmap()

        try:
            per_file = self._plan_files(plan)
            pool = self._pool(len(per_file))
            firsts, total = self._read_files(plan, planner, per_file, undo, each)
        except Exception as exc:
            drop()
            # This rank's failure must reach the others before they land anything: each of
            # them applies its reads and returns otherwise, and DCP's own exchange after the
            # read step raises only once their state dicts are changed. It joins even when
            # it lost a rank (RanksLostError): the agreement then fails on every rank, which
            # restores them all (staying out would get this rank named as lost too).
            if together:
                self._tell_failure(exc)
            raise
        except BaseException:  # interrupted: the others' agreement fails when this one exits
            drop()
            raise
        try:
            if together:
                self._agree(None)  # raises when another rank failed
            # Every file of every rank is good: what was held back lands, files in parallel
            # on the threads that read them (it restores the state dict itself if a step
            # fails).
            undo.apply(each)
        except BaseException:
            drop()
            raise
        finally:
            self._unmap()
        if pool is not None:
            pool.shutdown(wait=True)
        by_source = self._bytes_by_source(per_file, firsts)
        local = {k: v for k, v in by_source.items() if k != FROM_PEERS}
        # The tier most of this rank's bytes came from; a rank of a replaced node may have no
        # source of its own (peers sent it everything): then the first tier it consulted.
        first = max(local, key=local.get) if local else (
            self._sources[0][0].name if self._sources else None)
        ctx.host.event(Event(EventKind.LOADED, self._checkpoint_id, first,
                               self._rank, time.perf_counter() - started, total,
                               {"bytes_from": by_source}))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _plan_files(self, plan: LoadPlan) -> dict[str, list[ReadItem]]:
        """The read items of ``plan`` per file; the local copies checked again when the plan
        is not the one prepared."""
        storage_data = self._metadata.storage_data
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(storage_data[req.storage_index].relative_path, []).append(req)
        self._fetched = {}
        if self._per_file != per_file:
            # The planner changed the plan after it was prepared (finish_plan): check again.
            # Peers still send what the prepared plan asked for (every rank's transfers were
            # scheduled from it); a file newly needed that no copy here holds good comes from
            # the slower tiers.
            self._unmap()
            self._per_file = per_file
            self._firsts = self._check_local(list(per_file))
        return per_file

    def _read_files(self, plan: LoadPlan, planner: LoadPlanner,
                    per_file: dict[str, list[ReadItem]], undo: LoadUndo, each
                    ) -> tuple[dict[str, tuple[int, list[str], bool]], int]:
        """Read (and check) every file of this rank's load, landing nothing that ``undo``
        cannot take back (see :class:`LoadUndo`): where each file was read from, and the bytes
        read."""
        firsts = dict(self._firsts)
        if self._peers():
            scheduled = plan.storage_data
            self._fetch_missing(firsts, each, scheduled
                                if isinstance(scheduled, PeerFetchPlan) else None)
        for relative, (start, problems, _) in firsts.items():
            if start >= len(self._sources) and relative not in self._fetched:
                self._no_good_copy(relative, problems)
        self._runs = self._blocks_to_read(firsts)
        self._say_plan(firsts)

        def read_file(relative: str) -> int:
            return self._read_one_file(relative, per_file[relative], planner, undo,
                                       *firsts[relative])

        return firsts, sum(each(read_file, list(per_file)))

    def _agree(self, failure: Exception | None) -> None:
        """Collective on the store's io group, once per load of every rank of it: after this
        rank's files are read and checked (``failure``: why they were not) and before anything
        of them lands, learn whether every rank's were. One all-reduce of one integer; only
        when a rank failed, a gather of the failing ranks' messages (plain strings, cut to
        ``_TOLD_CHARS``). A rank that did not fail then raises an error naming the ranks that
        did and what failed there, of their error's class when they agree on one of
        tierstore's (a failing rank raises its own)."""
        ctx = self._services.context
        group = ctx.groups.io
        if not all_reduce_max(int(failure is not None), group):
            return
        told = all_gather_message(
            None if failure is None else list(_told(failure)), group,
            optional(lambda v: as_tuple(v, as_str, as_str)), "a failure's class and message")
        if failure is not None:
            return
        failed = [(r, t) for r, t in enumerate(told) if t is not None]
        ranks = [r for r, _ in failed]
        raise _error_class([name for _, (name, _) in failed])(
            f"checkpoint '{self._checkpoint_id}': the load failed on rank(s) {ranks}, so rank "
            f"{ctx.rank} left its state dict as it was too (a load lands on every rank or on "
            f"none): " + "; ".join(f"rank {r}: {message}" for r, (_, message) in failed))

    def _tell_failure(self, failure: Exception) -> None:
        """A failing rank's part in :meth:`_agree`; it raises its own error afterwards, so a
        failure of the agreement itself (a rank lost meanwhile) is only logged."""
        try:
            self._agree(failure)
        except Exception as exc:  # noqa: BLE001 - this rank's own failure is the one raised
            log.error("rank %d: checkpoint %s: could not tell the other ranks that this rank's "
                      "load failed: %s", self._services.context.rank, self._checkpoint_id,
                      str(exc))

    def _unmap(self) -> None:
        """Close the mapped copies this load has not read (it failed before)."""
        _close_copies(self._mapped)

    def _check_runs(self, relative: str, entry: FileEntry) -> list[tuple[int, int]] | None:
        """The runs of whole blocks of ``relative`` this rank's plan reads, when that is less
        than the file and its entry lists blocks (a rank of a job at another world size reads
        part of a file); None for all of it."""
        if not entry.blocks or self._per_file is None:
            return None
        try:
            runs = entry.block_runs(self._needed_ranges(relative, entry))
        except FileReadError:
            return None  # the read says what is wrong
        return runs if runs_bytes(runs) < entry.size else None

    def _needed_ranges(self, relative: str, entry: FileEntry) -> list[tuple[int, int]]:
        """The byte ranges of ``relative`` this rank's plan reads (FileReadError when the
        metadata does not describe the file)."""
        return needed_ranges(entry, self._per_file[relative], self._metadata.storage_data,
                             self._metadata)

    def _fetch_missing(self, firsts: dict[str, tuple[int, list[str], bool]], each,
                       scheduled: PeerFetchPlan | None) -> None:
        """Collective: fetch from peers the files of this load with no good copy on this
        node's tiers (``scheduled``: the transfers DCP's plan exchange brought; None: the
        ranks exchange what they ask themselves); those no peer sent are looked for on the
        slower tiers after them (their entries in ``firsts`` are updated)."""
        ctx, cid = self._services.context, self._checkpoint_id
        here = self._here()
        chosen, wants = self._wanted
        self._fetched = fetch_from_peers(ctx, cid, self._sources, chosen, wants,
                                         self._holders, scheduled)
        rest = sorted(r for r in firsts if r not in self._fetched and firsts[r][0] >= here)
        if rest:
            self._read_deferred()  # what no node holds comes from the slower tiers
        for relative, (start, problems, checked) in zip(
                rest, each(lambda r: self._first_good_copy(r, here), rest)):
            firsts[relative] = (start, firsts[relative][1] + problems, checked)

    def _blocks_to_read(self, firsts: dict[str, tuple[int, list[str], bool]]
                        ) -> dict[str, list[tuple[int, int]]]:
        """The files to read in part, where this rank's plan needs fewer than all of their
        blocks: a local copy checked in those blocks only (read from its mapped pages), and
        a copy that was not checked beforehand (an object store's: read once, checked on the
        way) whose manifest entry lists blocks. For each, the runs of blocks read (each
        checked against its digest before any of it lands)."""
        if not self._services.context.config.verify_on_load:
            return {}
        out = {}
        for relative, (start, _, checked) in firsts.items():
            if relative in self._fetched or start >= len(self._sources):
                continue
            if checked:
                held = self._mapped[relative].held
                if held is not None:
                    out[relative] = held
                continue
            entry = self._sources[start][1].files.get(relative)
            runs = self._check_runs(relative, entry) if entry is not None else None
            if runs is not None:
                out[relative] = runs
        return out

    def _source_of(self, relative: str, firsts: dict[str, tuple[int, list[str], bool]]
                   ) -> tuple[str, int, Tier | None]:
        """Where this load reads ``relative`` from: the tier's name (:data:`FROM_PEERS` for
        what peers sent), the bytes it reads there, and the tier (None for peers)."""
        fetched = self._fetched.get(relative)
        if fetched is not None:
            return FROM_PEERS, fetched.nbytes, None
        tier, manifest = self._sources[firsts[relative][0]]
        runs = self._runs.get(relative)
        return (tier.name, manifest.files[relative].size if runs is None else runs_bytes(runs),
                tier)

    def _say_plan(self, firsts: dict[str, tuple[int, list[str], bool]]) -> None:
        """The ``restore_planned`` event: where each file of this rank's load comes from,
        before it is read. Fast, as ``tierstore plan`` counts them: peers, a node-local tier
        (a replica included), or the store's first tier."""
        ctx = self._services.context
        tiers = ctx.tiers
        first = tiers.read_order()[0]
        files, sources = [], {}
        for relative in firsts:
            name, nbytes, source = self._source_of(relative, firsts)
            quick = (source is None or source is first or not source.layout.shared
                     or tiers.is_replica(source))
            files.append({"name": relative, "bytes": nbytes, "tier": name, "fast": quick})
            sources[name] = sources.get(name, 0) + nbytes
        ctx.host.event(Event(EventKind.RESTORE_PLANNED, self._checkpoint_id, None, self._rank,
                             nbytes=sum(sources.values()), detail={
                                 "files": files,
                                 "sources": [{"tier": t, "bytes": b} for t, b in sources.items()],
                                 "from_slow_tiers_bytes": sum(f["bytes"] for f in files
                                                              if not f["fast"])}))

    def _bytes_by_source(self, per_file: dict, firsts: dict) -> dict[str, int]:
        """Bytes of this load's files per tier they were read from, peer-fetched files under
        :data:`FROM_PEERS` (the ``loaded`` event's ``bytes_from``)."""
        out: dict[str, int] = {}
        for relative in per_file:
            name, size, _ = self._source_of(relative, firsts)
            out[name] = out.get(name, 0) + size
        return out

    def _first_good_copy(self, relative: str, begin: int = 0, end: int | None = None
                         ) -> tuple[int, list[str], bool]:
        """Where reading ``relative`` starts, looking at sources ``begin`` to ``end``: the
        index of the first source whose local copy matches its manifest entry (checked now,
        from its mapped pages, before anything of the load lands: all of it, or the blocks
        this rank reads), or of the first whose copy cannot be checked without reading it (a
        stream), else ``end``; what was wrong with the sources before it; and whether that
        copy was checked (it is then in ``self._mapped``, and the read takes its bytes from
        the pages that were checked, without hashing them again)."""
        ctx, cid = self._services.context, self._checkpoint_id
        problems: list[str] = []
        end = len(self._sources) if end is None else end
        if relative in self._fetched or not ctx.config.verify_on_load:
            return begin, problems, False
        for n in range(begin, end):
            tier, manifest = self._sources[n]
            entry = manifest.files.get(relative)
            if entry is None:
                problems.append(f"tier '{tier.name}': not in its manifest")
                continue
            copy = hold = None
            try:
                # Shared, until the copy is read: the other ranks of the node (the directory's
                # leader, the rank keeping a replica set) evict it only under an exclusive
                # lock, and recycling its pages would change bytes already checked.
                if not (tier.backend.locks_write and job_wide(ctx, tier)):
                    # (A lease on a job-wide object store would be a write on every rank's
                    # restart; its only evictor in the job, the tier's leader, loads this
                    # checkpoint in this very load and spares it.)
                    hold = tier.backend.lock_directory(cid, exclusive=False)
                f = tier.backend.open_read_sized(f"{cid}/{relative}", entry.size)
                try:
                    copy, why = map_checked(f, entry, tier.keyring,
                                            self._check_runs(relative, entry))
                finally:
                    if copy is None:
                        f.close()
            except (OSError, IntegrityError) as exc:
                why = str(exc)
            if copy is not None:
                copy.hold = hold
            elif hold is not None:
                hold.release()
            if why is None:
                return n, problems, False
            if not why:
                self._mapped[relative] = copy
                return n, problems, True
            problems.append(f"tier '{tier.name}': {why}")
            log.warning("checkpoint %s: %s on tier '%s' is bad (%s)", cid, relative,
                        tier.name, why)
        return end, problems, False

    def _no_good_copy(self, relative: str, problems: list[str]) -> None:
        if not problems:
            problems.append("no tier of this process holds it (node-local tiers hold only their "
                            "node's files: add a shared tier, or a peer tier, to load it here)")
        raise IntegrityError(
            f"checkpoint '{self._checkpoint_id}': no tier has a good copy of {relative}: "
            + "; ".join(problems)
        )

    def _read_one_file(self, relative: str, reqs: list[ReadItem], planner: LoadPlanner,
                       undo: LoadUndo, start: int = 0, problems: list[str] | None = None,
                       checked: bool = False) -> int:
        """Read ``relative`` from the sources from ``start`` on; the copy at ``start`` was
        checked already when ``checked`` (its mapped pages, in ``self._mapped``, are read
        without a second pass: their bytes land in the destinations only at ``undo.apply``)."""
        ctx, cid = self._services.context, self._checkpoint_id
        problems = list(problems or [])
        fetched = self._fetched.get(relative)
        if fetched is not None:  # not on this node: peers sent it, or the blocks read (checked)
            self._read_checked(fetched.data, fetched.held, fetched.entry, reqs, planner, undo)
            return fetched.nbytes
        for n, (tier, manifest) in self._sources_from(start):
            entry = manifest.files.get(relative)
            if entry is None:
                problems.append(f"tier '{tier.name}': not in its manifest")
                continue
            mapped = self._mapped.pop(relative, None) if n == start and checked else None
            try:
                # Inside the try: a fault announced here falls back like a real read error.
                ctx.host.phase(Phase.READ_FILE, cid, tier.name, self._rank, file=relative,
                               size=entry.size)
                if mapped is not None:  # checked from these very pages
                    self._read_checked(mapped.data, mapped.held, entry, reqs, planner, undo)
                    nbytes = mapped.nbytes
                else:
                    with tier.backend.open_read_sized(f"{cid}/{relative}", entry.size) as f:
                        runs = self._runs.get(relative) if n == start else None
                        if runs is not None:  # the blocks this rank reads, each checked first
                            data = read_runs(f, runs, entry.size)
                            bad = check_blocks(tier.keyring, entry, data, runs)
                            if bad:
                                raise FileReadError(bad)
                            self._read_checked(data, runs, entry, reqs, planner, undo)
                            nbytes = runs_bytes(runs)
                        else:
                            nbytes = self._read_whole(f, tier, entry, reqs, planner, undo)
            except (FileReadError, OSError, IntegrityError) as exc:
                # Nothing of a checked copy reached the state dict (its bytes land at
                # undo.apply), and a stream's destinations had their old bytes kept: the next
                # copy may be read into the same tensors.
                if mapped is not None:
                    mapped.close()
                problems.append(f"tier '{tier.name}': {exc}")
                # The message, not the exception: a log handler that keeps records (pytest's,
                # logging.handlers.MemoryHandler) would keep its traceback's frames alive, and
                # with them this load's destination tensors.
                log.warning("checkpoint %s: %s on tier '%s' is bad (%s)", cid, relative,
                            tier.name, str(exc))
                continue
            except BaseException:
                if mapped is not None:
                    mapped.close()
                raise
            if mapped is not None:
                undo.close_after(mapped)  # the bytes held back until the load is good are here
            if n > 0:
                ctx.host.event(Event(EventKind.FELL_BACK, cid, tier.name, self._rank,
                                       detail={"file": relative, "problems": list(problems)}))
                log.warning("checkpoint %s: read %s from tier '%s' after: %s", cid, relative,
                            tier.name, "; ".join(problems))
            return nbytes
        self._no_good_copy(relative, problems)

    def _read_checked(self, data, held: list[tuple[int, int]] | None, entry: FileEntry,
                      reqs: list[ReadItem], planner: LoadPlanner, undo: LoadUndo) -> None:
        """Read ``reqs`` from bytes in memory already checked against ``entry`` (all of the
        file, or the ranges ``held``): nothing reaches their destinations before
        ``undo.apply`` (which copies them from ``data``, kept until then), so no old bytes
        are kept."""
        read_items(BufferReader(data, held), entry, reqs, self._metadata.storage_data,
                   self._metadata, planner, None,
                   trusted=self._services.context.config.trusted_pickles, undo=undo)

    def _read_whole(self, f, tier: Tier, entry: FileEntry, reqs: list[ReadItem],
                    planner: LoadPlanner, undo: LoadUndo) -> int:
        """Read ``reqs`` from the open copy ``f``, not checked beforehand (a stream, or any
        copy when loads are not verified), front to back, checking all of it against
        ``entry`` on the way when loads are verified."""
        ctx = self._services.context
        verify = tier.keyring.hasher_for(entry.checksum) if ctx.config.verify_on_load else None
        return read_items(f, entry, reqs, self._metadata.storage_data, self._metadata, planner,
                          verify, trusted=ctx.config.trusted_pickles, undo=undo)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return is_valid_checkpoint_id(checkpoint_id)


def _merged_files(listings) -> dict[str, FileEntry | None]:
    """One rank's servable files over its sources: an entry wins over a name alone."""
    out: dict[str, FileEntry | None] = {}
    for files in listings:
        for rel, entry in files.items():
            if out.get(rel) is None:
                out[rel] = entry
    return out


def _close_copies(mapped: dict[str, MappedCopy]) -> None:
    """Close (and forget) every copy in ``mapped``."""
    while mapped:
        mapped.popitem()[1].close()


def _matches(keyring: Keyring, raw: bytes, entry: FileEntry) -> bool:
    """Whether ``raw`` has the size and digest (keyed or not) ``entry`` records."""
    return check_blocks(keyring, entry, raw, None) == ""


def _status_from(value) -> tuple:
    """What one rank said it holds as a load starts (see ``_share_metadata``), from the plain
    fields it sent: ``(token, {token: ranks}, saved world size, [Servable])``."""
    def ranks(v) -> set[int]:
        return set(as_list(v, lambda r: as_int(r, 0)))

    return as_tuple(value, optional(as_str), lambda v: as_dict(v, as_str, ranks),
                    optional(lambda w: as_int(w, 1)),
                    lambda v: as_list(v, servable_from_fields))


def _told(failure: Exception) -> tuple[str, str]:
    """What a failing rank tells the others of its failure (plain strings): its class's name
    and its message, cut to ``_TOLD_CHARS``."""
    message = str(failure) or type(failure).__name__
    if len(message) > _TOLD_CHARS:
        message = message[:_TOLD_CHARS] + " [...]"
    return type(failure).__name__, message


def _error_class(names: list[str]) -> type[TierstoreError]:
    """The class of the error raised on the ranks whose own load was good: the failing ranks'
    when they all raised the same one of tierstore's errors (a checksum mismatch is an
    IntegrityError everywhere), else :class:`TierstoreError`."""
    found = {getattr(errors, n, None) if n in errors.__all__ else None for n in names}
    cls = found.pop() if len(found) == 1 else None
    return cls if isinstance(cls, type) and issubclass(cls, TierstoreError) else TierstoreError
