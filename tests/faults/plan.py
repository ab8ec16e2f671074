"""Trials and their plan: which fault strikes where, in which job.

A trial is ``ROW:FAULT:NTH:SEED[:s3[:obstore]][:roomN]``: the job of ``SEED`` (see ``scenario``)
with ``FAULT`` striking at the ``NTH`` announcement of ``ROW`` (see ``inject``), its slow tier on
S3 with ``:s3`` (through the ``fsspec`` backend; ``:s3:obstore``: the same bucket and options
through the ``obstore`` backend). The plan draws trials from counts of what each job announces
without a fault. ``first-full`` trials (``plan_first_full``) strike the ``NTH`` save to the
first tier, whose filesystem is left with room for that checkpoint plus ``N`` blocks
(``:room-2``: two short).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
from dataclasses import dataclass

from .inject import FAULTS, FIRST_FULL
from .scenario import S3_BACKENDS, VARIANTS, Scenario

__all__ = ["FIRST_FULL_ROW", "OPERATIONS", "PHASE_ORDER", "ROOMS", "Trial", "plan_cells",
           "plan_first_full", "row_key"]

_SPEC = re.compile(r"(?P<row>[^:]+):(?P<fault>[^:]+):(?P<nth>\d+):(?P<seed>\d+)"
                   r"(?P<s3>:s3(?::(?P<s3_backend>obstore))?)?"
                   r"(?::room(?P<room>[+-]?\d+))?(?::(?P<variant>[a-z0-9]+))?")

#: Operations in the table's order (rows are ``operation/phase``); ``scrub`` and ``promote``
#: are the operator's (the ``ops`` variant), ``node`` the multi-node trials' (``multinode``),
#: ``parity`` those of the multi-node job whose saves are protected by parity (``parity``);
#: ``backtoback``, ``auto`` and ``pins`` the race kinds' (``races``; their rows are variants),
#: ``cotenant`` and ``fuzz`` the hostile kinds' (``cotenant``, ``fuzz``).
OPERATIONS = ("save", "drain", "load", "verify", "gc", "scrub", "promote", "node", "parity",
              "backtoback", "auto", "pins", "cotenant", "fuzz")


@dataclass(frozen=True)
class Trial:
    """One fault at one point of one job (see the module docstring)."""

    row: str
    fault: str
    nth: int
    seed: int
    s3: bool = False
    #: first-full: the first tier's free space minus what the checkpoint takes, in blocks
    room: int | None = None
    #: the job's variant (scenario.VARIANTS), "" for the job as drawn
    variant: str = ""
    #: the backend of the S3 tier (scenario.S3_BACKENDS), with ``s3``
    s3_backend: str = "fsspec"

    @property
    def spec(self) -> str:
        """``ROW:FAULT:NTH:SEED[:s3[:obstore]][:roomN][:VARIANT]``, what ``--trial`` takes."""
        s3 = (":s3" + (f":{self.s3_backend}" if self.s3_backend != "fsspec" else "")
              if self.s3 else "")
        return (f"{self.row}:{self.fault}:{self.nth}:{self.seed}{s3}"
                + (f":room{self.room:+d}" if self.room is not None else "")
                + (f":{self.variant}" if self.variant else ""))

    def scenario(self) -> Scenario:
        """The job this trial runs."""
        return Scenario.from_seed(self.seed, self.s3, self.variant, s3_backend=self.s3_backend)

    @classmethod
    def parse(cls, spec: str) -> "Trial":
        """The trial ``spec`` names."""
        m = _SPEC.fullmatch(spec)
        if m is None or m["fault"] not in FAULTS or (m["fault"] == FIRST_FULL) != bool(m["room"]) \
                or (m["variant"] or "") not in ("", *VARIANTS):
            raise argparse.ArgumentTypeError(
                f"{spec!r} is not ROW:FAULT:NTH:SEED[:s3[:obstore]][:roomN][:VARIANT] with FAULT "
                f"one of {', '.join(FAULTS)} (roomN, e.g. room-2, with {FIRST_FULL} only) and "
                f"VARIANT one of {', '.join(VARIANTS)}")
        return cls(m["row"], m["fault"], int(m["nth"]), int(m["seed"]), bool(m["s3"]),
                   int(m["room"]) if m["room"] else None, m["variant"] or "",
                   m["s3_backend"] or S3_BACKENDS[0])

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
               rng: random.Random, *, s3: bool, rows: list[str] | None = None,
               variant: str = "", s3_backend: str = "fsspec") -> list[Trial]:
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
                trials.append(Trial(row, fault, rng.randint(1, n), seed, s3, variant=variant,
                                    s3_backend=s3_backend))
    return trials


#: The row first-full trials strike: a save beginning on the first tier.
FIRST_FULL_ROW = "save/save_begin"

#: Where first-full trials leave the first tier's free space: what the checkpoint takes there
#: plus this many blocks (4 KiB pages of tmpfs), from no room at all to a page to spare. The
#: job's checkpoints take five pages (a data file of three, ``.metadata``, the manifest), so
#: each of their writes is the one that finds no room at one of these points.
ROOMS = (-5, -4, -3, -2, -1, 0, 1)


def plan_first_full(seeds: list[int], per_point: int, rng: random.Random) -> list[Trial]:
    """``per_point`` first-full trials for every room of :data:`ROOMS` and every backend of the
    first tier (``memory``, ``local``): each on a job with that backend (spread over the jobs),
    at a random one of the saves that job makes to its first tier."""
    jobs: dict[str, list[tuple[int, int]]] = {}
    for seed in seeds:
        scenario = Scenario.from_seed(seed)
        saves = len(scenario.first_tier_saves())
        if saves:
            jobs.setdefault(scenario.fast_backend, []).append((seed, saves))
    trials = []
    for backend in ("memory", "local"):
        for room in ROOMS:
            picks = rng.sample(jobs.get(backend, []), len(jobs.get(backend, [])))
            for k in range(per_point if picks else 0):
                seed, saves = picks[k % len(picks)]
                trials.append(Trial(FIRST_FULL_ROW, FIRST_FULL, rng.randint(1, saves), seed,
                                    room=room))
    return trials
