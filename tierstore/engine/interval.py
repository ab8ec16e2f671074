"""``every = "auto"``: each auto tier's interval chosen after Young/Daly, as the job runs.

Checkpointing every ``T`` seconds costs ``C/T`` of the time in checkpoints and, with failures
every ``M`` seconds on average, ``T/2`` of lost work per failure; the sum is least at

    T = sqrt(2 x C x M)            (Young, 1974; Daly, 2006, to first order)

``C`` is what one checkpoint on that tier costs the job: for the first tier the time a save
blocks training (the ``staged`` stall of an ``async_save``, the whole save of a ``dcp.save``),
for a slower tier its time to durable (from the save's start to the commit there: what a
failure of that tier's scope costs while a copy is in flight). ``M`` is ``[store] mtbf_hours``,
or else the restarts the events log records (the time it covers over the restarts), or a day
when it records none yet. ``T`` becomes a number of steps through the measured step time (the
``step`` events of ``store.record_step``, else the spacing of the saves).

The :class:`IntervalChooser` is an observer of the store's events (it measures ``C`` and the
step time) and, on the coordinator, chooses at every save; the choice travels to every rank in
the save's plan and is put in force there for the saves that follow
(:class:`tierstore.tiers.schedule.AutoSchedule`), so that every rank takes the same saves. Each
new choice is an ``interval`` event whose detail is the :class:`IntervalChoice`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from tierstore.events import Event, EventKind
from tierstore.plugin.host import hookimpl

__all__ = ["DEFAULT_MTBF_S", "IntervalChoice", "IntervalChooser", "mtbf_from_events_log",
           "young_daly_s"]

#: the failure rate assumed when neither mtbf_hours nor a recorded restart says one: a day
DEFAULT_MTBF_S = 24 * 3600.0
#: weight of a new measurement in the running averages (recent saves count most)
_NEW = 0.3
#: a new interval replaces the one in force only when it differs by more than this share:
#: the measurements jitter, and each change is an event
_HYSTERESIS = 0.2


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """The checkpoint interval, in seconds, that costs least: ``sqrt(2 x cost x MTBF)``."""
    return math.sqrt(2.0 * max(cost_s, 0.0) * max(mtbf_s, 0.0))


@dataclass(frozen=True)
class IntervalChoice:
    """One auto tier's interval and what it was chosen from (the ``interval`` event's detail)."""

    tier: str
    every: int            # steps between the saves the tier takes
    interval_s: float     # sqrt(2 x cost_s x mtbf_s)
    cost_s: float
    cost: str             # "stall" (first tier) or "time_to_durable"
    mtbf_s: float
    mtbf_from: str        # "mtbf_hours", "events_log" or "default"
    step_s: float


def mtbf_from_events_log(path: str, now: float | None = None) -> float | None:
    """The mean time between failures the events log at ``path`` records: the time since its
    first ``opened`` event over the restarts since (``opened`` events of rank 0 after the
    first, this process's own not counted); None without a restart (or a log)."""
    opened: list[float] = []
    try:
        with open(path, "rb") as f:
            for line in f:
                if b'"opened"' not in line:
                    continue
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if (isinstance(e, dict) and e.get("kind") == "opened" and e.get("rank") == 0
                        and e.get("pid") != os.getpid()):
                    opened.append(float(e["at"]))
    except (OSError, TypeError, ValueError, KeyError):
        return None
    restarts = len(opened)  # each earlier process of the job ended; this one is the restart
    if not opened or restarts < 1:
        return None
    span = (time.time() if now is None else now) - min(opened)
    return span / restarts if span > 0 else None


class IntervalChooser:
    """Measures each tier's cost and the step time from events; chooses the intervals of the
    auto tiers (see the module docstring). One per store."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tiers: list[str] = []        # every tier's name, fastest first
        self._auto: list[str] = []         # the auto tiers' names
        self._rank = 0
        self._mtbf_s, self._mtbf_from = DEFAULT_MTBF_S, "default"
        self._stall: float | None = None   # running average of the first tier's blocking time
        self._pending_stall: float | None = None  # the newest staged stall, not yet committed
        self._durable: dict[str, float] = {}       # tier -> running average of time to durable
        self._started: dict[str, float] = {}       # checkpoint id -> its save's start
        self._step_s: float | None = None
        self._saves: list[tuple[int, float]] = []  # (step, start) of the last two saves
        self._chosen: dict[str, IntervalChoice] = {}
        self._host: Any = None

    def configure(self, tiers: list[str], auto: list[str], rank: int, host: Any,
                  mtbf_hours: float | None, events_log: str | None) -> None:
        """Set the store's tiers (fastest first), which are auto, this rank and the failure
        rate's source; called once the store has built its tiers."""
        self._tiers, self._auto, self._rank, self._host = list(tiers), list(auto), rank, host
        if mtbf_hours is not None:
            self._mtbf_s, self._mtbf_from = float(mtbf_hours) * 3600.0, "mtbf_hours"
        elif events_log and auto and rank == 0:
            found = mtbf_from_events_log(events_log)
            if found is not None:
                self._mtbf_s, self._mtbf_from = found, "events_log"

    @property
    def active(self) -> bool:
        """Whether the store has an auto tier."""
        return bool(self._auto)

    # -- measuring -----------------------------------------------------------------------------
    @hookimpl
    def tierstore_event(self, event: Event) -> None:
        if not self._auto or event.rank != self._rank:
            return
        with self._lock:
            if event.kind == EventKind.STAGED:
                self._pending_stall = event.seconds
            elif event.kind == EventKind.STEP:
                self._step_s = _average(self._step_s, event.seconds)
            elif event.kind == EventKind.COMMITTED and event.checkpoint_id:
                start = event.at - event.seconds
                self._started[event.checkpoint_id] = start
                if len(self._started) > 64:  # only recent saves are drained still
                    self._started.pop(next(iter(self._started)))
                if event.tier == (self._tiers[0] if self._tiers else None):
                    # An async save blocked for its staging; a synchronous one for all of it.
                    blocked = (self._pending_stall if self._pending_stall is not None
                               else event.seconds)
                    self._stall = _average(self._stall, blocked)
                    self._pending_stall = None
                step = (event.detail or {}).get("step")
                if isinstance(step, int) and (not self._saves or self._saves[-1][0] != step):
                    self._saves = [*self._saves[-1:], (step, start)]
            elif (event.kind == EventKind.DRAIN_FINISHED and event.tier
                  and (event.detail or {}).get("committed", True)
                  and event.checkpoint_id in self._started):
                took = event.at - self._started[event.checkpoint_id]
                self._durable[event.tier] = _average(self._durable.get(event.tier), took)

    def _step_seconds(self) -> float | None:
        if self._step_s:
            return self._step_s
        if len(self._saves) == 2:
            (s0, t0), (s1, t1) = self._saves
            if s1 > s0 and t1 > t0:
                return (t1 - t0) / (s1 - s0)
        return None

    # -- choosing (the coordinator) --------------------------------------------------------------
    def choose(self) -> dict[str, int]:
        """Each auto tier's interval in steps from what was measured so far (1 for a tier not
        measured yet); an ``interval`` event for each choice that changed."""
        out: dict[str, int] = {}
        new: list[IntervalChoice] = []
        with self._lock:
            step_s = self._step_seconds()
            for name in self._auto:
                first = self._tiers and name == self._tiers[0]
                cost = self._stall if first else self._durable.get(name)
                if cost is None or not step_s:
                    out[name] = self._chosen[name].every if name in self._chosen else 1
                    continue
                interval = young_daly_s(cost, self._mtbf_s)
                choice = IntervalChoice(
                    tier=name, every=max(1, round(interval / step_s)),
                    interval_s=round(interval, 4), cost_s=round(cost, 4),
                    cost="stall" if first else "time_to_durable",
                    mtbf_s=round(self._mtbf_s, 1), mtbf_from=self._mtbf_from,
                    step_s=round(step_s, 4))
                old = self._chosen.get(name)
                if old is not None and abs(choice.every - old.every) <= _HYSTERESIS * old.every:
                    out[name] = old.every  # within the measurements' jitter: kept
                    continue
                out[name] = choice.every
                new.append(choice)
                self._chosen[name] = choice
        for choice in new:
            if self._host is not None:
                self._host.event(Event(EventKind.INTERVAL, tier=choice.tier, rank=self._rank,
                                       detail=dataclasses.asdict(choice)))
        return out

    def chosen(self) -> dict[str, IntervalChoice]:
        """The choices in force on this (coordinating) rank, by tier."""
        with self._lock:
            return dict(self._chosen)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _NEW) * old + _NEW * new
