"""Fault containment between tiers: a tier that fails to answer never stands between training
and the tiers that do.

Whatever can do without a tier (``latest()``, ``list()``, ``verify()`` of every tier, finding the
copies a load may read, the resumed drains' scan, gc) asks it through :meth:`TierHealth.ask`: a
failure there becomes a logged warning and an ``unreachable`` event, and the tier is skipped
until a probe in the background (``Backend.check_reachable``, every ``cooldown_s`` seconds) finds
it answering again. These calls run under the retry helper's short budget
(``tierstore.plugin.retry.foreground``): a server that cannot be connected to is given up on
after one quick retry, so a dead server costs the caller that first meets it a fraction of a
second once per outage, and nothing in the callers after it. What needs a tier (a save into it,
a drain to it) keeps the tier's full retry budget and still fails, with an error naming the
tier.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, TypeVar

from tierstore.events import Event, EventKind
from tierstore.plugin.host import PluginHost
from tierstore.plugin.retry import foreground
from tierstore.tiers.tier import Tier

__all__ = ["TierHealth"]

log = logging.getLogger("tierstore.health")

T = TypeVar("T")

#: seconds between the background probes of a tier that failed to answer
COOLDOWN_S = 30.0


class TierHealth:
    """Which tiers of one store answered lately (see the module docstring)."""

    def __init__(self, host: PluginHost, rank: int, cooldown_s: float | None = None):
        self._host, self._rank = host, rank
        self._cooldown = COOLDOWN_S if cooldown_s is None else cooldown_s
        self._lock = threading.Lock()
        # tier name -> why it is skipped (until its probe finds it answering)
        self._down: dict[str, str] = {}
        self._closed = threading.Event()

    def ask(self, tier: Tier, what: str, fn: Callable[[], T], default: T) -> T:
        """``fn()`` (which reads ``tier``), or ``default`` when the tier is skipped or fails;
        ``what`` names the operation for the warning and the event."""
        with self._lock:
            if tier.name in self._down:
                return default
        try:
            with foreground():  # a server that cannot be connected to: one quick retry
                return fn()
        except Exception as exc:  # any failure of this tier: the others go on
            self.mark_down(tier, what, f"{type(exc).__name__}: {exc}")
            return default

    def mark_down(self, tier: Tier, what: str, reason: str) -> None:
        """``tier`` failed to answer during ``what``: skip it (a warning and an
        ``unreachable`` event the first time) until its background probe finds it answering."""
        with self._lock:
            first = tier.name not in self._down
            self._down[tier.name] = reason
        if first:
            log.warning("tier '%s' (%s) did not answer during %s; going on without it "
                        "until it answers again (probed every %.0f s): %s", tier.name,
                        tier.backend.describe(), what, self._cooldown, reason)
            self._host.event(Event(EventKind.UNREACHABLE, None, tier.name, self._rank,
                                   detail={"during": what, "error": reason}))
            threading.Thread(target=self._probe, args=(tier,), daemon=True,
                             name=f"tierstore-probe-{tier.name}").start()

    def _probe(self, tier: Tier) -> None:
        """Until ``tier`` answers again (or the store closes): ask it every cooldown."""
        while not self._closed.wait(self._cooldown):
            try:
                with foreground():  # one question per cooldown, answered soon
                    problem = tier.backend.check_reachable()
            except Exception as exc:  # noqa: BLE001 - still down
                problem = f"{type(exc).__name__}: {exc}"
            if problem is None:
                with self._lock:
                    self._down.pop(tier.name, None)
                log.info("tier '%s' (%s) answers again", tier.name, tier.backend.describe())
                return

    def unreachable(self) -> dict[str, str]:
        """Tiers skipped now, with why (for reports)."""
        with self._lock:
            return dict(self._down)

    def close(self) -> None:
        """Stop probing (the store closes)."""
        self._closed.set()
