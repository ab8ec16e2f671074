"""Where a restore at a given shape would read each file of a checkpoint from (``tierstore plan``,
``Store.plan``): before a job restarts on N ranks, R per node, an operator sees how much of the
checkpoint its nodes still hold and how much comes from the slower, shared tiers.

The plan looks at the tiers as the new job would: each node-local tier (a path with ``{node}``,
``{rank}`` or ``{local_rank}``) once per directory of the new job's ranks, replica sets in a peer
tier's directory included, and each shared tier once. A file is planned from the first node of
the new job that holds it whole (its own copy or a replica: the load reads it there, or a peer
sends it), else from the first shared tier that does, else it is missing. The slower tiers are
the shared ones after the store's first tier (a single-node store's first tier is its fast
one). Only copies of one
save count (the save token of the first copy holding DCP's ``.metadata``), as a load does.
Sizes are checked, checksums are not (the load checks them); nothing is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierstore.config.validate import StoreConfig
from tierstore.errors import LIST_HINT, CheckpointNotFound
from tierstore.format.manifest import Manifest
from tierstore.plugin.host import PluginHost
from tierstore.tiers.build import parity_tier, replica_tier, standalone_tier
from tierstore.tiers.parity_sets import MEMBERS_FILE, parity_of, read_members, recoverable
from tierstore.tiers.tier import Tier
from tierstore.transport.collectives import RankContext

__all__ = ["PlannedFile", "RestorePlan", "restore_plan"]


@dataclass(frozen=True)
class PlannedFile:
    """One file of the checkpoint and where the restore would read it."""

    name: str
    size: int
    #: the rank of the saving job that wrote it (None: DCP's .metadata)
    rank: int | None
    #: the tier it comes from (a replica set is ``<peer tier>:rank-<src>``); None: missing
    tier: str | None
    #: the node of the new job holding it; None for a shared tier (or missing)
    node: int | None
    #: read from a fast tier: a node's own (or a replica it holds), or the store's first tier
    fast: bool = False


@dataclass(frozen=True)
class RestorePlan:
    """Where a restore of ``checkpoint_id`` by ``world_size`` ranks, ``ranks_per_node`` per
    node, would read each file (plain data)."""

    checkpoint_id: str
    world_size: int
    ranks_per_node: int
    saved_world_size: int
    files: list[PlannedFile] = field(default_factory=list)

    @property
    def sources(self) -> list[dict[str, Any]]:
        """Bytes per source tier, in the order first met (node-local ones first)."""
        out: dict[str, int] = {}
        for f in self.files:
            if f.tier is not None:
                out[f.tier] = out.get(f.tier, 0) + f.size
        return [{"tier": t, "bytes": b} for t, b in out.items()]

    @property
    def from_slow_tiers_bytes(self) -> int:
        """Bytes no node of the new job holds, read from the slower tiers (shared ones after
        the store's first tier)."""
        return sum(f.size for f in self.files if f.tier is not None and not f.fast)

    @property
    def missing(self) -> list[str]:
        """Files no node and no tier holds: the restore would fail naming them."""
        return [f.name for f in self.files if f.tier is None]

    @property
    def total_bytes(self) -> int:
        """The checkpoint's bytes."""
        return sum(f.size for f in self.files)

    def to_json(self) -> dict[str, Any]:
        """The document ``tierstore plan --json`` prints."""
        return {"id": self.checkpoint_id, "world_size": self.world_size,
                "ranks_per_node": self.ranks_per_node,
                "saved_world_size": self.saved_world_size, "sources": self.sources,
                "from_slow_tiers_bytes": self.from_slow_tiers_bytes,
                "total_bytes": self.total_bytes, "missing": self.missing,
                "files": [{"name": f.name, "size": f.size, "rank": f.rank, "tier": f.tier,
                           "node": f.node, "fast": f.fast} for f in self.files]}


@dataclass(frozen=True)
class _Copy:
    """One copy of (part of) the checkpoint: where, on which node of the new job, its manifest
    and the files present with their recorded size."""

    tier: Tier
    node: int | None
    manifest: Manifest
    present: set[str]


def restore_plan(config: StoreConfig, host: PluginHost, checkpoint_id: str,
                 world_size: int | None = None, ranks_per_node: int | None = None
                 ) -> RestorePlan:
    """The plan of a restore of ``checkpoint_id`` by ``world_size`` ranks, ``ranks_per_node``
    per node (both default to the shape of the save). CheckpointNotFound when no tier holds
    any of it; ValueError for a shape that is not one."""
    if (world_size is not None and world_size < 1) or \
            (ranks_per_node is not None and ranks_per_node < 1):
        raise ValueError(f"a job of {world_size} rank(s), {ranks_per_node} per node, is not one")
    copies = _copies(config, host, checkpoint_id,
                     _contexts(world_size or 1, ranks_per_node or world_size or 1))
    if not copies:
        raise CheckpointNotFound(
            f"checkpoint '{checkpoint_id}' is on no tier ({', '.join(t.name for t in config.tiers)})"
            f"; {LIST_HINT}")
    coordinator = next((c for c in copies if c.manifest.has_metadata), copies[0])
    saved = coordinator.manifest.world_size
    # The save's shape: its node-local manifests say how many parts (nodes) it had.
    saved_per_node = max(1, saved // max(c.manifest.parts for c in copies))
    world_size = world_size or saved
    ranks_per_node = ranks_per_node or min(saved_per_node, world_size)
    # The new job's directories, and the save's (a node the new job lacks still says what
    # the save wrote there).
    copies = _copies(config, host, checkpoint_id, _contexts(world_size, ranks_per_node)
                     + _contexts(saved, saved_per_node))
    token = coordinator.manifest.save_token
    copies = [c for c in copies if c.manifest.save_token == token]
    # What the save wrote, from every copy there is (nodes beyond the new job's included:
    # they say what the job will miss); holders only among the new job's nodes and shared tiers.
    entries = {name: entry for c in copies for name, entry in c.manifest.files.items()}
    usable = [c for c in copies if c.node is None or c.node < _nodes(world_size, ranks_per_node)]
    files = []
    for name in sorted(entries, key=lambda n: (entries[n].rank is None, entries[n].rank, n)):
        entry = entries[name]
        held = next((c for c in usable if name in c.present and c.node is not None), None) \
            or next((c for c in usable if name in c.present), None)
        fast = held is not None and (held.node is not None
                                     or held.tier.config.name == config.tiers[0].name)
        files.append(PlannedFile(name, entry.size, entry.rank,
                                 held.tier.name if held else None, held.node if held else None,
                                 fast))
    files = _rebuilt_from_parity(config, host, checkpoint_id, token, files, usable,
                                 world_size, ranks_per_node, saved)
    # Ranks of the save whose files no copy lists (their node lost, with every replica).
    listed = {r for c in copies for r in c.manifest.ranks} | {
        f.rank for f in files if f.tier is not None and f.rank is not None}
    files += [PlannedFile(f"(the files of rank {r})", 0, r, None, None)
              for r in range(saved) if r not in listed]
    return RestorePlan(checkpoint_id, world_size, ranks_per_node, saved, files)


def _rebuilt_from_parity(config: StoreConfig, host: PluginHost, cid: str, token: str,
                         files: list[PlannedFile], usable: list[_Copy], world_size: int,
                         ranks_per_node: int, saved: int) -> list[PlannedFile]:
    """``files`` with those of the ranks a load would rebuild from their parity sets
    (tierstore.engine.parity) planned from ``<peer tier>:rebuilt-from-parity`` on the lost
    rank's node: no copy holds them, and every other member of the set holds its own files and
    its parity of this save on its node in the new job."""
    node_of = {r: r // ranks_per_node for r in range(world_size)}
    covered = {r for c in usable for r in c.manifest.ranks
                if all(n in c.present for n, e in c.manifest.files.items() if e.rank == r)}
    self_held = {r for c in usable if c.node is not None for r in c.manifest.ranks
                 if node_of.get(r) == c.node
                 and all(n in c.present for n, e in c.manifest.files.items() if e.rank == r)}
    parity, described, peer_name = {}, {}, None
    for tc in config.tiers:
        if not hasattr(host.lookup("backend", tc.backend).factory, "parity_backend"):
            continue
        peer_name = tc.name
        contexts = _contexts(world_size, ranks_per_node)
        for holder in range(min(world_size, saved)):
            kept = parity_tier(standalone_tier(tc, config, host, contexts[holder]), holder)
            held = parity_of(kept, cid)
            if held is not None and held[0] == token:
                parity[holder] = held[1]
                described.setdefault(held[1], kept)
    lost = {r: m for r, m in recoverable(covered, parity, self_held).items()
            if max(m) < world_size}
    if not lost:
        return files
    rebuilt = []
    for rank, members in sorted(lost.items()):
        found = read_members(described[members].backend.read_bytes(f"{cid}/{MEMBERS_FILE}"))
        rebuilt += [PlannedFile(name, entry.size, entry.rank,
                                f"{peer_name}:rebuilt-from-parity", node_of[rank], True)
                    for name, entry in found.files(rank)]
    names = {f.name for f in rebuilt}
    return [f for f in files if f.name not in names and f.rank not in lost] + rebuilt


def _nodes(world_size: int, ranks_per_node: int) -> int:
    """Nodes of a job of ``world_size`` ranks, ``ranks_per_node`` per node."""
    return -(-world_size // ranks_per_node)


def _contexts(world: int, per_node: int) -> list[RankContext]:
    """Every rank of a job of ``world`` ranks, ``per_node`` per node."""
    return [RankContext(rank=r, local_rank=r % per_node, node=r // per_node, world_size=world,
                        local_world_size=per_node)
            for r in range(world)]


def _copies(config: StoreConfig, host: PluginHost, cid: str,
            contexts: list[RankContext]) -> list[_Copy]:
    """Every copy of ``cid`` the ranks of ``contexts`` see: each node-local tier once per
    directory (the node of the first rank seeing it; with the replica sets there), each shared
    tier once; tier order, then rank order."""
    out: list[_Copy] = []
    for tc in config.tiers:
        local = _node_local(tc, config, host)
        by_root: dict[str, tuple[Tier, int | None]] = {}
        for ctx in contexts if local else contexts[:1]:
            tier = standalone_tier(tc, config, host, ctx)
            by_root.setdefault(tier.backend.describe(), (tier, ctx.node if local else None))
        for tier, node in by_root.values():
            for t in [tier] + [replica_tier(tier, src, holder)
                               for src, holder in tier.backend.replica_sets()]:
                manifest = t.read_manifest(cid)
                if manifest is not None:
                    out.append(_Copy(t, node, manifest, t.present_files(cid, manifest)))
    return out


def _node_local(tc: Any, config: StoreConfig, host: PluginHost) -> bool:
    """Whether ``tc``'s location differs between ranks of different nodes (its options with
    the placeholders filled in for two ranks; no backend is built)."""
    options = host.lookup("backend", tc.backend).options
    return tc.expanded_options(RankContext(rank=0, node=0, world_size=2), options) != \
        tc.expanded_options(RankContext(rank=1, local_rank=1, node=1, world_size=2), options)
