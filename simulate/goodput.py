"""Goodput from events: how much of a job's wall time ended up in its final model.

The input is what ``[store] events_log`` writes (one JSON object a line, every rank, every run
of a job restarted after failures): :func:`read_events` reads it, :func:`account` turns one job's
events into a :class:`ContenderReport`. The simulator's stock-DCP job writes the same lines, so
every contender is measured by this one function.

The accounting reads rank 0's events (every rank of a DCP job waits for the others at each
step and save, so rank 0's clock is the job's):

- a **run** begins at an ``opened`` event (a process of the job opened its store) or, where the
  caller knows it, at the process's start (``starts``); it ends at its last event;
- **productive** time is the sum of the ``step`` events' own seconds for the steps that are part
  of the final model's history: every step of the last run, and of each earlier run the steps
  up to the step the next run resumed from (the first step a run reports, minus one);
- **lost progress** is the time of the other steps, plus the time a run spent after its last
  step before it died (the step in progress);
- **restart** is the time from a run's end to the next run's first event of its own (its start,
  else its ``opened``), plus that run's start-up until ``opened``;
- **restore** is the time of the ``loaded`` events of a run; a failure's ``restored_from``
  names the tier rank 0 loaded from, then (joined by ``+``) every other source any rank of the
  run read bytes from, ``peers`` for files other ranks sent it (``ram+peers``: a replaced
  node's ranks got their files from the replicas the surviving node holds), and its
  ``restore_s`` is the slowest rank's load (the job goes on when every rank has loaded);
- **checkpoint stall** is the time between consecutive steps of a run (where the job saves);
- **other** is what is left (start-up before the first step, beyond the restore); the parts sum
  to the wall time exactly.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from tierstore.events import FROM_PEERS

#: how ``restored_from`` names the files other ranks sent a loading rank (peer fetch)
PEERS = "peers"

__all__ = ["PEERS", "Badput", "ContenderReport", "FailureRecord", "Run", "account", "read_events",
           "report_json", "split_runs", "summary_table"]


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Every whole event of the log at ``path``, in file order. A line that is not one whole
    JSON object (a process killed in mid-write) is skipped; a missing file is
    FileNotFoundError."""
    out = []
    with open(path, "rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("kind"), str) \
                    and isinstance(record.get("at"), (int, float)):
                out.append(record)
    return out


@dataclass
class Run:
    """One process lifetime of the job, from rank 0's events."""

    opened: float
    end: float
    start: float | None = None  # the process start, where the caller knows it
    #: (step, start, end) of each ``step`` event, in order
    steps: list[tuple[int, float, float]] = field(default_factory=list)
    restore_s: float = 0.0
    restored_from: str | None = None

    @property
    def begins(self) -> float:
        """When the run's time begins: its process start, else its ``opened``."""
        return self.opened if self.start is None else min(self.start, self.opened)

    @property
    def resumed_from(self) -> int:
        """The step this run resumed from (0: from scratch)."""
        return self.steps[0][0] - 1 if self.steps else 0

    @property
    def last_step(self) -> int:
        return self.steps[-1][0] if self.steps else self.resumed_from


@dataclass(frozen=True)
class FailureRecord:
    """A failure between two runs, as the report states it."""

    kind: str
    at_step: int
    resumed_from_step: int
    steps_lost: int
    restore_s: float
    restored_from: str | None


@dataclass(frozen=True)
class Badput:
    """Where the wall time that was not productive went, in seconds."""

    checkpoint_stall_s: float
    restart_s: float
    restore_s: float
    lost_progress_s: float
    other_s: float


@dataclass(frozen=True)
class ContenderReport:
    """One contender's (one job's) goodput, as in ``report.json``."""

    name: str
    wall_s: float
    productive_s: float
    goodput: float
    badput: Badput
    saves: int
    failures: list[FailureRecord]
    time_to_durable_s: dict[str, float]
    #: per run: (run begins, [(step, start, end)]), for the timeline plot
    timeline: list[tuple[float, list[tuple[int, float, float]]]] = field(default_factory=list)
    final_step: int = 0
    #: per ``every = "auto"`` tier, the interval in steps it ended with (``interval`` events)
    intervals: dict[str, int] = field(default_factory=dict)
    #: object-store outages the job went on through: ``{"at_step", "duration_s"}`` each (the
    #: simulator knows them; a log alone does not say)
    outages: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The contract's form of this contender in ``report.json``."""
        out = asdict(self)
        out.pop("timeline")
        return out


def split_runs(events: Iterable[dict[str, Any]], starts: Sequence[float] = ()) -> list[Run]:
    """Rank 0's events cut into runs at each ``opened`` event; ``starts``: the process start
    of each run in order, where known. With them, an event after a run's start belongs to that
    run even before its ``opened`` (a tier found unreachable while the store opens), not to the
    run before it, whose end (and lost progress) it would stretch."""
    runs: list[Run] = []
    later = [float(s) for s in starts[1:]]  # the starts of the runs after the first
    unopened = False  # the last run began at its start, and its ``opened`` is still to come
    for e in sorted((e for e in events if e.get("rank", 0) == 0), key=lambda e: e["at"]):
        kind, at = e["kind"], float(e["at"])
        if kind == "opened" and unopened:
            runs[-1].opened, unopened = at, False
            continue
        started = bool(runs) and len(runs) <= len(later) and at >= later[len(runs) - 1]
        if kind == "opened" or not runs or started:
            runs.append(Run(opened=at, end=at))
            unopened = kind != "opened" and bool(runs[:-1])
            if kind == "opened":
                continue
        run = runs[-1]
        run.end = max(run.end, at)
        if kind == "step":
            seconds = float(e.get("seconds", 0.0))
            run.steps.append((int(e["detail"]["step"]), at - seconds, at))
        elif kind == "loaded":
            run.restore_s += float(e.get("seconds", 0.0))
            run.restored_from = run.restored_from or e.get("tier")
    for run, start in zip(runs, starts):
        run.start = float(start)
    return runs


def _history(runs: list[Run]) -> list[set[int]]:
    """Per run, the steps of it that are part of the final model's history."""
    kept: list[set[int]] = [set() for _ in runs]
    limit = None
    for i in range(len(runs) - 1, -1, -1):
        steps = [s for s, _, _ in runs[i].steps]
        kept[i] = {s for s in steps if limit is None or s <= limit}
        resumed = runs[i].resumed_from if runs[i].steps else limit
        limit = resumed if limit is None or resumed is None else min(limit, resumed)
    return kept


def account(events: Iterable[dict[str, Any]], name: str = "job", *,
            starts: Sequence[float] = (), kinds: Sequence[str] = ()) -> ContenderReport:
    """The goodput report of one job from its events (see the module docstring). ``starts``:
    the process start of each run, where the caller knows them; ``kinds``: the kind of each
    failure in order (a log alone does not say: ``restart``)."""
    events = list(events)
    runs = split_runs(events, starts)
    if not runs:
        raise ValueError("no events of rank 0: nothing to account (is [store] events_log set, "
                         "and did rank 0 open the store?)")
    kept = _history(runs)
    sources, slowest = _restore_sources(events, runs)
    productive = lost = stall = restart = restore = 0.0
    failures = []
    for i, run in enumerate(runs):
        for step, start, end in run.steps:
            if step in kept[i]:
                productive += end - start
            else:
                lost += end - start
        stall += sum(max(0.0, b[1] - a[2]) for a, b in zip(run.steps, run.steps[1:]))
        restore += run.restore_s
        if i + 1 < len(runs):
            nxt = runs[i + 1]
            if run.steps:
                lost += max(0.0, run.end - run.steps[-1][2])  # the step in progress
            restart += max(0.0, nxt.begins - run.end) + max(0.0, nxt.opened - nxt.begins)
            failures.append(FailureRecord(
                kind=kinds[i] if i < len(kinds) else "restart", at_step=run.last_step,
                resumed_from_step=nxt.resumed_from,
                steps_lost=max(0, run.last_step - nxt.resumed_from),
                restore_s=round(max(nxt.restore_s, slowest[i + 1]), 4),
                restored_from=sources[i + 1]))
    wall = runs[-1].end - runs[0].begins
    # The first run's start-up (beyond its restore) and the last run's tail are "other".
    other = max(0.0, wall - productive - lost - stall - restart - restore)
    return ContenderReport(
        name=name, wall_s=round(wall, 4), productive_s=round(productive, 4),
        goodput=round(productive / wall, 4) if wall > 0 else 0.0,
        badput=Badput(round(stall, 4), round(restart, 4), round(restore, 4), round(lost, 4),
                      round(other, 4)),
        saves=len({e["checkpoint_id"] for e in events if e["kind"] in ("committed",
                   "emergency_saved") and e.get("rank", 0) == 0 and e.get("checkpoint_id")}),
        failures=failures, time_to_durable_s=_time_to_durable(events),
        timeline=[(r.begins, list(r.steps)) for r in runs], final_step=runs[-1].last_step,
        intervals={e["tier"]: int(e["detail"]["every"]) for e in events
                   if e["kind"] == "interval" and e.get("rank", 0) == 0 and e.get("tier")})


def _restore_sources(events: list[dict[str, Any]], runs: list[Run]
                     ) -> tuple[list[str | None], list[float]]:
    """Per run, the tiers its ranks loaded from (rank 0's first, then the others' in order of
    name, joined by ``+``; None: nothing was loaded), and its slowest rank's load time."""
    bounds = [r.begins for r in runs[1:]] + [float("inf")]
    others: list[set[str]] = [set() for _ in runs]
    slowest = [0.0 for _ in runs]
    for e in events:
        if e.get("kind") == "loaded":
            i = next(i for i, end in enumerate(bounds) if float(e["at"]) < end)
            slowest[i] = max(slowest[i], float(e.get("seconds", 0.0)))
            # (a rank of a replaced node that read nothing of its own names no tier)
            sent = (e.get("detail") or {}).get("bytes_from") or (
                {e["tier"]: 1} if e.get("tier") else {})
            # A peer tier's replica of another rank's files is a source "<tier>:rank-<r>".
            others[i].update(PEERS if name == FROM_PEERS else name.split(":")[0]
                             for name, n in sent.items() if n)
    out: list[str | None] = []
    for run, tiers in zip(runs, others):
        first = [run.restored_from] if run.restored_from else []
        out.append("+".join(first + sorted(tiers - set(first))) or None)
    return out, slowest


def _time_to_durable(events: list[dict[str, Any]]) -> dict[str, float]:
    """Per tier, the median time from a save's start (the start of its commit on the first
    tier) to its commit on that tier: the save's own ``committed`` event there, or a drain's
    ``drain_finished`` that committed the copy; rank 0's events."""
    started: dict[str, float] = {}
    commits: dict[tuple[str, str], float] = {}
    for e in events:
        if e.get("rank", 0) != 0 or not e.get("checkpoint_id"):
            continue
        cid, at = e["checkpoint_id"], float(e["at"])
        if e["kind"] == "committed":
            begin = at - float(e.get("seconds", 0.0))
            started[cid] = min(started.get(cid, begin), begin)
        elif not (e["kind"] == "drain_finished" and (e.get("detail") or {}).get("committed")):
            continue
        key = (e.get("tier") or "?", cid)
        commits[key] = min(commits.get(key, at), at)
    per_tier: dict[str, list[float]] = {}
    for (tier, cid), at in commits.items():
        if cid in started:
            per_tier.setdefault(tier, []).append(at - started[cid])
    return {tier: round(statistics.median(v), 4) for tier, v in sorted(per_tier.items())}


def report_json(contenders: list[ContenderReport], scenario: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """``report.json`` as in the Contract."""
    return {"scenario": scenario or {}, "contenders": [c.to_json() for c in contenders]}


def summary_table(contenders: list[ContenderReport]) -> str:
    """The report as a table for a terminal: one line per contender."""
    header = ["contender", "goodput", "wall s", "productive s", "stall s", "restart s",
              "restore s", "lost s", "other s", "saves", "failures"]
    rows = [[c.name, f"{c.goodput:.1%}", f"{c.wall_s:.1f}", f"{c.productive_s:.1f}",
             f"{c.badput.checkpoint_stall_s:.1f}", f"{c.badput.restart_s:.1f}",
             f"{c.badput.restore_s:.2f}", f"{c.badput.lost_progress_s:.1f}",
             f"{c.badput.other_s:.1f}", str(c.saves), str(len(c.failures))]
            for c in contenders]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()
             for r in [header, *rows]]
    for c in contenders:
        for f in c.failures:
            lines.append(f"  {c.name}: {f.kind} at step {f.at_step}, resumed from step "
                         f"{f.resumed_from_step} ({f.steps_lost} steps lost), restore "
                         f"{f.restore_s:.2f} s from {f.restored_from or 'nowhere (from scratch)'}")
    return "\n".join(lines)
