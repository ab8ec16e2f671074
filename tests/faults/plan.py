"""Trials and their plan: which fault strikes where, in which job.

A trial is ``ROW:FAULT:NTH:SEED[:s3]``: the job of ``SEED`` (see ``scenario``) with ``FAULT``
striking at the ``NTH`` announcement of ``ROW`` (see ``inject``), its slow tier on S3 with
``:s3``. The plan draws trials from counts of what each job announces without a fault.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass

from .inject import FAULTS

__all__ = ["OPERATIONS", "PHASE_ORDER", "Trial", "plan_cells", "row_key"]

#: Operations in the table's order (rows are ``operation/phase``).
OPERATIONS = ("save", "drain", "load", "verify", "gc")


@dataclass(frozen=True)
class Trial:
    """One fault at one point of one job (see the module docstring)."""

    row: str
    fault: str
    nth: int
    seed: int
    s3: bool = False

    @property
    def spec(self) -> str:
        """``ROW:FAULT:NTH:SEED[:s3]``, what ``--trial`` takes."""
        return f"{self.row}:{self.fault}:{self.nth}:{self.seed}" + (":s3" if self.s3 else "")

    @classmethod
    def parse(cls, spec: str) -> "Trial":
        """The trial ``spec`` names."""
        parts = spec.split(":")
        if len(parts) not in (4, 5) or (len(parts) == 5 and parts[4] != "s3") \
                or parts[1] not in FAULTS:
            raise argparse.ArgumentTypeError(
                f"{spec!r} is not ROW:FAULT:NTH:SEED[:s3] with FAULT one of {', '.join(FAULTS)}")
        return cls(parts[0], parts[1], int(parts[2]), int(parts[3]), len(parts) == 5)

    @property
    def delay(self) -> float:
        """How long a slow backend stalls in this trial (0.2 to 1 s, from the trial)."""
        return round(random.Random(self.spec).uniform(0.2, 1.0), 2)

    def command(self) -> str:
        """The shell command that runs this trial alone."""
        python = os.path.relpath(sys.executable)
        if python.startswith(".."):
            python = sys.executable
        return f"{python} -m tests.faults --trial {self.spec}"


#: Phases in the order they come in a job, for the table.
PHASE_ORDER = ("stage", "save_begin", "write_file", "write_metadata", "write_manifest",
               "drain_begin", "drain_file", "drain_commit", "publish", "retain",
               "emergency_save", "load_begin", "read_file", "verify_file", "delete_leftover")


def row_key(row: str) -> tuple:
    """Table order: by operation, then phases in the order a job meets them."""
    operation, _, phase = row.partition("/")
    op = OPERATIONS.index(operation) if operation in OPERATIONS else len(OPERATIONS)
    ph = PHASE_ORDER.index(phase) if phase in PHASE_ORDER else len(PHASE_ORDER)
    return op, operation, ph, phase


def plan_cells(counts: dict[int, dict[str, int]], faults: tuple[str, ...], per_cell: int,
               rng: random.Random, *, s3: bool, rows: list[str] | None = None) -> list[Trial]:
    """``per_cell`` trials for every (row, fault) pair: each on a job (seed) that reaches the
    row, spread over as many jobs as there are, at a random announcement of it."""
    reached: dict[str, list[tuple[int, int]]] = {}
    for seed, by_row in sorted(counts.items()):
        for row, n in by_row.items():
            if n > 0:
                reached.setdefault(row, []).append((seed, n))
    trials = []
    for row in sorted(rows if rows is not None else reached, key=row_key):
        jobs = reached.get(row, [])
        if not jobs:
            continue
        for fault in faults:
            picks = rng.sample(jobs, len(jobs))
            for k in range(per_cell):
                seed, n = picks[k % len(picks)]
                trials.append(Trial(row, fault, rng.randint(1, n), seed, s3))
    return trials
