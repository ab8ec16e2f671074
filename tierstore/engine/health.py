"""Fault containment between tiers: a tier that fails to answer never stands between training
and the tiers that do.

Whatever can do without a tier (``latest()``, ``list()``, ``verify()`` of every tier, finding the
copies a load may read, the resumed drains' scan, gc) asks it through :meth:`TierHealth.ask`: a
failure there becomes a logged warning and an ``unreachable`` event, and the tier is skipped for
``cooldown_s`` seconds, so a dead server costs its retries once, not at every call. What needs a
tier (a save into it, a drain to it) still fails, with an error naming the tier.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

from tierstore.events import Event, EventKind
from tierstore.plugin.host import PluginHost
from tierstore.tiers.tier import Tier

__all__ = ["TierHealth"]

log = logging.getLogger("tierstore.health")

T = TypeVar("T")

#: seconds a tier that failed to answer is skipped by what can do without it
COOLDOWN_S = 30.0


class TierHealth:
    """Which tiers of one store answered lately (see the module docstring)."""

    def __init__(self, host: PluginHost, rank: int, cooldown_s: float = COOLDOWN_S):
        self._host, self._rank, self._cooldown = host, rank, cooldown_s
        self._lock = threading.Lock()
        # tier name -> (monotonic time until which it is skipped, why)
        self._down: dict[str, tuple[float, str]] = {}

    def ask(self, tier: Tier, what: str, fn: Callable[[], T], default: T) -> T:
        """``fn()`` (which reads ``tier``), or ``default`` when the tier is skipped or fails;
        ``what`` names the operation for the warning and the event."""
        with self._lock:
            down = self._down.get(tier.name)
            if down is not None and time.monotonic() < down[0]:
                return default
        try:
            result = fn()
        except Exception as exc:  # any failure of this tier: the others go on
            reason = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._down[tier.name] = (time.monotonic() + self._cooldown, reason)
            log.warning("tier '%s' (%s) did not answer during %s; going on without it for "
                        "%.0f s: %s", tier.name, tier.backend.describe(), what, self._cooldown,
                        reason)
            self._host.event(Event(EventKind.UNREACHABLE, None, tier.name, self._rank,
                                   detail={"during": what, "error": reason}))
            return default
        with self._lock:
            self._down.pop(tier.name, None)
        return result

    def unreachable(self) -> dict[str, str]:
        """Tiers skipped now, with why (for reports)."""
        now = time.monotonic()
        with self._lock:
            return {name: why for name, (until, why) in self._down.items() if now < until}
