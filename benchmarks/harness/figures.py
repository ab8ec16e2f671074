"""Figures from rounds: what each contender measured per round (:class:`Samples`), medians that
survive missing values, per-round ratios (the noise indicator beside a ratio of medians) and
one contender's JSON figures."""

from __future__ import annotations

import statistics
from typing import Iterable

from .state import GB


def median(xs: Iterable[float | None]) -> float | None:
    """Median of the values that are not None; None when there are none (JSON has no NaN)."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def ratios(num: Iterable[float], den: Iterable[float]) -> list[float]:
    """Round by round ``num / den``: the same ratio as a ratio of medians, per round (same
    round, same machine state)."""
    return [a / b for a, b in zip(num, den)]


class Samples:
    """Per contender (any name: ``"save:tierstore"``, ``"drain-t2"``), round by round: wall
    seconds, process CPU seconds and, where it varies, bytes moved."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        """Empty lists for ``names`` (others appear on their first :meth:`add`)."""
        self.seconds: dict[str, list[float]] = {n: [] for n in names}
        self.cpu: dict[str, list[float]] = {n: [] for n in self.seconds}
        self.nbytes: dict[str, list[float]] = {n: [] for n in self.seconds}

    def add(self, name: str, seconds: float, cpu: float, nbytes: float | None = None) -> None:
        """One round of ``name``."""
        self.seconds.setdefault(name, []).append(seconds)
        self.cpu.setdefault(name, []).append(cpu)
        if nbytes is not None:
            self.nbytes.setdefault(name, []).append(nbytes)

    def figures(self, name: str, payload: int | None = None) -> dict:
        """``name``'s JSON figures (:func:`timing_figures`): GB/s of ``payload`` bytes, or of
        the bytes it moved when no payload is given."""
        if payload is not None:
            return timing_figures(self.seconds[name], self.cpu[name], payload=payload)
        return timing_figures(self.seconds[name], self.cpu[name], self.nbytes[name])


def timing_figures(seconds: list[float], cpu: list[float],
                   nbytes: list[float] | None = None, payload: int | None = None) -> dict:
    """One contender's JSON figures: its rounds' wall seconds and median, GB/s of the median
    (of ``payload`` bytes, or of the median of ``nbytes``, which is then kept as ``bytes``) and
    its rounds' process CPU seconds and median."""
    med = statistics.median(seconds)
    if nbytes is None:
        return {"seconds": seconds, "median_s": med, "gbps": payload / med / GB,
                "cpu_seconds": cpu, "median_cpu_s": statistics.median(cpu)}
    moved = statistics.median(nbytes)
    return {"seconds": seconds, "median_s": med, "bytes": moved, "gbps": moved / med / GB,
            "cpu_seconds": cpu, "median_cpu_s": statistics.median(cpu)}
