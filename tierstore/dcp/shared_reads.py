"""What one rank reads of a job-wide tier, for every rank of a load.

A tier with one directory for the whole job (an object store; a shared filesystem) holds the
same manifest and the same ``.metadata`` for every rank. Read by each rank, they cost a request
per rank at every restart, which at a thousand ranks is a storm the store answers with 503
SlowDown. So the load's first rank reads them (from the look ``latest()`` took a moment before,
when it is fresh: :mod:`tierstore.engine.listings`) and broadcasts the bytes as a typed message
(:func:`~tierstore.transport.collectives.broadcast_message`); every rank checks them itself, as
it would have checked what it read (a manifest's seal or signature, ``.metadata`` against its
manifest entry).

Only a load that every rank of the store's group runs together shares: one rank loading alone
(``Store.export``, ``inspect``) reads for itself.
"""

from __future__ import annotations

from typing import Any, Callable

from tierstore.engine.context import StoreContext
from tierstore.engine.health import TierHealth
from tierstore.engine.listings import Listings
from tierstore.errors import TierstoreError
from tierstore.tiers.tier import Tier
from tierstore.transport.collectives import broadcast_message

__all__ = ["READER_RANK", "job_wide", "shared_manifests", "shared_result"]

#: the rank of the store's group that reads for the others
READER_RANK = 0


def job_wide(ctx: StoreContext, tier: Tier) -> bool:
    """Whether ``tier`` is one directory for the whole job (not a peer's replica set)."""
    return tier.layout.shared and not ctx.tiers.is_replica(tier)


def shared_manifests(ctx: StoreContext, health: TierHealth, listings: Listings, cid: str,
                     tiers: list[Tier]
                     ) -> dict[str, tuple[bytes | None, str | None, list[str]] | None]:
    """Collective on the store's group: the manifest bytes of ``cid`` on each job-wide tier
    of ``tiers`` and the files of it stored there with their recorded size, read by one rank:
    tier name -> ``(raw, None, present)``, ``(None, None, [])`` (no manifest there),
    ``(None, why, [])`` (unreadable), or None (the tier did not answer)."""
    wide = [t for t in tiers if job_wide(ctx, t)]
    if not wide:
        return {}
    mine = None
    if ctx.rank == READER_RANK:
        mine = {t.name: health.ask(t, "load", lambda t=t: _manifest_bytes(listings, t, cid), None)
                for t in wide}
    told = broadcast_message(mine, ctx.groups.main, READER_RANK)
    return {name: None if found is None else tuple(found) for name, found in told.items()}


def shared_result(ctx: StoreContext, read: Callable[[], Any]) -> Any:
    """Collective on the store's group: what ``read()`` returns on the reading rank (plain
    data), on every rank; the others do not call it. What it raises there is raised on every
    rank (a TierstoreError with its message): no rank is left waiting for the broadcast."""
    mine = None
    if ctx.rank == READER_RANK:
        try:
            mine = {"value": read()}
        except Exception as exc:  # every rank raises it below, the reader included
            mine = {"error": f"{type(exc).__name__}: {exc}"}
    told = broadcast_message(mine, ctx.groups.main, READER_RANK)
    if "error" in told:
        raise TierstoreError(f"rank {READER_RANK}, reading for every rank of the load, "
                             f"failed: {told['error']}")
    return told["value"]


def _manifest_bytes(listings: Listings, tier: Tier, cid: str
                    ) -> tuple[bytes | None, str | None, list[str]]:
    """``cid``'s manifest bytes on ``tier`` and the files present: from the fresh look
    ``latest()`` took, if any, else read now (a look: one listing, not a request per file)."""
    look = listings.kept(tier)
    held = look.holding(cid) if look is not None else None
    if held is not None:
        return held.raw, None, sorted(held.present)
    raw, why = tier.manifest_bytes(cid)  # no fresh look, or not there at it: read it
    if raw is None:
        return None, why, []
    manifest, why = tier.manifest_from(cid, raw)
    if manifest is None:
        return None, why, []
    return raw, None, sorted(tier.present_files(cid, manifest))
