"""Rounds: the contenders of a round run one after another in an order that turns round from
round to round, so that what else loads a shared machine falls on each of them alike, and
untimed warm-up rounds come first, so that first-call costs land on none of the timed ones."""

from __future__ import annotations

import argparse
from typing import Callable, Sequence, TypeVar

R = TypeVar("R")
T = TypeVar("T")


def rotated(items: Sequence[T], k: int) -> list[T]:
    """``items`` in round-robin order starting at index ``k`` (mod len)."""
    k %= len(items)
    return list(items[k:]) + list(items[:k])


def warmup_then_rounds(args: argparse.Namespace, log: Callable[[str], None],
                       new_results: Callable[[], R],
                       one_round: Callable[[int, bool, R, Callable[[str], None]], None],
                       res: R | None = None) -> R:
    """``--warmup`` untimed rounds (each into fresh results, thrown away, without progress
    lines), then ``--repeat`` timed rounds into ``res`` (default: fresh results), which is
    returned. ``one_round(rnd, warm, results, log)`` runs round ``rnd`` (counted from 0 in
    each phase)."""
    for w in range(args.warmup):
        log(f"warm-up round {w + 1} (not counted)")
        one_round(w, True, new_results(), lambda _m: None)
    res = new_results() if res is None else res
    for rnd in range(args.repeat):
        one_round(rnd, False, res, log)
    return res
