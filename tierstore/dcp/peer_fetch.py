"""Loading files this node does not hold from the ranks that do, before DCP reads them.

With node-local tiers (and peer replicas) a rank may need files that only other nodes hold: its
own shards after its node was replaced, or another rank's file that DCP's plan sends its way.
Every rank lists the files its plan needs that it has no good copy of here, and the files it can
serve; all ranks derive the same schedule from that, and the files move over torch.distributed
(tierstore.transport.transfer). A received file is checked against its manifest checksum; what
no peer has
is left to the slower (shared) tiers, file by file, as usual.
"""

from __future__ import annotations

import logging
import time

from tierstore.engine.context import StoreContext
from tierstore.errors import RanksLostError
from tierstore.events import Event, EventKind, Phase
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.tiers.tier import Tier
from tierstore.transport.collectives import all_gather_object
from tierstore.transport.ends import BufferTarget
from tierstore.transport.transfer import Transfer, open_to_send, run_transfers

__all__ = ["fetch_from_peers", "local_sources", "held_here"]

log = logging.getLogger("tierstore.dcp.peer_fetch")


def local_sources(ctx: StoreContext, sources: list[tuple[Tier, Manifest]]
                  ) -> list[tuple[Tier, Manifest]]:
    """The sources that count as "here", a prefix of ``sources`` (which are in read order):
    every tier up to the last node-local one (a shared tier after it is a slower tier, read
    only when no peer has the file)."""
    order = ctx.tiers.read_order()
    last_local = max((i for i, t in enumerate(order)
                      if not t.layout.shared or ctx.tiers.is_replica(t)), default=-1)
    return [(t, m) for t, m in sources if order.index(t) <= last_local]


def held_here(cid: str, rel: str, local: list[tuple[Tier, Manifest]]
              ) -> tuple[Tier, FileEntry] | None:
    """The first local tier holding ``rel`` at its manifest's size (not checked further), and
    that manifest's entry."""
    for tier, manifest in local:
        entry = manifest.files.get(rel)
        if entry is not None and tier.stored_size(f"{cid}/{rel}") == entry.size:
            return tier, entry
    return None


def fetch_from_peers(ctx: StoreContext, cid: str, sources: list[tuple[Tier, Manifest]],
                     missing: set[str]) -> dict[str, tuple[FileEntry, bytes]]:
    """Collective on the store's io group: fetch the files of ``missing`` (those this rank
    needs and has no good copy of here: the reader has checked its local copies) from ranks
    that hold them. Returns relative path -> (entry, bytes), every one checked against its
    manifest entry."""
    rank, group = ctx.rank, ctx.groups.io
    local = local_sources(ctx, sources)
    missing = sorted(missing)
    # What this rank can serve, with the entry of its own manifest: the receiver may have none
    # (DCP writes a replicated item once, in one rank's file, listed only in that part).
    servable: dict[str, FileEntry] = {}
    for tier, manifest in local:
        for rel, entry in manifest.files.items():
            if rel not in servable and tier.stored_size(f"{cid}/{rel}") == entry.size:
                servable[rel] = entry
    views = all_gather_object((missing, servable), group)
    if not any(m for m, _ in views):
        return {}
    ctx.host.phase(Phase.PEER_FETCH, cid, None, rank)
    schedule: list[Transfer] = []
    for dst, (wants, _) in enumerate(views):
        for rel in wants:
            holders = [h for h, (_, has) in enumerate(views) if h != dst and rel in has]
            if holders:
                # Spread the load over the holders, the same way on every rank.
                src = holders[(dst + len(schedule)) % len(holders)]
                schedule.append(Transfer(src, dst, rel, views[src][1][rel].size))
    mine = [t for t in schedule if rank in (t.src, t.dst)]
    entries = {rel: m.files[rel] for _, m in sources for rel in m.files}
    buffers: dict[str, BufferTarget] = {}

    def open_source(t: Transfer):
        found = held_here(cid, t.key, local)
        if found is None:
            raise FileNotFoundError(f"{cid}/{t.key} vanished from this node while a peer "
                                    f"needed it")
        return open_to_send(found[0].backend, f"{cid}/{t.key}", t.size)

    def open_target(t: Transfer) -> BufferTarget:
        target = buffers[t.key] = BufferTarget(t.size)
        return target

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
    out: dict[str, tuple[FileEntry, bytes]] = {}
    for t in mine:
        if t.dst != rank:
            continue
        entry = entries.get(t.key) or views[t.src][1][t.key]  # ours, else the sender's
        data = buffers[t.key].data if t.key in buffers else bytearray()
        if (entry is None or len(data) != entry.size
                or ctx.config.keyring.digest(data, like=entry.checksum) != entry.checksum):
            log.warning("checkpoint %s: the copy of %s from rank %d does not match its "
                        "manifest; trying slower tiers", cid, t.key, t.src)
            continue
        out[t.key] = (entry, data)
        ctx.host.event(Event(EventKind.PEER_FETCHED, cid, None, rank, seconds, len(data),
                               {"file": t.key, "from": t.src}))
        log.info("checkpoint %s: fetched %s (%d bytes) from rank %d", cid, t.key, len(data),
                 t.src)
    return out
