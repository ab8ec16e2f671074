"""The report: markdown tables on stdout, one line per acceptance target (PASS, or FAIL/MISS,
with the per-round ratios beside it as the noise indicator), INFO lines for ratios without a
target, and the ``--json`` document (configuration, machine, run time, figures) with the exit
status ``--strict`` asks for."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any, Callable, Iterable, Sequence


def verdict(target: str, ratio: float, per_round: list[float], *, least: float | None = None,
            most: float | None = None) -> dict:
    """An acceptance target as the JSON has it: ``ratio`` must be at least ``least`` (kept as
    ``min``) or at most ``most`` (kept as ``max``); ``per_round``: the same ratio per round."""
    v: dict = {"target": target, "ratio": ratio}
    if least is not None:
        v["min"] = least
    if most is not None:
        v["max"] = most
    v["per_round"] = per_round
    v["pass"] = (least is None or ratio >= least) and (most is None or ratio <= most)
    return v


def rounds_text(seconds: Iterable[float]) -> str:
    """A table cell with every round's seconds."""
    return " ".join(f"{t:.3f}" for t in seconds)


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """The lines of a markdown table. A column name ending in ``:`` is right-aligned (the colon
    is not shown); a cell is shown with ``str``."""
    names = [c[:-1] if c.endswith(":") else c for c in columns]
    lines = ["| " + " | ".join(names) + " |",
             "|" + "".join(" ---: |" if c.endswith(":") else " --- |" for c in columns)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def print_table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """Print :func:`markdown_table`."""
    for line in markdown_table(columns, rows):
        print(line)


def print_verdicts(verdicts: list[dict], missed: str = "FAIL") -> None:
    """One line per acceptance target: PASS, or ``missed``, with the per-round ratios."""
    for v in verdicts:
        rounds = ", ".join(f"{x:.2f}" for x in v["per_round"])
        print(f"{'PASS' if v['pass'] else missed}: {v['target']}: {v['ratio']:.2f}x "
              f"(per round: {rounds})")


def print_informational(info: list[dict]) -> None:
    """One ``INFO:`` line per ratio reported without a target."""
    for v in info:
        rounds = ", ".join(f"{x:.2f}" for x in v["per_round"])
        print(f"INFO: {v['target']}: {v['ratio']:.2f}x (per round: {rounds})")


def machine() -> dict:
    """What the JSON records of the machine and the software: CPUs, platform, Python's, torch's
    and tierstore's versions."""
    import torch

    import tierstore
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "tierstore": tierstore.__version__}


def write_json(path: str, config: dict, elapsed: float, figures: dict, *, indent: int = 2,
               default: Callable[[Any], Any] | None = None) -> None:
    """The ``--json`` document: ``config``, :func:`machine`, ``elapsed_s`` and the figures'
    keys beside them (``default``: how ``json.dump`` writes what it cannot)."""
    doc = {"config": config, "machine": machine(), "elapsed_s": elapsed, **figures}
    with open(path, "w") as f:
        json.dump(doc, f, indent=indent, default=default)


def missed_any(summary: dict) -> bool:
    """Whether an acceptance target of ``summary["verdicts"]`` was missed."""
    return not all(v["pass"] for v in summary.get("verdicts", ()))


def finish_report(args: argparse.Namespace, config: dict, summary: dict, t_start: float,
                  *, path: str | None = None, **json_options: Any) -> int:
    """Print the total run time (since ``t_start``, a ``time.perf_counter()``), write the JSON
    (to ``path``, default ``--json``; see :func:`write_json`) and return the exit status
    (``--strict``: 1 when a target was missed)."""
    elapsed = time.perf_counter() - t_start
    print(f"\n(total run time {elapsed:.0f} s)", flush=True)
    path = path or getattr(args, "json", None)
    if path:
        write_json(path, config, elapsed, summary, **json_options)
    return 1 if getattr(args, "strict", False) and missed_any(summary) else 0
