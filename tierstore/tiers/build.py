"""Building the tiers of a store from its validated config: one backend and commit protocol per
``[[tier]]``, each tier's layout across the job, the checks that drains can fill every tier, and
the peer tier's replication strategy with the replica tiers this rank keeps."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from tierstore.config.validate import AUTO, StoreConfig, TierConfig, check_tier_locations
from tierstore.errors import ConfigError, PluginError
from tierstore.plugin.host import PluginHost
from tierstore.plugin.options import validate_table
from tierstore.plugin.retry import GaveUp, cannot_connect, foreground
from tierstore.tiers.layout import TierLayout, compute_layouts
from tierstore.tiers.schedule import AutoSchedule
from tierstore.tiers.chunked import ChunkedBackend
from tierstore.tiers.tier import Tier
from tierstore.tiers.tierset import TierSet
from tierstore.transport.collectives import RankContext, all_gather_message
from tierstore.transport.shapes import as_list, as_str, as_tuple, optional

__all__ = ["build_tiers", "parity_tier", "replica_tier", "standalone_tier"]

log = logging.getLogger("tierstore")


def build_tiers(config: StoreConfig, host: PluginHost, ctx: RankContext, group: Any,
                unreachable: dict[str, str], tolerate_unreachable: bool = False) -> TierSet:
    """Every tier of ``config`` for this process. Collective under torch.distributed (the
    layouts are agreed on ``group``, and so is what the checks of the tiers found). Raises
    ConfigError / PluginError naming the tier, on every rank alike.

    Each location is checked once, by the lowest rank that sees it (:func:`check_tiers`): an
    object store shared by the job is asked by one rank, not by every rank at every restart.
    A tier whose storage cannot be connected to right now (a dead server: its backend's
    ``check_reachable`` raised a connection failure) is built anyway and noted in
    ``unreachable`` with why, as if it had died after the open: a job restarting during an
    outage opens its store and restores from the other tiers. ``tolerate_unreachable``
    (operator tools): any other problem of a tier is noted there too, instead of failing."""
    check_tier_locations(config, host, ctx)
    tiers = [_build_tier(tc, config, host, ctx) for tc in config.tiers]
    for tier, layout in zip(tiers, compute_layouts(tiers, ctx, group, config.source)):
        tier.layout = layout
    check_tiers(tiers, config, host, ctx, group, unreachable, tolerate_unreachable)
    _check_drain_paths(tiers, config)
    peer, strategy, replica_tiers, found = _replication(tiers, config, host, ctx,
                                                        quiet=tolerate_unreachable)
    parity = None
    if strategy is not None and strategy.parity_set(ctx.rank, ctx.world_size) is not None:
        # Parity instead of replicas: this rank's share of its set's parity, and the replica
        # set a load rebuilds this rank's files into when its node lost them.
        parity = parity_tier(peer, ctx.rank)
        if not any(t.backend.root == peer.backend.replica_backend(ctx.rank, ctx.rank).root
                   for t in found):
            found = (*found, replica_tier(peer, ctx.rank, ctx.rank))
    return TierSet(tuple(tiers), peer, strategy, replica_tiers, found, parity)


def standalone_tier(tc: TierConfig, config: StoreConfig, host: PluginHost,
                    ctx: RankContext) -> Tier:
    """Tier ``tc`` as rank ``ctx`` of a job would see it, alone (no layout agreed with other
    ranks, a storage that does not answer tolerated): to look at what it holds."""
    tier = _build_tier(tc, config, host, ctx)
    check_tiers([tier], config, host, ctx, None, {}, tolerate_unreachable=True)
    return tier


#: what checking a tier found: nothing wrong, its storage does not answer (the tier starts
#: down), it cannot be used as configured (ConfigError), or its backend failed (PluginError)
_OK, _DOWN, _UNUSABLE, _FAILED = "ok", "down", "unusable", "failed"


def check_tiers(tiers: list[Tier], config: StoreConfig, host: PluginHost, ctx: RankContext,
                group: Any, unreachable: dict[str, str], tolerate_unreachable: bool) -> None:
    """Check that every tier's storage can be used (``Backend.check_reachable``), each
    location by the lowest rank of the ranks that see it (its layout's leader), and share what
    the checks found: collective on ``group`` (with ranks laid out as agreed). A tier that
    does not answer is noted in ``unreachable``; any other problem raises, on every rank, the
    error of the first tier that has one (or, ``tolerate_unreachable``, is noted too)."""
    mine = [_check_tier(t, config, host) if group is None or t.layout.leader == ctx.rank
            else None for t in tiers]
    if group is None:
        found = [[result] for result in mine]
    else:
        gathered = all_gather_message([None if m is None else list(m) for m in mine], group,
                                      lambda v: _results_from(v, len(tiers)),
                                      f"what checking its {len(tiers)} tiers found")
        # What the leader of each part found: a node-local tier is checked on every node.
        found = [[gathered[part[0]][i] for part in tier.layout.all_parts]
                 for i, tier in enumerate(tiers)]
    errors = []
    for tier, results in zip(tiers, found):
        own = tier.layout.part if group is not None else 0
        for part, result in enumerate(results):
            if result is None:
                continue
            kind, why, reason = result
            if kind == _DOWN or (kind == _UNUSABLE and tolerate_unreachable):
                # Down only where this rank's own directory is: a tier that fails on one
                # node never stops the healthy copies of it on the others.
                if part == own:
                    unreachable.setdefault(tier.name, reason)
            elif kind != _OK:
                # Every rank raises it: none goes on to wait for the others in a collective.
                errors.append((kind, why))
    if errors:
        kind, why = errors[0]
        raise (ConfigError if kind == _UNUSABLE else PluginError)(why)


def _results_from(value: Any, count: int) -> list[tuple[str, str, str] | None]:
    """What one rank found checking the ``count`` tiers (see :func:`_check_tier`; None where
    another rank checks), from the plain data it sent."""
    results = as_list(value, optional(lambda v: as_tuple(v, as_str, as_str, as_str)))
    if len(results) != count:
        raise ValueError(f"{len(results)} results for {count} tiers")
    unknown = {r[0] for r in results if r is not None} - {_OK, _DOWN, _UNUSABLE, _FAILED}
    if unknown:
        raise ValueError(f"unknown outcome(s) {sorted(unknown)}")
    return results


def _check_tier(tier: Tier, config: StoreConfig, host: PluginHost) -> tuple[str, str, str]:
    """Check ``tier``'s storage from this rank: ``(kind, message, reason)`` (see :data:`_OK`):
    the error's message, and the reason to note where the tier is merely marked down."""
    tc, backend = tier.config, tier.backend
    try:
        # Quick to give up on a storage that does not answer: open is on a restart's path.
        with foreground():
            problem = backend.check_reachable()
    except Exception as exc:
        if not cannot_connect(exc):
            origin = f"backend '{tc.backend}' ({host.lookup('backend', tc.backend).origin})"
            why = (f"{origin} failed checking tier '{tc.name}': {type(exc).__name__}: "
                   f"{config.source.redact(str(exc))}")
            return _FAILED, why, why
        why = config.source.redact(_no_connection(tc, tier, config, exc))
        return _DOWN, why, why
    if not problem:
        return _OK, "", ""
    key = "url" if "url" in tc.backend_options else "path"
    where = config.source.where("tier", tc.index, key)
    reason = config.source.redact(problem)
    return _UNUSABLE, (
        f"{where}: tier '{tc.name}': {key} {config.source.quote(backend.describe())} cannot "
        f"be used: {reason}; point '{key}' at a writable location"), reason


#: the keys of a tier's ``options`` that say where an object store's server is
_ENDPOINT_KEYS = ("endpoint_url", "endpoint", "aws_endpoint", "aws_endpoint_url")


def _no_connection(tc: TierConfig, tier: Tier, config: StoreConfig, exc: BaseException) -> str:
    """One sentence for a tier whose server cannot be connected to: where it was asked, what
    the last try answered, and the option that says where the server is. The retries' summary
    (GaveUp) is left out: it wraps that answer in words of its own, and a dead server is not
    news that the retries add to."""
    last = exc.__cause__ if isinstance(exc, GaveUp) and exc.__cause__ is not None else exc
    answer = f"{type(last).__name__}: {last}"
    options = tc.backend_options.get("options")
    if not isinstance(options, dict):  # a backend of its own kind of address (a peer's)
        return (f"{tier.backend.describe()} cannot be connected to ({answer}); check that its "
                f"server is running")
    # An object store's options: fsspec's terms (both built-in backends that have them take
    # these), or obstore's own names.
    kwargs = options.get("client_kwargs")
    tables = (("", options), ("client_kwargs.", kwargs if isinstance(kwargs, dict) else {}))
    key, endpoint = next(((prefix + name, table[name]) for prefix, table in tables
                          for name in _ENDPOINT_KEYS if table.get(name)), ("endpoint_url", None))
    where = config.source.where("tier", tc.index, "options")
    if endpoint is None:
        return (f"{tier.backend.describe()} cannot be connected to at its provider's default "
                f"endpoint ({answer}); check the network, or set endpoint_url in the tier's "
                f"options ({where}) if its server is elsewhere")
    return (f"{tier.backend.describe()} cannot be connected to at {endpoint} ({answer}); check "
            f"that the server is running there and that {key} in the tier's options "
            f"({where}) is its address")


def _build_tier(tc: TierConfig, config: StoreConfig, host: PluginHost,
                ctx: RankContext) -> Tier:
    """Tier ``tc``'s backend, commit protocol and codecs (its storage not checked yet)."""
    reg = host.lookup("backend", tc.backend)
    options = tc.expanded_options(ctx, reg.options)
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
    if tc.dedup:  # (a peer tier's replicas deduplicate in their own tiers: replica_tier)
        backend = ChunkedBackend(backend, config.keyring.new_hasher)
    commit_name = config.commit.name if config.commit else backend.default_commit
    commit_reg = host.lookup("commit", commit_name)
    if commit_reg is None:
        raise PluginError(
            f"backend '{tc.backend}' ({reg.origin}) asks for commit protocol '{commit_name}', "
            f"which no plugin registers; registered: {', '.join(host.names('commit'))}"
        )
    commit_options = config.commit.options if config.commit else {}
    codecs = []
    for choice in tc.codecs:
        # DCP's extensions are imported (seconds) for a tier with codecs only: a query of
        # tiers without (`tierstore ls`) needs no DCP
        from tierstore.format.item_io import register_extension

        codec = host.lookup("codec", choice.name).factory(**choice.options)
        register_extension(type(codec.extension()))
        codecs.append(codec)
    return Tier(tc, backend, commit_reg.factory(**commit_options), commit_name, codecs=codecs,
                keyring=config.keyring,
                schedule=AutoSchedule() if tc.every == AUTO else None)


def _check_drain_paths(tiers: list[Tier], config: StoreConfig) -> None:
    """Each group of a node-local tier is filled by its own leader from the same group's
    directory on a faster tier, so every tier before a node-local one must be node-local with
    the same groups (node-local tiers first, shared ones after)."""
    for j, target in enumerate(tiers):
        if target.layout.shared:
            continue
        for source in tiers[:j]:
            if source.layout.all_parts != target.layout.all_parts:
                where = config.source.where("tier", target.config.index, "path")
                what = ("is shared by every rank" if source.layout.shared else
                        f"groups the ranks as {[list(p) for p in source.layout.all_parts]}")
                raise ConfigError(
                    f"{where}: tier '{target.name}' has a directory per group of ranks "
                    f"{[list(p) for p in target.layout.all_parts]}, but the faster tier "
                    f"'{source.name}' {what}, so drains could not fill it; list node-local "
                    f"tiers first, with the same placeholders ({{node}} or {{rank}}) in their "
                    f"paths, and shared tiers after them"
                )


def _replication(tiers: list[Tier], config: StoreConfig, host: PluginHost, ctx: RankContext,
                 quiet: bool = False):
    """The peer tier, its strategy (None where it cannot place copies at this world size:
    nothing is replicated then), the replica tiers for the ranks this one holds, and the
    replica sets found here that it does not keep (:func:`_found_replicas`); (None, None, {},
    ()) without a peer tier. ``quiet``: no warning that new saves are not replicated (the
    operator tools, which save nothing)."""
    peers = [t for t in tiers if t.backend.replication is not None]
    if not peers:
        return None, None, {}, ()
    source = config.source
    if len(peers) > 1:
        raise ConfigError(
            f"{source.where('tier', peers[1].config.index, 'backend')}: tiers "
            f"{', '.join(repr(t.name) for t in peers)} are all peer tiers; keep one")
    peer = peers[0]
    where = source.where("tier", peer.config.index, "replication")
    table = dict(peer.backend.replication)
    name = table.pop("strategy", None)
    reg = host.lookup("replication", name) if isinstance(name, str) else None
    if reg is None:
        raise ConfigError(
            f"{where}: tier '{peer.name}': replication needs 'strategy' naming one of "
            f"{', '.join(host.names('replication'))} (got {source.quote(name)}), e.g. "
            f"replication = {{ strategy = \"clique\", factor = 2, jump = 1 }}")
    options = validate_table(table, reg.options,
                             owner=f"tier '{peer.name}' replication strategy "
                                   f"{source.quote(name)}",
                             source=source, table_name="tier", index=peer.config.index)
    strategy = reg.factory(**options)
    if peer.config.dedup and name == "erasure":
        raise ConfigError(
            f"{source.where('tier', peer.config.index, 'dedup')}: tier '{peer.name}': dedup = "
            f"true is not available with the erasure strategy (its parity is computed over "
            f"whole files); use it with replicas (clique, ring), or set dedup on the tier the "
            f"saves go to only")
    world = ctx.world_size
    problem = strategy.check_world_size(world)
    if problem:
        # A job back in a shape the strategy cannot place copies for (one node left, say)
        # still restores from the replicas held here; only its new saves go unreplicated.
        if ctx.rank == 0 and not quiet:
            log.warning("%s: tier '%s': %s. New saves are not replicated until the job has a "
                        "world size the strategy can place copies for; the replicas this "
                        "tier holds are still read and served", where, peer.name, problem)
        return peer, None, {}, _found_replicas(peer, None, world, ctx.rank)
    held = [src for src in range(world) if ctx.rank in strategy.holders(src, world)]
    return (peer, strategy, {src: replica_tier(peer, src, ctx.rank) for src in held},
            _found_replicas(peer, strategy, world, ctx.rank))


def _found_replicas(peer: Tier, strategy: Any, world: int, rank: int) -> tuple[Tier, ...]:
    """Replica sets in this rank's peer directory that it does not keep itself under the
    strategy now (``strategy`` None: it keeps none): those the other ranks sharing the
    directory keep, and those left by a job of another size or layout. Read (latest, loads,
    peer fetch) and never written by this rank: the bytes are on its node, and a load that
    needs them reads them here rather than over the network from the rank that keeps them
    (a rank of a job at another shape needs its node's other replicas as often as its own)."""
    kept = set() if strategy is None else {
        (src, rank) for src in range(world) if rank in strategy.holders(src, world)}
    return tuple(replica_tier(peer, src, holder) for src, holder in peer.backend.replica_sets()
                 if (src, holder) not in kept)


def parity_tier(peer: Tier, rank: int) -> Tier:
    """The tier where ``rank`` keeps its share of its set's parity (beside the peer tier)."""
    backend = peer.backend.parity_backend(rank)
    config = dataclasses.replace(peer.config, name=f"{peer.name}:parity-{rank}")
    layout = TierLayout(0, 1, (rank,), ((rank,),))
    return Tier(config, backend, peer.commit, peer.commit_name, layout=layout,
                codecs=peer.codecs, keyring=peer.keyring)


def replica_tier(peer: Tier, src: int, rank: int) -> Tier:
    """The tier where ``rank`` keeps rank ``src``'s replicas (beside the peer tier); with
    ``dedup``, as chunks, in a chunk store of its own."""
    backend = peer.backend.replica_backend(src, rank)
    if peer.config.dedup:
        backend = ChunkedBackend(backend, peer.keyring.new_hasher)
    config = dataclasses.replace(peer.config, name=f"{peer.name}:rank-{src}")
    layout = TierLayout(0, 1, (src,), ((src,),))
    return Tier(config, backend, peer.commit, peer.commit_name, layout=layout,
                codecs=peer.codecs, keyring=peer.keyring)
