"""Plain data about stored checkpoints, which the store returns and the CLI prints."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CheckpointInfo", "ExportResult", "InspectReport", "Problem", "PromoteResult", "Repair",
           "ScrubReport", "StoreStatus", "StoredFile", "StoredTensor", "TierStatus", "VerifyReport"]


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
    #: how many files it has (DCP's ``.metadata`` included)
    files: int = 0

    def to_json(self) -> dict:
        """The documented ``ls --json`` shape of one checkpoint."""
        return {"id": self.id, "tiers": self.tiers, "size_bytes": self.size_bytes,
                "created": self.created, "committed": self.committed, "pinned": self.pinned,
                "step": self.step}


@dataclass(frozen=True)
class VerifyReport:
    """What ``Store.verify()`` found: ``ok`` is True when no tier checked has a problem."""

    checkpoint_id: str
    tiers: list[str]
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.tiers)

    def to_json(self) -> dict:
        """The documented ``verify --json`` shape."""
        return {"id": self.checkpoint_id, "ok": self.ok, "tiers": self.tiers,
                "problems": [{"tier": p.tier, "file": p.file, "problem": p.what}
                             for p in self.problems]}

    def __str__(self) -> str:
        if self.ok:
            return f"{self.checkpoint_id}: ok on {', '.join(self.tiers)}"
        if not self.tiers:
            return f"{self.checkpoint_id}: not found on any tier"
        return f"{self.checkpoint_id}: " + "; ".join(map(str, self.problems))


@dataclass(frozen=True)
class TierStatus:
    """One tier as ``Store.status()`` sees it: what a failure would cost if this tier were the
    one restored from."""

    name: str
    #: whether the tier answered (an unreachable one is reported, never fatal)
    reachable: bool
    #: newest checkpoint complete here (None: none, or unreachable)
    newest: str | None
    #: seconds since ``newest`` was committed
    newest_age_s: float | None
    #: steps between ``newest`` and the newest checkpoint complete on any tier (0: up to date;
    #: None: no checkpoint here, or no step numbers to count)
    steps_behind: int | None
    #: bytes of the complete checkpoints here
    bytes: int
    #: free space of the filesystem under the tier (None: unknown, an object store)
    free_bytes: int | None
    #: how many complete checkpoints are here
    checkpoints: int = 0
    #: why the tier is unreachable (None when it answered)
    problem: str | None = None

    def to_json(self) -> dict:
        """The documented ``status --json`` shape of one tier."""
        return {"name": self.name, "reachable": self.reachable, "newest": self.newest,
                "newest_age_s": self.newest_age_s, "steps_behind": self.steps_behind,
                "bytes": self.bytes, "free_bytes": self.free_bytes}


@dataclass(frozen=True)
class StoreStatus:
    """``Store.status()``: every tier, fastest first, and the copies still pending."""

    tiers: list[TierStatus]
    #: (checkpoint id, tier) of each copy the drain has not finished
    pending: list[tuple[str, str]] = field(default_factory=list)

    def to_json(self) -> dict:
        """The documented ``status --json`` shape."""
        return {"tiers": [t.to_json() for t in self.tiers],
                "pending": [{"checkpoint_id": c, "tier": t} for c, t in self.pending]}


@dataclass(frozen=True)
class StoredFile:
    """One file of a checkpoint (``Store.inspect()``): its name, size and the rank that wrote
    it (None: DCP's ``.metadata``, written by the coordinator for all)."""

    name: str
    size: int
    rank: int | None


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint as DCP's metadata describes it (the whole tensor, whatever
    its shards): fully qualified name, shape, dtype and bytes."""

    fqn: str
    shape: list[int]
    dtype: str
    bytes: int


@dataclass(frozen=True)
class InspectReport:
    """``Store.inspect()``: a checkpoint's manifest summary, files and tensors, and where each
    copy is."""

    checkpoint_id: str
    world_size: int
    #: tiers where it is complete, fastest first
    tiers: list[str]
    files: list[StoredFile]
    tensors: list[StoredTensor]
    #: fully qualified names of the non-tensor values (saved pickled)
    objects: list[str] = field(default_factory=list)
    size_bytes: int = 0
    step: int | None = None
    committed: float = 0.0
    pinned: bool = False
    codecs: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        """The documented ``inspect --json`` shape."""
        return {"id": self.checkpoint_id, "world_size": self.world_size, "tiers": self.tiers,
                "files": [{"name": f.name, "size": f.size, "rank": f.rank} for f in self.files],
                "tensors": [{"fqn": t.fqn, "shape": t.shape, "dtype": t.dtype,
                             "bytes": t.bytes} for t in self.tensors]}


@dataclass(frozen=True)
class PromoteResult:
    """``Store.promote()``: the checkpoint copied, where to, its bytes and how long it took."""

    checkpoint_id: str
    tier: str
    bytes: int
    seconds: float
    #: the tier it was copied from
    source: str = ""
    pinned: bool = False

    def to_json(self) -> dict:
        """The documented ``promote --json`` shape."""
        return {"id": self.checkpoint_id, "tier": self.tier, "bytes": self.bytes,
                "seconds": self.seconds}


@dataclass(frozen=True)
class Repair:
    """One copy ``scrub --repair`` replaced: checkpoint, tier, the files that were bad, and the
    tier the good copy came from."""

    checkpoint_id: str
    tier: str
    files: list[str]
    source: str


@dataclass(frozen=True)
class ScrubReport:
    """``Store.scrub()``: how many copies were re-read, the problems found, what was repaired,
    and what is still bad (every problem without ``repair``; with it, those that had no good
    copy elsewhere or whose repair failed, saying why)."""

    checked: int
    bad: list[Problem] = field(default_factory=list)
    repaired: list[Repair] = field(default_factory=list)
    unrepaired: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing bad is left: no problem found, or every one repaired."""
        return not self.unrepaired

    def to_json(self) -> dict:
        """The documented ``scrub --json`` shape."""
        return {"checked": self.checked,
                "bad": [_problem_json(p) for p in self.bad],
                "repaired": [{"id": r.checkpoint_id, "tier": r.tier, "files": r.files,
                              "source": r.source} for r in self.repaired],
                "unrepaired": [_problem_json(p) for p in self.unrepaired]}


@dataclass(frozen=True)
class ExportResult:
    """``Store.export()``: the file written, its format, how many tensors and bytes."""

    checkpoint_id: str
    format: str
    path: str
    tensors: int
    bytes: int
    #: fully qualified names left out (safetensors holds tensors only)
    skipped: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        """The documented ``export --json`` shape."""
        return {"id": self.checkpoint_id, "format": self.format, "path": self.path,
                "tensors": self.tensors, "bytes": self.bytes}


def _problem_json(p: Problem) -> dict:
    return {"id": p.checkpoint_id, "tier": p.tier, "file": p.file, "problem": p.what}
