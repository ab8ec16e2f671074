"""The tiers of one store in this process, fastest first, as plain data: the configured tiers,
the peer tier's replication strategy and the replica tiers this rank keeps for its peers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from tierstore.plugin.bases import ReplicationStrategy
from tierstore.tiers.tier import Tier

__all__ = ["TierSet"]


@dataclass(frozen=True, eq=False)
class TierSet(Sequence):
    """The configured tiers (a sequence, fastest first) and what replication adds to them."""

    tiers: tuple[Tier, ...]
    #: the tier holding peers' replicas (``backend.replication`` set), or None
    peer: Tier | None = None
    strategy: ReplicationStrategy | None = None
    #: rank -> the tier where this rank keeps that rank's replicas (beside the peer tier)
    replica_tiers: dict[int, Tier] = field(default_factory=dict)
    #: replica sets in this rank's peer directory that it does not keep (its node's other
    #: ranks keep them, or a job of another size or layout left them): read and served, never
    #: written by this rank
    found_replicas: tuple[Tier, ...] = ()
    #: where this rank keeps its share of its set's parity (``erasure`` strategy), or None
    parity_tier: Tier | None = None

    def __getitem__(self, index):  # type: ignore[override]
        return self.tiers[index]

    def __len__(self) -> int:
        return len(self.tiers)

    def __iter__(self) -> Iterator[Tier]:
        return iter(self.tiers)

    @property
    def node_local(self) -> bool:
        """Whether some tier is split into parts (a directory per node or rank)."""
        return any(t.layout.parts > 1 for t in self.tiers)

    def named(self, name: str) -> Tier:
        """The configured tier called ``name``; ValueError naming the tiers otherwise."""
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise ValueError(f"no tier named {name!r}; tiers: {', '.join(t.name for t in self.tiers)}")

    def take_save(self, step: int) -> list[Tier]:
        """The tiers that take the save of ``step``, fastest first: the first is saved to, the
        rest get the drain. Where only ``every = "auto"`` tiers could and none is due, the
        fastest tier alone: a save the job asked for is never dropped (``store.should_save``
        says when one is due).

        Call it once per save, on every rank (a save's ``reset``): an auto tier counts the
        save taken, so its schedule must see the same saves in the same order on every rank;
        whatever else needs to know (drains, replication) uses the answer, never asks again."""
        taking = [t for t in self.tiers if t.takes(step)]
        return taking or [self.tiers[0]]

    def due(self, step: int) -> bool:
        """Whether some tier would take the save of ``step`` (asking changes nothing)."""
        return any(t.due(step) for t in self.tiers)

    def is_replica(self, tier: Tier) -> bool:
        """Whether ``tier`` holds replicas of other ranks' files."""
        return any(tier is t for t in self.all_replicas)

    @property
    def all_replicas(self) -> list[Tier]:
        """Every replica tier this rank reads: those it keeps, then those found."""
        return [*self.replica_tiers.values(), *self.found_replicas]

    def maintained(self) -> list[Tier]:
        """Every tier this rank writes or reads, for housekeeping (gc, close): the read order,
        then the parity tier (which no load reads as a copy)."""
        return [*self.read_order(), *([self.parity_tier] if self.parity_tier else [])]

    def read_order(self) -> list[Tier]:
        """Every tier a load may read, fastest first: the replica tiers come right after the
        peer tier (own copy, then replicas kept here, then slower tiers)."""
        out: list[Tier] = []
        for tier in self.tiers:
            out.append(tier)
            if tier is self.peer:
                out += self.all_replicas
        return out
