"""Built-in observer: per-tier figures (bytes, seconds, throughput, counts) for ``store.stats()``.

One instance per store (the core registers it when the store is built), fed by the
``tierstore_event`` hook like any third-party observer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from tierstore.plugin.host import hookimpl
from tierstore.events import Event, EventKind


@dataclass
class TierFigures:
    """What one tier did in this process since the store was opened (plain data)."""

    saves: int = 0                 # checkpoints committed here by a save
    bytes_saved: int = 0
    seconds_saving: float = 0.0    # from writer.reset to commit
    drains: int = 0                # checkpoints copied here from a faster tier
    bytes_drained: int = 0
    seconds_draining: float = 0.0
    loads: int = 0
    bytes_loaded: int = 0
    seconds_loading: float = 0.0
    fallbacks: int = 0             # files read from here because a faster copy was bad
    evictions: int = 0             # checkpoints deleted by keep
    failures: int = 0

    @property
    def save_throughput(self) -> float:
        """Bytes per second of saves (0 before the first)."""
        return self.bytes_saved / self.seconds_saving if self.seconds_saving else 0.0

    @property
    def drain_throughput(self) -> float:
        """Bytes per second of drains into this tier (0 before the first)."""
        return self.bytes_drained / self.seconds_draining if self.seconds_draining else 0.0

    @property
    def load_throughput(self) -> float:
        """Bytes per second of loads from this tier (0 before the first)."""
        return self.bytes_loaded / self.seconds_loading if self.seconds_loading else 0.0

    def __str__(self) -> str:
        parts = []
        if self.saves:
            parts.append(f"{self.saves} saves, {self.bytes_saved / 1e6:.1f} MB at "
                         f"{self.save_throughput / 1e9:.2f} GB/s")
        if self.drains:
            parts.append(f"{self.drains} drained in, {self.bytes_drained / 1e6:.1f} MB at "
                         f"{self.drain_throughput / 1e9:.2f} GB/s")
        if self.loads:
            parts.append(f"{self.loads} loads at {self.load_throughput / 1e9:.2f} GB/s")
        for name in ("fallbacks", "evictions", "failures"):
            if getattr(self, name):
                parts.append(f"{getattr(self, name)} {name}")
        return "; ".join(parts) or "idle"


class TierStats:
    """The observer: figures by tier name."""

    def __init__(self) -> None:
        self.figures: dict[str, TierFigures] = {}
        self._lock = threading.Lock()

    # First among observers: store.stats() is already current inside the others.
    @hookimpl(tryfirst=True)
    def tierstore_event(self, event: Event) -> None:
        if event.tier is None:
            return
        with self._lock:
            f = self.figures.setdefault(event.tier, TierFigures())
            if event.kind == EventKind.COMMITTED:
                f.saves += 1
                f.bytes_saved += event.nbytes
                f.seconds_saving += event.seconds
            elif event.kind == EventKind.DRAIN_FINISHED:
                f.drains += 1
                f.bytes_drained += event.nbytes
                f.seconds_draining += event.seconds
            elif event.kind == EventKind.LOADED:
                f.loads += 1
                f.bytes_loaded += event.nbytes
                f.seconds_loading += event.seconds
            elif event.kind == EventKind.FELL_BACK:
                f.fallbacks += 1
            elif event.kind == EventKind.EVICTED:
                f.evictions += 1
            elif event.kind == EventKind.FAILED:
                f.failures += 1

    def snapshot(self, tier_names: list[str]) -> dict[str, TierFigures]:
        """A copy of the figures, one entry per tier (in the given order)."""
        with self._lock:
            return {name: replace(self.figures.get(name, TierFigures())) for name in tier_names}
