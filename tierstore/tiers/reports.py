"""Plain data about stored checkpoints, which the store returns and the CLI prints."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CheckpointInfo", "VerifyReport", "Problem"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a stored checkpoint, as plain data (``verify`` reports, errors)."""

    tier: str
    checkpoint_id: str
    file: str | None
    what: str

    def __str__(self) -> str:
        where = f"{self.checkpoint_id}/{self.file}" if self.file else self.checkpoint_id
        return f"tier '{self.tier}': {where}: {self.what}"


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint as ``Store.list()`` sees it."""

    id: str
    #: names of the tiers where it is complete (manifest present, file sizes match), fastest first
    tiers: list[str]
    size_bytes: int
    #: UNIX seconds when the save started / when it was committed on its first tier
    created: float
    committed: float
    pinned: bool
    step: int | None = None


@dataclass(frozen=True)
class VerifyReport:
    """What ``Store.verify()`` found: ``ok`` is True when no tier checked has a problem."""

    checkpoint_id: str
    tiers: list[str]
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.tiers)

    def __str__(self) -> str:
        if self.ok:
            return f"{self.checkpoint_id}: ok on {', '.join(self.tiers)}"
        if not self.tiers:
            return f"{self.checkpoint_id}: not found on any tier"
        return f"{self.checkpoint_id}: " + "; ".join(map(str, self.problems))
