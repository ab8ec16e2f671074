"""Loading files this node does not hold from the ranks that do, before DCP reads them.

With node-local tiers (and peer replicas) a rank may need files that only other nodes hold: its
own shards after its node was replaced, or another rank's file that DCP's plan sends its way.
When the load starts (the reader's ``reset``, in the gather it makes anyway) every rank tells the
others the files it can serve (:func:`servable_here`). Once its plan is known, each rank checks
its local copies and lists the files it needs and has no good copy of here, with the byte ranges
of them its plan reads (a rank of a job at another world size reads part of a file), as whole
blocks of the file (each block's digest is in the manifest): :func:`wanted_from_peers`. That
list rides in the rank's DCP load plan to the coordinator, which schedules every transfer
(:func:`schedule_plans`: the blocks of a file spread over every rank holding it) and sends each
rank its part with its global plan, so a load asks its peers without a collective of its own.
The bytes move over torch.distributed (tierstore.transport.transfer) into buffers whose other
pages are never touched. Every received block (or a whole file without blocks) is checked
against its digest before the load reads it; what no peer has, or sent bad, is left to the
slower (shared) tiers, file by file, as usual.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from tierstore.engine.context import StoreContext
from tierstore.errors import IntegrityError, RanksLostError
from tierstore.events import Event, EventKind, Phase
from tierstore.format.item_io import FileReadError, check_blocks, runs_bytes
from tierstore.format.manifest import METADATA_NAME, FileEntry, Manifest
from tierstore.tiers.tier import Tier
from tierstore.format.entry_fields import entry_fields, entry_from_fields
from tierstore.transport.collectives import all_gather_message
from tierstore.transport.ends import BufferTarget
from tierstore.transport.shapes import as_dict, as_int, as_list, as_str, as_tuple, optional
from tierstore.transport.transfer import Transfer, open_to_send, run_transfers

__all__ = ["fetch_from_peers", "FetchedFile", "Servable", "servable_here", "servable_fields",
           "servable_from_fields", "local_sources",
           "node_tiers", "held_here", "PeerFetchPlan", "wanted_from_peers", "schedule_fetches",
           "schedule_plans"]

log = logging.getLogger("tierstore.dcp.peer_fetch")


def node_tiers(ctx: StoreContext) -> list[Tier]:
    """The tiers that count as "here", a prefix of the read order: every tier up to the last
    node-local one (a shared tier after it is a slower tier, read only when no peer has the
    file)."""
    order = ctx.tiers.read_order()
    last_local = max((i for i, t in enumerate(order)
                      if not t.layout.shared or ctx.tiers.is_replica(t)), default=-1)
    return order[:last_local + 1]


def local_sources(ctx: StoreContext, sources: list[tuple[Tier, Manifest]]
                  ) -> list[tuple[Tier, Manifest]]:
    """The sources that count as "here" (on :func:`node_tiers`), a prefix of ``sources``
    (which are in read order)."""
    here = node_tiers(ctx)
    return [(t, m) for t, m in sources if any(t is h for h in here)]


def held_here(cid: str, rel: str, local: list[tuple[Tier, Manifest]]
              ) -> tuple[Tier, FileEntry] | None:
    """The first local tier holding ``rel`` at its manifest's size (not checked further), and
    that manifest's entry."""
    for tier, manifest in local:
        entry = manifest.files.get(rel)
        if entry is not None and tier.stored_size(f"{cid}/{rel}") == entry.size:
            return tier, entry
    return None


@dataclass(frozen=True)
class FetchedFile:
    """A file (or the blocks of it a load needs) that peers sent, every byte checked."""

    entry: FileEntry
    #: the file's bytes, at their offsets (only those of ``held`` when fetched in part)
    data: memoryview
    #: the byte ranges that arrived, or None for the whole file
    held: list[tuple[int, int]] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes that arrived."""
        return len(self.data) if self.held is None else runs_bytes(self.held)


@dataclass(frozen=True)
class Servable:
    """What one source of a rank could serve to peers, as gathered when a load starts: the
    save it belongs to (its token, codecs and ``.metadata`` entry, so that every rank keeps
    only the copies its load may mix, as the reader filters its own sources) and its files
    held at their manifest's size, with their entries; None for a file whose entry the lowest
    of the ranks sharing the directory sends (:func:`servable_here`)."""

    save_token: str | None
    codecs: tuple[str, ...]
    metadata: FileEntry | None
    files: dict[str, FileEntry | None]


def servable_here(ctx: StoreContext, cid: str, sources: list[tuple[Tier, Manifest]]
                  ) -> list[Servable]:
    """What this rank can serve of ``cid`` from its node-local sources, with the entries of
    their manifests (a receiver may have none: DCP writes a replicated item once, in one
    rank's file, listed only in that part; a rank of a new node has no manifest at all).

    Every rank gathers what every rank serves, and an entry is large (a digest per block, a
    span per item: about 12 KiB for a file of 1 GiB): only the lowest of the ranks sharing a
    directory (a node's ranks) sends the entries of its files; the others name the files they
    hold there, the same files. What each rank gathers then grows with the nodes, not with
    the ranks per node."""
    out = []
    for tier, manifest in local_sources(ctx, sources):
        full = ctx.rank == min(_sharers(ctx, tier))
        files = {rel: entry if full else None for rel, entry in manifest.files.items()
                 if tier.stored_size(f"{cid}/{rel}") == entry.size}
        if files:
            out.append(Servable(manifest.save_token, tuple(manifest.codecs),
                                manifest.files.get(METADATA_NAME), files))
    return out


def servable_fields(servable: Servable) -> list:
    """``servable`` as plain data, to travel in a message (never a pickle):
    ``[save token, codecs, .metadata's entry, {file: entry or None}]``, entries as their
    fields (:mod:`tierstore.format.entry_fields`)."""
    return [servable.save_token, list(servable.codecs),
            None if servable.metadata is None else entry_fields(servable.metadata),
            {rel: None if e is None else entry_fields(e) for rel, e in servable.files.items()}]


def servable_from_fields(value) -> Servable:
    """The :class:`Servable` :func:`servable_fields` made ``value`` of; ``TypeError`` or
    ``ValueError`` naming what is wrong when it is not such a list."""
    token, codecs, metadata, files = as_tuple(value, optional(as_str),
                                              lambda v: as_list(v, as_str), lambda v: v,
                                              lambda v: as_dict(v, as_str, lambda e: e))
    return Servable(token, tuple(codecs),
                    None if metadata is None else entry_from_fields(metadata, METADATA_NAME),
                    {rel: None if e is None else entry_from_fields(e, rel)
                     for rel, e in files.items()})


Runs = list[tuple[int, int]]


def _runs_from(value) -> dict[str, Runs]:
    """What one rank asks of its peers (file -> byte ranges), from the plain fields it sent."""
    return as_dict(value, as_str, lambda runs: [
        as_tuple(r, lambda v: as_int(v, 0), lambda v: as_int(v, 0)) for r in as_list(runs, list)])


@dataclass(frozen=True)
class PeerFetchPlan:
    """What one rank's load asks of its peers, carried in its DCP ``LoadPlan.storage_data``
    through the plan exchange DCP makes anyway (no collective of its own): ``asked`` (file ->
    byte ranges, as whole blocks) and ``rank`` (the rank in the store's group) on the way to the
    coordinator; on the way back, the transfers this rank takes part in (``scheduled``), and
    whether any rank's load moves anything (``busy``)."""

    rank: int
    asked: dict[str, Runs]
    transfers: tuple[Transfer, ...] = ()
    busy: bool = False
    scheduled: bool = False


def wanted_from_peers(sources: list[tuple[Tier, Manifest]], missing: set[str],
                      holders: list[dict[str, FileEntry | None]],
                      ranges_for: Callable[[str, FileEntry], Runs | None]
                      ) -> tuple[dict[str, FileEntry], dict[str, Runs]]:
    """Of the files ``missing`` (those this rank's load needs and has no good copy of here),
    those some rank holds (``holders[r]``: what rank ``r`` serves, gathered when the load
    started): the entry this rank goes by for each (its own manifest's, else a holder's: the
    sources all belong to one save), and the byte ranges it asks for, as runs of whole blocks
    (``ranges_for(rel, entry)``: the ranges its plan reads, None for all of the file; a file
    whose entry lists no blocks moves whole)."""
    own = {rel: m.files[rel] for _, m in sources for rel in m.files}
    chosen: dict[str, FileEntry] = {}
    wants: dict[str, Runs] = {}
    for rel in sorted(missing):
        entry = own.get(rel) or entry_from(holders, rel)
        if entry is None:
            continue  # no rank holds it: the slower tiers, or a clear error, later
        chosen[rel] = entry
        try:
            ranges = ranges_for(rel, entry)
        except FileReadError:  # the metadata does not describe it: the read will say so
            ranges = None
        runs = entry.block_runs(ranges) if ranges is not None and entry.blocks else []
        wants[rel] = runs or [(0, entry.size)]
    return chosen, wants


def schedule_fetches(asked: list[dict[str, Runs]], holders: list[dict[str, FileEntry | None]]
                     ) -> list[Transfer]:
    """Every transfer of a load, from what each rank asked (``asked[r]``) and what each holds:
    the blocks of a file are spread over the ranks holding it, the same way wherever this is
    computed."""
    schedule: list[Transfer] = []
    for dst, runs_of in enumerate(asked):
        for rel, runs in sorted(runs_of.items()):
            have = [h for h, has in enumerate(holders) if h != dst and rel in has]
            for start, end in runs if have else ():
                src = have[(dst + len(schedule)) % len(have)]
                schedule.append(Transfer(src, dst, rel, end - start, start))
    return schedule


def schedule_plans(plans: list[PeerFetchPlan], holders: list[dict[str, FileEntry | None]]
                   ) -> list[PeerFetchPlan]:
    """The coordinator's part: each rank's plan with the transfers it takes part in. Plans
    that do not come from every rank of the store's group, once each (DCP's group is another
    one), are returned unscheduled: the ranks then exchange what they ask themselves."""
    by_rank = {p.rank: p for p in plans}
    if sorted(by_rank) != list(range(len(holders))) or len(plans) != len(holders):
        return plans
    schedule = schedule_fetches([by_rank[r].asked for r in range(len(holders))], holders)
    busy = bool(schedule)
    return [PeerFetchPlan(p.rank, p.asked,
                          tuple(t for t in schedule if p.rank in (t.src, t.dst)), busy, True)
            for p in plans]


def _sharers(ctx: StoreContext, tier: Tier) -> tuple[int, ...]:
    """The ranks that see ``tier``'s directory (a replica set is in its peer tier's)."""
    tiers = ctx.tiers
    if tiers.peer is not None and tiers.is_replica(tier):
        return tiers.peer.layout.part_ranks
    return tier.layout.part_ranks


def entry_from(holders: list[dict[str, FileEntry | None]], rel: str) -> FileEntry | None:
    """The entry of ``rel`` that some holder sent (see :func:`servable_here`), if any."""
    return next((has[rel] for has in holders if has.get(rel) is not None), None)


def fetch_from_peers(ctx: StoreContext, cid: str, sources: list[tuple[Tier, Manifest]],
                     chosen: dict[str, FileEntry], wants: dict[str, Runs],
                     holders: list[dict[str, FileEntry | None]],
                     plan: PeerFetchPlan | None = None) -> dict[str, FetchedFile]:
    """Collective on the store's io group: fetch the byte ranges ``wants`` of the files
    ``chosen`` (see :func:`wanted_from_peers`) from ranks that hold them. With ``plan``
    (scheduled in DCP's plan exchange) the transfers are known; without, the ranks gather
    what each asks first (one more gather). Returns relative path -> FetchedFile, every block
    (or whole file) checked against its digest."""
    rank, group = ctx.rank, ctx.groups.io
    if plan is None or not plan.scheduled:
        asked = all_gather_message({rel: [list(r) for r in runs] for rel, runs in wants.items()},
                                   group, _runs_from, "the byte ranges of files a rank asks for")
        schedule = schedule_fetches(asked, holders)
        mine = [t for t in schedule if rank in (t.src, t.dst)]
        busy = bool(schedule)
    else:
        mine, busy = list(plan.transfers), plan.busy
    if not busy:
        return {}
    ctx.host.phase(Phase.PEER_FETCH, cid, None, rank)
    local = local_sources(ctx, sources)
    buffers: dict[str, BufferTarget] = {}

    def open_source(t: Transfer):
        found = held_here(cid, t.key, local)
        if found is None:
            raise FileNotFoundError(f"{cid}/{t.key} vanished from this node while a peer "
                                    f"needed it")
        return open_to_send(found[0].backend, f"{cid}/{t.key}", t.offset + t.size)

    def open_target(t: Transfer) -> BufferTarget:
        if t.key not in buffers:
            buffers[t.key] = BufferTarget(chosen[t.key].size)
        return buffers[t.key]

    started = time.perf_counter()
    try:
        run_transfers(group, rank, mine, open_source, open_target, lambda *_: None,
                      ctx.copy_chunk_bytes)
    except RanksLostError as exc:
        # Logged: DCP's next collective fails on the same lost rank, and its error replaces
        # this one, which names the rank.
        log.error("rank %d: checkpoint %s: the files peers were to send did not arrive: %s",
                  rank, cid, exc)
        raise
    seconds = time.perf_counter() - started
    senders: dict[str, list[int]] = {}
    for t in mine:
        if t.dst == rank:
            senders.setdefault(t.key, []).append(t.src)
    out: dict[str, FetchedFile] = {}
    for rel, srcs in senders.items():
        entry, runs = chosen[rel], wants[rel]
        data = buffers[rel].data if rel in buffers else memoryview(b"")
        whole = runs == [(0, entry.size)]
        try:
            bad = check_blocks(ctx.config.keyring, entry, data, None if whole else runs)
        except IntegrityError as exc:  # keyed with a key this store lacks
            bad = str(exc)
        if bad:
            log.warning("checkpoint %s: the copy of %s from rank(s) %s does not match its "
                        "manifest (%s); trying slower tiers", cid, rel, sorted(set(srcs)), bad)
            continue
        fetched = out[rel] = FetchedFile(entry, data, None if whole else runs)
        ctx.host.event(Event(EventKind.PEER_FETCHED, cid, None, rank, seconds, fetched.nbytes,
                             {"file": rel, "from": srcs[0], "senders": sorted(set(srcs)),
                              "ranges": [list(r) for r in runs], "size": entry.size}))
        log.info("checkpoint %s: fetched %s (%d of its %d bytes) from rank(s) %s", cid, rel,
                 fetched.nbytes, entry.size, sorted(set(srcs)))
    return out
