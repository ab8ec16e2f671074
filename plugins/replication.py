"""Replication strategies ``clique`` and ``ring``: which ranks keep a copy of whose files (for
``peer`` tiers).

``clique`` follows NVIDIA's ``CliqueReplicationStrategy``: ranks form groups
``{n, n+jump, ..., n+(factor-1)*jump}`` and every member keeps the files of every other member.
With one rank per GPU and ``jump`` = GPUs per node, the copies sit on other nodes. ``ring``
keeps each rank's copy on the rank ``offset`` places further (modulo the world size).
"""

from __future__ import annotations

from tierstore.plugin import hookimpl, Option, ReplicationStrategy

__all__ = ["CliqueStrategy", "RingStrategy"]


def _at_least(n: int):
    return lambda v: None if v >= n else f"must be at least {n}"


class CliqueStrategy(ReplicationStrategy):
    """Groups of ``factor`` ranks, ``jump`` apart; each member holds the others' files."""

    options = (
        Option("factor", int, default=2, check=_at_least(2),
               description="ranks per group (copies of each file, the original included)"),
        Option("jump", int, default=1, check=_at_least(1),
               description="distance between the ranks of a group (GPUs per node: other nodes)"),
    )

    def __init__(self, factor: int = 2, jump: int = 1):
        self.factor, self.jump = factor, jump

    def check_world_size(self, world_size: int) -> str | None:
        block = self.factor * self.jump
        if world_size % block == 0:
            return None
        sizes = ", ".join(str(block * k) for k in range(1, 4))
        return (f"clique replication with factor {self.factor} and jump {self.jump} groups ranks "
                f"{{n, n+{self.jump}, ...}} in blocks of {block}, so the world size must be a "
                f"multiple of {block} ({sizes}, ...); this job has {world_size} ranks")

    def group(self, rank: int) -> list[int]:
        """The clique of ``rank``, itself included, in rank order."""
        block = self.factor * self.jump
        base = rank - rank % block
        first = base + rank % self.jump
        return [first + i * self.jump for i in range(self.factor)]

    def holders(self, rank: int, world_size: int) -> list[int]:
        return [r for r in self.group(rank) if r != rank]

    def __str__(self) -> str:
        return f"clique(factor={self.factor}, jump={self.jump})"


class RingStrategy(ReplicationStrategy):
    """Each rank's copy on the rank ``offset`` places further round the ring."""

    options = (
        Option("offset", int, default=1, check=_at_least(1),
               description="how many ranks further each copy goes (GPUs per node: next node)"),
    )

    def __init__(self, offset: int = 1):
        self.offset = offset

    def check_world_size(self, world_size: int) -> str | None:
        if world_size >= 2 and self.offset % world_size != 0:
            return None
        return (f"ring replication with offset {self.offset} would keep each copy on the rank "
                f"that saved it with {world_size} rank(s); use a world size of at least 2 that "
                f"does not divide {self.offset} (e.g. {self.offset + 1}), or change offset")

    def holders(self, rank: int, world_size: int) -> list[int]:
        return [(rank + self.offset) % world_size]

    def __str__(self) -> str:
        return f"ring(offset={self.offset})"


@hookimpl
def tierstore_register_replication_strategies(register):
    register("clique", CliqueStrategy)
    register("ring", RingStrategy)
