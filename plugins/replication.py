"""Replication strategies ``clique``, ``ring`` and ``erasure``: which ranks keep a copy of whose
files, or parity over them (for ``peer`` tiers).

``clique`` follows NVIDIA's ``CliqueReplicationStrategy``: ranks form groups
``{n, n+jump, ..., n+(factor-1)*jump}`` and every member keeps the files of every other member.
With one rank per GPU and ``jump`` = GPUs per node, the copies sit on other nodes. ``ring``
keeps each rank's copy on the rank ``offset`` places further (modulo the world size).
``erasure`` keeps no copies: ranks form sets of ``data + parity`` members placed as ``clique``
places its groups, and each member keeps ``1/data`` of the set's XOR parity
(tierstore.format.parity), so a node costs ``1 + 1/data`` checkpoints of memory instead of
``factor``, and any one lost member of a set is rebuilt from the others.
"""

from __future__ import annotations

from tierstore.plugin import hookimpl, Option, ReplicationStrategy

__all__ = ["CliqueStrategy", "RingStrategy", "ErasureStrategy"]


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


def _one_parity_block(m: int) -> str | None:
    if m == 1:
        return None
    return (f"must be 1 (XOR parity: any one lost member of a set is rebuilt); {m} parity "
            f"blocks need Reed-Solomon coding, which this version does not have: keep parity = 1 "
            f"with smaller sets (data = 2 or 3), or use clique replication with factor = "
            f"{m + 1}")


class ErasureStrategy(ReplicationStrategy):
    """Sets of ``data + parity`` ranks, ``jump`` apart; each keeps 1/``data`` of the set's
    parity instead of replicas."""

    options = (
        Option("data", int, default=3, check=_at_least(2),
               description="members whose data one parity block covers (memory per node: "
                           "1 + parity/data checkpoints)"),
        Option("parity", int, default=1, check=_one_parity_block,
               description="lost members per set that can be rebuilt (1: XOR parity)"),
        Option("jump", int, default=1, check=_at_least(1),
               description="distance between the ranks of a set (GPUs per node: other nodes)"),
    )

    def __init__(self, data: int = 3, parity: int = 1, jump: int = 1):
        self.data, self.parity, self.jump = data, parity, jump
        self._clique = CliqueStrategy(factor=data + parity, jump=jump)

    def check_world_size(self, world_size: int) -> str | None:
        block = (self.data + self.parity) * self.jump
        if world_size % block == 0:
            return None
        sizes = ", ".join(str(block * k) for k in range(1, 4))
        return (f"erasure coding with data {self.data}, parity {self.parity} and jump "
                f"{self.jump} puts ranks {{n, n+{self.jump}, ...}} in sets of "
                f"{self.data + self.parity}, in blocks of {block} ranks, so the world size must "
                f"be a multiple of {block} ({sizes}, ...); this job has {world_size} ranks")

    def holders(self, rank: int, world_size: int) -> list[int]:
        return []  # no whole replicas: parity (parity_set)

    def parity_set(self, rank: int, world_size: int) -> list[int]:
        """The set of ``rank``, itself included, in rank order."""
        return self._clique.group(rank)

    def __str__(self) -> str:
        return f"erasure(data={self.data}, parity={self.parity}, jump={self.jump})"


@hookimpl
def tierstore_register_replication_strategies(register):
    register("clique", CliqueStrategy)
    register("ring", RingStrategy)
    register("erasure", ErasureStrategy)
