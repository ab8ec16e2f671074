"""Whether a checkpoint id already exists where a save would put it.

A save refuses an id that exists (unless ``[store] overwrite``), and the rule for "exists" is
the rule a load uses: a copy that could be loaded, i.e. every file of one save, for every rank
of that save, present with its recorded size, and DCP's ``.metadata`` with them. What is left of
a copy that can no longer load (a file removed or cut short, the part of a node that was
replaced empty) is no checkpoint: ``latest()`` skips it, and a restarted job that saves the same
id again replaces it (the commit swaps the new copy in, so the leftover goes only once the new
copy is there). Refusing it would stop the job at every restart for an id nobody can load.

On node-local tiers each node sees only its own part: every rank reports what it holds
(:func:`holdings`), the ranks exchange their reports, and :func:`whole_copies` decides the same
way on every rank. A copy written at another world size counts by its own world size, since DCP
reshards it on load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from tierstore.tiers.tier import Tier

__all__ = ["Holding", "holdings", "whole_copies"]


@dataclass(frozen=True)
class Holding:
    """One complete copy (or node part) of a checkpoint that one rank sees on one tier."""

    #: the tier's name, and how a message names the copy
    tier: str
    where: str
    #: one directory for the whole job (the copy is whole by itself)
    shared: bool
    #: the save that wrote it, the ranks whose files it holds, that save's world size
    token: str
    ranks: tuple[int, ...]
    world_size: int
    has_metadata: bool
    #: a node-local part not yet known to be committed (``tierstore.engine.publish``)
    pending: bool = False


def holdings(tiers: Iterable[Tier], checkpoint_id: str,
             is_pending: Callable[[Tier, str], bool]) -> list[Holding]:
    """The complete copies of ``checkpoint_id`` this rank sees on ``tiers``: a manifest whose
    files are all present with their recorded sizes (a copy with a file missing or short is not
    listed)."""
    out = []
    for tier in tiers:
        manifest = tier.complete_manifest(checkpoint_id)
        if manifest is None:
            continue
        shared = tier.layout.shared
        where = (f"tier '{tier.name}' ({tier.backend.describe()})" if shared
                 else f"tier '{tier.name}' (every node's part)")
        out.append(Holding(tier.name, where, shared, manifest.save_token, tuple(manifest.ranks),
                           manifest.world_size, manifest.has_metadata,
                           pending=not shared and is_pending(tier, checkpoint_id)))
    return out


def whole_copies(held: Iterable[Holding],
                 committed: Callable[[Holding], bool] = lambda h: not h.pending) -> list[str]:
    """Where a loadable copy exists, from the holdings of every rank (sorted, no duplicates):
    a complete copy on a shared tier with ``.metadata``; on a node-local tier, the parts of one
    save (one token) that together hold every rank of that save, ``.metadata`` among them.
    ``committed`` says whether a pending part counts (its save's coordinator committed it)."""
    found: set[str] = set()
    parts: dict[tuple[str, str], list[Holding]] = {}
    for h in held:
        if h.shared:
            if h.has_metadata:
                found.add(h.where)
        elif committed(h):
            parts.setdefault((h.tier, h.token), []).append(h)
    for group in parts.values():
        ranks = {r for h in group for r in h.ranks}
        if any(h.has_metadata for h in group) and ranks >= set(range(group[0].world_size)):
            found.add(group[0].where)
    return sorted(found)
