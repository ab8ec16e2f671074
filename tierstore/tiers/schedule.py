"""Which saves a tier takes: ``every = N`` (steps that are multiples of N) or ``every = "auto"``
(an interval in steps chosen as the job runs, by tierstore.engine.interval).

An auto tier takes a save when at least ``every`` steps have passed since the last save it took
(the first save always). Every rank must decide alike without talking, so the decision depends
only on what every rank has seen in the same order: the steps of the saves asked for, and the
interval the coordinator chose and sent with the plan of an earlier save (:meth:`adopt`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["AutoSchedule"]


@dataclass
class AutoSchedule:
    """The state of one ``every = "auto"`` tier in this process (plain data).

    ``every``: the interval in steps now in force (1 until the first choice arrives);
    ``last_taken``: the step of the last save this tier took (None: none yet)."""

    every: int = 1
    last_taken: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def due(self, step: int) -> bool:
        """Whether the save of ``step`` would go to this tier (changes nothing)."""
        last = self.last_taken
        return last is None or step == last or step - last >= self.every

    def takes(self, step: int) -> bool:
        """Whether the save of ``step`` goes to this tier; a new step taken becomes the last
        one. Asking again for the same step gives the same answer; an older step (a drain
        resumed after a restart) is not taken."""
        with self._lock:
            if not self.due(step):
                return False
            if self.last_taken is None or step > self.last_taken:
                self.last_taken = step
            return True

    def adopt(self, every: int) -> None:
        """Put the coordinator's newest choice in force, for the saves after this one."""
        with self._lock:
            self.every = max(1, int(every))
