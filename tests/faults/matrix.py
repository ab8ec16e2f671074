"""The fault matrix: plan trials, run them on forked workers, print the table.

A trial is ``ROW:FAULT:NTH:SEED[:s3[:obstore]][:roomN][:VARIANT]`` (see ``plan``;
``node/PHASE@RANK`` rows are the multi-node trials, see ``multinode``): the job of ``SEED`` with
``FAULT`` striking at the ``NTH`` announcement of ``ROW``, its slow tier on S3 with ``:s3``
(through the ``fsspec`` backend; ``:s3:obstore``: the same bucket, options and retries through
the ``obstore`` backend; the trials with an S3 tier run on both, ``--s3-backends``), the first
tier's free space that checkpoint's size plus ``N`` pages with ``first-full``. Planning
first runs each candidate job once without a fault and counts what every row announces, so
each trial names a point the job really reaches; the job is deterministic (the order of files
within one checkpoint aside, which its threads decide). A failing trial prints the command
that runs it again alone.

    python -m tests.faults                      # the whole matrix (make faults)
    python -m tests.faults --sample             # the CI sample
    python -m tests.faults --trial save/write_file:sigkill:6:100037
    python -m tests.faults --faults first-full --no-s3   # the almost full first tier only
    python -m tests.faults --kinds keep1,spoil,cli,stall,ops,ops-s3,multinode  # issue 25's
    python -m tests.faults --kinds classic,ops-s3 --s3-only --s3-backends obstore  # S3, obstore
    python -m tests.faults --trial scrub/verify_file:flaky:1:170001:s3:obstore:ops
    python -m tests.faults --trial node/write_metadata@0:sigkill:3:1   # a multi-node trial
    python -m tests.faults --kinds backtoback,auto,pins --race-trials 300   # the race kinds
    python -m tests.faults --trial backtoback/3x2-sync:race:1:190001        # one race trial
    python -m tests.faults --kinds cotenant,fuzz --race-trials 300   # the hostile kinds
    python -m tests.faults --trial fuzz/manifest-signed:fuzz:1:197002       # one hostile trial
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from pathlib import Path
from typing import Any

import prewarm
import torch

import tierstore

from .checks import check
from .cotenant import COTENANT_FAULT, plan_cotenant, run_cotenant_trial
from .cotenant import row_of as cotenant_row
from .fuzz import FUZZ_FAULT, plan_fuzz, run_fuzz_trial
from .fuzz import row_of as fuzz_row
from .inject import FAULTS, FIRST_FULL, FULL_FAULTS, Injector
from .multinode import dry_counts, plan_multinode, plan_parity, run_chain
from .places import Env, mount_tmpfs, server_module, unmount
from .plan import Trial, plan_cells, plan_first_full, row_key
from .procs import ChildResult, run_child, run_pool
from .races import RACE_FAULT, RACE_KINDS, kind_of_trial, plan_races, row_of, run_races
from .scenario import S3_BACKENDS, Place, Scenario
from .table import table
from .workload import Journal, checkpoint_sizes, run_job

__all__ = ["HOSTILE_KINDS", "Matrix", "main", "run_trial"]

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

#: Faults that strike every row on local tiers; tmpfs-full needs root (mount).
LOCAL_FAULTS = ("raise", "sigkill", "enospc", "tmpfs-full", "eio", "slow")
#: Faults tried on the S3 tier's drains; server-death only there.
S3_FAULTS = ("raise", "sigkill", "eio", "slow")
#: The kinds of trials (``--kinds``): the matrix as it was (``classic``), and issue 25's:
#: ``keep1`` (every fault at every row, ``keep = 1`` on every tier), ``spoil`` (a drain's source
#: file corrupted or removed under it), ``cli`` (``tierstore ls/status/verify`` beside a live
#: drain), ``stall`` (a drain's retention stalled on the slow tier while the job saves), ``ops``
#: (``scrub --repair`` and ``promote`` under every fault, on a local slow tier) and ``ops-s3``
#: (the same against an S3 server that fails, is slow, freezes or dies).
#: ``multinode``: 2 simulated nodes x 2 ranks under torchrun (see ``multinode``); ``parity``:
#: the same job with its saves protected by parity (``erasure`` 3+1), killed while encoding.
#: The race kinds (no fault: the library's own concurrency, see ``races``): ``backtoback``
#: (node-local RAM and disk per node, saves back to back), ``auto`` (``every = "auto"``, with
#: and without ``overwrite``) and ``pins`` (pin/unpin/promote racing drains and ``keep``).
#: The hostile kinds (security bugs; modules ``cotenant`` and ``fuzz``): ``cotenant`` (a second
#: user plants links and directories under the tier roots while a job runs) and ``fuzz`` (one
#: field of a committed checkpoint's manifest or ``.metadata`` replaced); ``--race-trials`` of
#: each, on the workers.
#: The CI sample leaves them out (tests/test_fault_matrix.py runs a few of each on their own).
HOSTILE_KINDS = ("cotenant", "fuzz")
KINDS = ("classic", "keep1", "spoil", "cli", "stall", "ops", "ops-s3", "dedup", "multinode",
         "parity", *RACE_KINDS, *HOSTILE_KINDS)
#: The multi-node trials of the CI sample: the coordinator killed in ``finish`` (before its
#: ``.metadata``, the other node's part already published), and a gathered drain whose
#: source part on the other node goes bad under it.
MULTINODE_SAMPLE = ("node/write_metadata@0:sigkill:3:1", "node/drain_file@2:corrupt-source:2:2")
#: The parity trial of the CI sample: a member killed as its parity of the second save is
#: published (the others' committed); ``make faults`` strikes every rank at every point.
PARITY_SAMPLE = ("parity/publish@1:sigkill:2:1",)
#: Faults of the ``ops-s3`` trials.
OPS_S3_FAULTS = ("raise", "eio", "slow", "flaky", "server-death")
#: The trials with an S3 tier (the object-store kinds: ``classic``'s drains and server deaths,
#: ``ops-s3``) in the CI sample, by kind and S3 backend: the faults struck, one trial each
#: (``classic`` on ``fsspec``: ``--s3-trials`` drawn at random, and one server death). The other
#: backends strike the same jobs at the same points as ``fsspec`` where its plan has them: a
#: drain slowed while it copies a file, the server killed under a drain, and frozen under
#: scrub or promote.
S3_SAMPLE = {("ops-s3", "fsspec"): ("flaky", "server-death"),
             ("classic", "obstore"): ("slow", "server-death"), ("ops-s3", "obstore"): ("flaky",)}
#: Where the sample's ``slow`` trial on the other S3 backends strikes, when the plan has it.
S3_SAMPLE_SLOW_ROW = "drain/drain_file"
#: Drain rows where a ``cli`` trial holds the drain (no copy thread is running then).
CLI_ROWS = ("drain/drain_begin", "drain/drain_commit", "drain/publish", "drain/retain")
#: The race trials of the CI sample, per kind (backtoback: 2 nodes x 1 rank only): each kind one
#: launch of jobs and one of their checks.
RACE_SAMPLE = 3
#: Seconds one forked step of a trial may take before it counts as hung.
CHILD_TIMEOUT = 120.0


# -- one trial ---------------------------------------------------------------------------------

def _prepare(scenario: Scenario, place: Place) -> ChildResult:
    """The first process of a restarted job: saves up to ``restart_after``, killed in it."""
    def job():
        injector = Injector(scenario.prepare_kill, 1, "sigkill",
                            checkpoint_id=f"step-{scenario.restart_after}")
        run_job(scenario, place, injector, prepare=True)
        return None

    return run_child(job, log_path=place.log, timeout=CHILD_TIMEOUT)


def dry_run(seed: int, s3: bool, env: Env, variant: str = "",
            s3_backend: str = S3_BACKENDS[0]) -> dict[str, int]:
    """How many times each row is announced in the job of ``seed`` without a fault."""
    trial = Trial("dry", "raise", 0, seed, s3, variant=variant, s3_backend=s3_backend)
    scenario = trial.scenario()
    place = env.place_for(trial, f"dry-{seed}{f'-s3-{s3_backend}' if s3 else ''}{variant}-"
                                 f"{uuid.uuid4().hex[:6]}")
    try:
        if scenario.restart_after:
            _prepare(scenario, place)

        def job():
            injector = Injector()
            run_job(scenario, place, injector, prepare=False)
            return injector.counts

        result = run_child(job, log_path=place.log, timeout=CHILD_TIMEOUT)
        if result.value is None:
            raise RuntimeError(f"the job of seed {seed} without a fault {result.describe()}; "
                               f"see {place.log}")
        return result.value
    finally:
        env.clean()


def run_trial(trial: Trial, env: Env, name: str) -> dict[str, Any]:
    """Run ``trial``: the job with the fault (after its first process, if restarted), then the
    checks in a fresh process. Returns its outcome (JSON-ready)."""
    started = time.monotonic()
    scenario = trial.scenario()
    place = env.place_for(trial, name)
    violations: list[str] = []
    if env.server is not None and trial.s3 and not env.server.running():
        env.server.restart()
    if scenario.restart_after:
        first = _prepare(scenario, place)
        if not (first.killed or first.code == 0):
            violations.append(f"the job's first process {first.describe()}")

    sizes = None
    if trial.fault == FIRST_FULL:  # what each checkpoint takes on the first tier's tmpfs
        measured = run_child(lambda: checkpoint_sizes(scenario, place.fast + "-measure"),
                             log_path=place.log, timeout=CHILD_TIMEOUT)
        sizes = measured.value
        if sizes is None:
            violations.append(f"measuring the checkpoints {measured.describe()}")

    def job():
        first_full = trial.fault == FIRST_FULL
        injector = Injector(trial.row, trial.nth, trial.fault, delay=trial.delay,
                            mount=place.mount, server_pid=place.server_pid,
                            tier="fast" if first_full else "slow" if trial.fault == "stall"
                            else None, sizes=sizes,
                            room=trial.room or 0)
        run_job(scenario, place, injector, prepare=False)
        return injector.fired

    timings = {"first_s": time.monotonic() - started}
    faulty = run_child(job, log_path=place.log, timeout=CHILD_TIMEOUT)
    timings["job_s"] = time.monotonic() - started - sum(timings.values())
    journal = Journal.read(place.journal)
    fired = any(kind == "fired" for kind, _ in journal)
    if trial.fault == "flaky" and place.server_pid is not None:
        try:  # in case the job ended before its thread woke the server
            os.kill(place.server_pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    if trial.fault == "server-death":
        env.server.restart()  # the operator brings it back before anyone looks
        timings["restart_s"] = time.monotonic() - started - sum(timings.values())
    if not fired:
        violations.append(f"the fault point was never reached (the job {faulty.describe()})")
    elif trial.fault == "sigkill":
        if not faulty.killed:
            violations.append(f"the job was to die of SIGKILL but {faulty.describe()}")
    elif faulty.code != 0:
        violations.append(f"the job {faulty.describe()} after the fault (see {place.log})")
    violations += [f"a load in the job returned other data: {rest}"
                   for kind, rest in journal if kind == "wrong"]
    if trial.fault == "slow":
        violations += [f"a slow backend failed a step: {rest}"
                       for kind, rest in journal if kind == "error"]
    violations += [rest for kind, rest in journal if kind == "broken"]
    if trial.fault == "stall":
        violations += stalled_saves(journal)
        if fired and not any(kind == "stalled" for kind, _ in journal):
            violations.append("the stall was armed but the slow tier's retention evicted "
                              "nothing after it (a bug of the plan: pick another nth)")
    checked = run_child(lambda: check(scenario, place, trial), log_path=place.log,
                        timeout=CHILD_TIMEOUT)
    timings["check_s"] = time.monotonic() - started - sum(timings.values())
    notes: list[str] = []
    if checked.value is None:
        violations.append(f"the check {checked.describe()} (see {place.log})")
    else:
        violations += checked.value["violations"]
        notes = checked.value["notes"]
    passed = not violations
    outcome = {"spec": trial.spec, "row": trial.row, "fault": trial.fault, "s3": trial.s3,
               "s3_backend": trial.s3_backend if trial.s3 else None,
               "room": trial.room, "variant": trial.variant, "backend": scenario.fast_backend,
               "passed": passed, "violations": violations, "notes": notes,
               "scenario": scenario.describe(), "seconds": round(time.monotonic() - started, 3),
               "timings": {k: round(v, 3) for k, v in timings.items()},
               "dir": os.path.dirname(place.journal)}
    if passed:
        env.clean()
    else:
        env.keep_failed(place)
    return outcome


def stalled_saves(journal: list[tuple[str, str]]) -> list[str]:
    """The saves that waited for a drain's retention stalled on the slow tier: begun while it
    stalled, at least a second before it ended, returned only once it had ended, and took 1.5 s
    or more (a save of these states takes a fraction of that)."""
    out = []
    for kind, rest in journal:
        if kind != "stalled":
            continue
        start, end = map(float, rest.split()[:2])
        for k, r in journal:
            if k == "timed":
                cid, t0, t1 = r.split()[:3]
                if start <= float(t0) <= end - 1.0 and float(t1) >= end - 0.05 \
                        and float(t1) - float(t0) >= 1.5:
                    out.append(f"the save of {cid} waited {float(t1) - float(t0):.1f} s for a "
                               f"drain's retention stalled on the slow tier "
                               f"({end - start:.1f} s)")
    return out


def failure(trial: Trial, error: str) -> dict[str, Any]:
    """The outcome of a trial the harness itself failed to run (``error``: a traceback)."""
    return {"spec": trial.spec, "row": trial.row, "fault": trial.fault, "s3": trial.s3,
            "s3_backend": trial.s3_backend if trial.s3 else None, "variant": trial.variant,
            "passed": False, "violations": [f"the harness failed: {error}"], "notes": [],
            "scenario": trial.scenario().describe(), "seconds": 0,
            "timings": {}, "dir": None}


# -- running -----------------------------------------------------------------------------------

class Matrix:
    """Runs a planned matrix: local trials on forked workers, S3 trials one by one."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.workdir = tempfile.mkdtemp(prefix="tierstore-faults-")
        self.shm = tempfile.mkdtemp(prefix="tierstore-faults-", dir="/dev/shm")
        self.skipped: list[str] = []
        self.server = None
        self.bucket = None
        #: dry runs' counts with an S3 tier, by (seeds, variant, backend)
        self._s3_counts: dict[tuple, dict[int, dict[str, int]]] = {}

    def env(self, worker: int | str, *, tmpfs: bool) -> Env:
        """A fresh Env (with its own tmpfs when asked and possible)."""
        mount = mount_tmpfs(os.path.join(self.workdir, f"tmpfs-{worker}")) if tmpfs else None
        return Env(os.path.join(self.workdir, str(worker)), os.path.join(self.shm, str(worker)),
                   mount, self.server, self.bucket, self.args.keep)

    def say(self, text: str) -> None:
        """Progress, on stderr."""
        print(text, file=sys.stderr, flush=True)

    def pool(self, count: int, fn, *, tmpfs: bool, label: str) -> list[Any]:
        """``fn(i, env)`` for i in range(count) on the workers."""
        done = [0]
        started = time.monotonic()

        def report(index, result):
            done[0] += 1
            if isinstance(result, dict) and result.get("passed") is False:
                self.say(f"FAILED {result['spec']}: {result['violations'][0]}")
            if done[0] % 100 == 0 or done[0] == count:
                self.say(f"{label}: {done[0]}/{count} ({time.monotonic() - started:.0f} s)")

        def setup(worker):
            env = self.env(worker, tmpfs=tmpfs)
            os.makedirs(env.workdir, exist_ok=True)
            os.makedirs(env.shm, exist_ok=True)
            return env

        return run_pool(count, fn, jobs=self.args.jobs, setup=setup,
                        teardown=lambda env: env and unmount(env.mount), on_result=report)

    def counted(self, seeds: list[int], variant: str) -> dict[int, dict[str, int]]:
        """What each job of ``seeds`` (with ``variant``) announces, from dry runs."""
        counts = self.pool(len(seeds), lambda i, env: dry_run(seeds[i], False, env, variant),
                           tmpfs=False, label=f"counting fault points {variant}".strip())
        broken = [f"seed {seed}: {c['error']}" for seed, c in zip(seeds, counts) if "error" in c]
        if broken:  # a job without any fault failed: nothing else can be trusted
            raise SystemExit(f"the job ({variant or 'as drawn'}) failed without a fault:\n"
                             + "\n".join(broken))
        return dict(zip(seeds, counts))

    def new_trials(self, local_faults: list[str]) -> list[Trial]:
        """Plan the trials of issue 25's kinds on memory/local tiers (see :data:`KINDS`)."""
        a, kinds, trials = self.args, self.args.kinds, []
        base = a.seed * 100_000
        n = max(2, a.seeds // 4)
        keep1 = self.counted([base + 20_000 + i for i in range(n)], "keep1") \
            if {"keep1", "spoil"} & set(kinds) else {}
        if "keep1" in kinds:
            trials += plan_cells(keep1, tuple(local_faults), a.new_per_cell,
                                 random.Random(f"{a.seed}-keep1"), s3=False, variant="keep1")
        if "spoil" in kinds:
            rng = random.Random(f"{a.seed}-spoil")
            drawn = self.counted([base + 30_000 + i for i in range(n)], "")
            for variant, counts in (("", drawn), ("keep1", keep1)):
                trials += plan_cells(counts, ("corrupt-source", "vanish-source"),
                                     a.new_per_cell * 4, rng, s3=False,
                                     rows=["drain/drain_file"], variant=variant)
        if "cli" in kinds:
            counts = self.counted([base + 40_000 + i for i in range(n)], "cli")
            trials += plan_cells(counts, ("cli",), a.new_per_cell * 2,
                                 random.Random(f"{a.seed}-cli"), s3=False, rows=list(CLI_ROWS),
                                 variant="cli")
        if "stall" in kinds:
            rng = random.Random(f"{a.seed}-stall")
            # (the first retention on the slow tier has nothing to evict yet)
            trials += [Trial("drain/retain", "stall", rng.randint(2, 4),
                             base + 50_000 + i % n, variant="stall")
                       for i in range(a.new_per_cell * 4)]
        if "ops" in kinds:
            counts = self.counted([base + 60_000 + i for i in range(n)], "ops")
            rows = sorted({r for c in counts.values() for r in c
                           if r.startswith(("scrub/", "promote/"))}, key=row_key)
            trials += plan_cells(counts, tuple(local_faults), a.new_per_cell,
                                 random.Random(f"{a.seed}-ops"), s3=False, rows=rows,
                                 variant="ops")
        if "dedup" in kinds:
            counts = self.counted([base + 80_000 + i for i in range(n)], "dedup")
            trials += plan_cells(counts, tuple(local_faults), a.new_per_cell,
                                 random.Random(f"{a.seed}-dedup"), s3=False, variant="dedup")
        trials = [t for t in trials if t.fault in a.faults]
        if a.sample:  # the CI sample: two trials of each new kind
            rng, by_kind = random.Random(f"{a.seed}-sample"), {}
            for t in rng.sample(trials, len(trials)):
                by_kind.setdefault((t.variant, t.fault), []).append(t)
            trials = [t for group in by_kind.values() for t in group[:2]]
        return trials

    def local_trials(self) -> list[Trial]:
        """Plan the trials on memory/local tiers."""
        seeds = [self.args.seed * 100_000 + i for i in range(self.args.seeds)]
        faults = [f for f in (*LOCAL_FAULTS, FIRST_FULL) if f in self.args.faults]
        needs_root = [f for f in faults if f in FULL_FAULTS]
        if needs_root:
            probe = mount_tmpfs(os.path.join(self.workdir, "tmpfs-probe"))
            unmount(probe)
            if probe is None:
                faults = [f for f in faults if f not in needs_root]
                self.skipped += [f"{f} (mounting a tmpfs needs root)" for f in needs_root]
        cells = tuple(f for f in faults if f != FIRST_FULL)
        trials = self.new_trials([f for f in cells])
        if "classic" not in self.args.kinds:
            return trials
        if cells:
            counts = self.pool(len(seeds), lambda i, env: dry_run(seeds[i], False, env),
                               tmpfs=False, label="counting fault points")
            broken = [f"seed {seed}: {c['error']}" for seed, c in zip(seeds, counts)
                      if "error" in c]
            if broken:  # a job without any fault failed: nothing else can be trusted
                raise SystemExit("the job failed without a fault:\n" + "\n".join(broken))
            rng = random.Random(self.args.seed)
            trials += plan_cells(dict(zip(seeds, counts)), cells, self.args.per_cell, rng,
                                 s3=False)
        if FIRST_FULL in faults:
            trials += plan_first_full(seeds, self.args.per_cell,
                                      random.Random(f"{self.args.seed}-{FIRST_FULL}"))
        return trials

    def start_server(self) -> None:
        """Start SeaweedFS and make the bucket (in a child: the parent never talks S3)."""
        self.server = server_module().SeaweedS3().start()
        self.bucket = f"faults-{uuid.uuid4().hex[:8]}"
        server, bucket = self.server, self.bucket
        made = run_child(lambda: server.make_bucket(bucket),
                         log_path=os.path.join(self.workdir, "bucket.log"), timeout=60)
        if made.value is None:
            raise RuntimeError(f"could not create the bucket: {made.describe()}")

    def s3_backends(self) -> list[str]:
        """The S3 backends asked for (``--s3-backends``) that can run here; the others are
        said to be skipped (obstore is an optional extra)."""
        out = []
        for backend in self.args.s3_backends:
            if backend == "obstore" and importlib.util.find_spec("obstore") is None:
                self.skipped.append("the S3 trials on the obstore backend (obstore is not "
                                    "installed: pip install 'tierstore[obstore]')")
                continue
            out.append(backend)
        return out

    def s3_counts(self, seeds: list[int], variant: str,
                  backend: str) -> dict[int, dict[str, int]]:
        """What each job of ``seeds`` (with ``variant``) announces with its slow tier on S3
        through ``backend``, from dry runs (one by one: the server is shared). The CI sample
        counts on the first backend only and strikes the others at the same points: the rows
        are the core's announcements, and the whole matrix counts on each backend."""
        if self.args.sample:
            backend = S3_BACKENDS[0]
        key = (tuple(seeds), variant, backend)
        if key not in self._s3_counts:
            env = self.env("s3", tmpfs=False)
            self._s3_counts[key] = {s: dry_run(s, True, env, variant, backend) for s in seeds}
        return self._s3_counts[key]

    def s3_trials(self) -> list[Trial]:
        """Plan the trials with an S3 tier, on every S3 backend asked for: drains only, a few
        server deaths; then scrub and promote against it (``ops-s3``). Each backend draws
        with the same random numbers: where the jobs announce the same rows, its trials are the
        first backend's, on another client."""
        trials = []
        for backend in self.s3_backends():
            if "classic" in self.args.kinds:
                trials += self.classic_s3_trials(backend)
            if "ops-s3" in self.args.kinds:
                trials += self.ops_s3_trials(backend)
            if "dedup" in self.args.kinds:
                trials += self.dedup_s3_trials(backend)
        return trials

    def dedup_s3_trials(self, backend: str) -> list[Trial]:
        """``dedup`` with its slow tier on S3 through ``backend``: every S3 fault at every row
        of the job (saves, drains, keep and gc with chunks shared between checkpoints)."""
        seeds = [self.args.seed * 100_000 + 85_000 + i for i in range(self.args.s3_seeds)]
        counts = self.s3_counts(seeds, "dedup", backend)
        faults = tuple(f for f in S3_FAULTS if f in self.args.faults)
        trials = plan_cells(counts, faults, self.args.s3_per_cell,
                            random.Random(f"{self.args.seed}-dedup-s3"), s3=True,
                            variant="dedup", s3_backend=backend)
        if self.args.sample:  # the CI sample: one trial of each fault, on the first backend
            trials = [next(t for t in trials if t.fault == f) for f in faults
                      if backend == S3_BACKENDS[0] and any(t.fault == f for t in trials)]
        return trials

    def ops_s3_trials(self, backend: str) -> list[Trial]:
        """``ops-s3``: scrub and promote under every fault of :data:`OPS_S3_FAULTS` against
        the S3 tier through ``backend``."""
        seeds = [self.args.seed * 100_000 + 70_000 + i for i in range(self.args.s3_seeds)]
        counts = self.s3_counts(seeds, "ops", backend)
        rows = sorted({r for c in counts.values() for r in c
                       if r.startswith(("scrub/", "promote/"))}, key=row_key)
        faults = tuple(f for f in OPS_S3_FAULTS if f in self.args.faults)
        ops = plan_cells(counts, faults, self.args.s3_per_cell,
                         random.Random(f"{self.args.seed}-ops-s3"), s3=True, rows=rows,
                         variant="ops", s3_backend=backend)
        if self.args.sample:  # the CI sample: the server frozen (and killed) once each
            ops = [next(t for t in ops if t.fault == f)
                   for f in S3_SAMPLE[("ops-s3", backend)] if any(t.fault == f for t in ops)]
        return ops

    def classic_s3_trials(self, backend: str) -> list[Trial]:
        """The S3 trials of the matrix as it was, through ``backend``: drains under every
        fault, and the server killed under a few."""
        seeds = [self.args.seed * 100_000 + 50_000 + i for i in range(self.args.s3_seeds)]
        counts = self.s3_counts(seeds, "", backend)
        drain_rows = sorted({r for c in counts.values() for r in c if r.startswith("drain/")},
                            key=row_key)
        rng = random.Random(self.args.seed + 1)
        faults = tuple(f for f in S3_FAULTS if f in self.args.faults)
        planned = plan_cells(counts, faults, self.args.s3_per_cell, rng, s3=True,
                             rows=drain_rows, s3_backend=backend)
        trials = planned
        if self.args.s3_trials is not None:
            trials = rng.sample(planned, min(len(planned), self.args.s3_trials))
        deaths = []
        if "server-death" in self.args.faults:
            deaths = plan_cells(counts, ("server-death",), 1, rng, s3=True, rows=drain_rows,
                                s3_backend=backend)[:self.args.server_deaths]
        if self.args.sample and ("classic", backend) in S3_SAMPLE:
            # one trial of each fault the sample names, from the first backend's plan
            pool = sorted(planned, key=lambda t: t.row != S3_SAMPLE_SLOW_ROW) + deaths
            return [next(t for t in pool if t.fault == f)
                    for f in S3_SAMPLE[("classic", backend)] if any(t.fault == f for t in pool)]
        return trials + deaths

    def run_local(self) -> list[dict[str, Any]]:
        """Plan and run the trials on memory/local tiers, on the workers."""
        trials = self.local_trials()
        self.say(f"{len(trials)} trials on memory/local tiers")
        results = self.pool(len(trials), lambda i, env: run_trial(trials[i], env, f"t{i}"),
                            tmpfs=any(t.fault in FULL_FAULTS for t in trials), label="trials")
        return [failure(t, r["error"]) if "error" in r else r for t, r in zip(trials, results)]

    def run_s3(self) -> list[dict[str, Any]]:
        """Start the server, plan and run the trials with an S3 tier, one after the other
        (a server death must not strike a neighbour's trial)."""
        self.start_server()
        trials = self.s3_trials()
        self.say(f"{len(trials)} trials with an S3 tier")
        env = self.env("s3", tmpfs=False)
        results = []
        for i, trial in enumerate(trials):
            try:
                results.append(run_trial(trial, env, f"s{i}"))
            except Exception:  # noqa: BLE001 - a bug of the harness, reported as the trial's
                results.append(failure(trial, traceback.format_exc()))
            if not results[-1]["passed"]:
                self.say(f"FAILED {trial.spec}: {results[-1]['violations'][0]}")
        self.say(f"S3 trials: {len(trials)}/{len(trials)}")
        return results

    def run_multinode(self, parity: bool = False) -> list[dict[str, Any]]:
        """Plan and run the multi-node trials (torchrun, one chain of launches); with
        ``parity``, those of the job whose saves are protected by parity."""
        a = self.args
        kind = "parity" if parity else "multinode"
        workdir = os.path.join(self.workdir, kind)
        os.makedirs(workdir, exist_ok=True)
        if a.sample:
            trials = [Trial.parse(spec) for spec in (PARITY_SAMPLE if parity
                                                     else MULTINODE_SAMPLE)]
        else:
            seeds = [a.seed * 100_000 + 80_000 + i for i in range(a.multinode_seeds)]
            counts = {s: dry_counts(workdir, s, parity) for s in seeds}
            trials = (plan_parity if parity else plan_multinode)(
                counts, a.multinode_per_cell, random.Random(f"{a.seed}-{kind}"))
        trials = [t for t in trials if t.fault in a.faults]
        self.say(f"{len(trials)} {kind} trials (2 nodes x 2 ranks, torchrun)")
        results = run_chain(trials, workdir, say=self.say)
        for r in results:
            if not r["passed"]:
                self.say(f"FAILED {r['spec']}: {r['violations'][0]}")
        return results

    def run_races(self, trials: list[Trial] | None = None) -> list[dict[str, Any]]:
        """Plan and run the race kinds' trials (``races``): ``--race-trials`` of each kind
        asked for, in launches of ``--race-batch``."""
        a = self.args
        if trials is None:
            trials = []
            for kind in RACE_KINDS:
                if kind in a.kinds:
                    trials += plan_races(kind, a.race_trials, a.seed,
                                         shapes=((2, 1),) if a.sample and kind == "backtoback"
                                         else None)
        kinds = [k for k in RACE_KINDS if any(kind_of_trial(t) == k for t in trials)]
        self.say(f"{len(trials)} race trials ({', '.join(kinds)}; {a.race_batch} per launch)")
        started = time.monotonic()
        results = run_races(trials, os.path.join(self.workdir, "races"),
                            os.path.join(self.shm, "races"), batch=a.race_batch, say=self.say,
                            keep=a.keep)
        for r in results:
            if not r["passed"]:
                self.say(f"FAILED {r['spec']}: {r['violations'][0]}")
        by_kind: dict[str, list[float]] = {}
        for r in results:
            by_kind.setdefault(r["row"].split("/")[0], []).append(r["seconds"])
        self.say(f"race trials: {len(results)} in {time.monotonic() - started:.0f} s ("
                 + ", ".join(f"{k}: {len(v)}, {sum(v) / len(v):.2f} s of job and check each"
                             for k, v in by_kind.items()) + ")")
        return results

    def run_hostile(self, trials: list[Trial] | None = None) -> list[dict[str, Any]]:
        """Plan and run the hostile kinds' trials (``cotenant``, ``fuzz``): ``--race-trials``
        of each asked for, on the workers."""
        a = self.args
        if trials is None:
            trials = []
            if "cotenant" in a.kinds and COTENANT_FAULT in a.faults:
                trials += plan_cotenant(a.race_trials, a.seed)
            if "fuzz" in a.kinds and FUZZ_FAULT in a.faults:
                trials += plan_fuzz(a.race_trials, a.seed)
        self.say(f"{len(trials)} hostile trials")

        def one(i: int, env: Env) -> dict[str, Any]:
            trial = trials[i]
            run = run_cotenant_trial if trial.fault == COTENANT_FAULT else run_fuzz_trial
            return run(trial, env.workdir, f"h{i}", keep=a.keep)

        results = self.pool(len(trials), one, tmpfs=False, label="hostile trials")
        return [{**failure(t, r["error"]), "scenario": t.row} if "error" in r else r
                for t, r in zip(trials, results)]

    def run(self) -> int:
        """Run the matrix; print (and write) the table; 0 when every trial passed."""
        started = time.monotonic()
        results: list[dict[str, Any]] = []
        kinds = set(self.args.kinds)
        if self.args.s3_only:
            kinds &= {"classic", "ops-s3", "dedup"}
            self.skipped.append("the trials without an S3 tier (--s3-only)")
        try:
            if any(f in (*LOCAL_FAULTS, FIRST_FULL, "cli", "corrupt-source", "vanish-source",
                          "stall") for f in self.args.faults) \
                    and kinds - {"ops-s3", "multinode", "parity", *RACE_KINDS, *HOSTILE_KINDS} \
                    and not self.args.s3_only:
                results += self.run_local()
            if self.args.s3 and {"classic", "ops-s3", "dedup"} & kinds:
                results += self.run_s3()
            elif not self.args.s3:
                self.skipped.append("the S3 tier (--no-s3)")
            if "multinode" in kinds:
                results += self.run_multinode()
            if "parity" in kinds:
                results += self.run_multinode(parity=True)
            if set(RACE_KINDS) & kinds and RACE_FAULT in self.args.faults:
                results += self.run_races()
            if any(k in kinds and fault in self.args.faults
                   for k, fault in zip(HOSTILE_KINDS, (COTENANT_FAULT, FUZZ_FAULT))):
                results += self.run_hostile()
        finally:
            if self.server is not None:
                self.server.stop()
        self.skipped.append("peer_fetch, and replicate with whole replicas (the parity kind "
                            "covers replicate with parity)")
        return self.report(results, time.monotonic() - started)

    def report(self, results: list[dict[str, Any]], wall: float) -> int:
        """Print the table, the failures with their commands; write the files asked for."""
        failed = [r for r in results if not r["passed"]]
        text = table(results, wall, self.skipped)
        print(text, flush=True)
        if self.args.table:
            Path(self.args.table).write_text(text + "\n")
        if failed:
            print(f"\n{len(failed)} trial(s) failed; run one again alone with:", flush=True)
            for r in failed:
                print(f"  {Trial.parse(r['spec']).command()}\n      {r['scenario']}\n      "
                      + "\n      ".join(r["violations"]), flush=True)
        if self.args.json:
            Path(self.args.json).write_text(json.dumps(
                {"trials": len(results), "failed": len(failed), "wall_s": wall,
                 "skipped": self.skipped, "results": results}, indent=1))
        if not failed and not self.args.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
            shutil.rmtree(self.shm, ignore_errors=True)
        elif failed:
            print(f"(the failed trials' directories are under {self.workdir} and {self.shm})")
        return 1 if failed else 0

    def run_one(self, trial: Trial) -> int:
        """Run one trial and say everything about it; its directories are kept."""
        self.args.keep = True
        if trial.row.startswith(tuple(f"{k}/" for k in HOSTILE_KINDS)):
            hostile = trial.row.split("/")[0]
            row = (cotenant_row if hostile == "cotenant" else fuzz_row)(trial.seed)
            fault = COTENANT_FAULT if hostile == "cotenant" else FUZZ_FAULT
            trial = Trial(row, fault, 1, trial.seed)  # as the seed says
            result = self.run_hostile([trial])[0]
            return _print_one(trial, result, f"files: {result['dir']}", "notes")
        if trial.row.startswith(tuple(f"{k}/" for k in RACE_KINDS)):
            kind = kind_of_trial(trial)
            trial = Trial(row_of(kind, trial.seed), RACE_FAULT, 1, trial.seed)  # as the seed says
            result = self.run_races([trial])[0]
            return _print_one(trial, result, f"files: {result['dir']} (launch logs: "
                              f"{os.path.dirname(result['dir'])}/launches)", "details",
                              timings=f" {result['timings']}")
        if trial.row.startswith(("node/", "parity/")):
            workdir = os.path.join(self.workdir, "one")
            result = run_chain([trial], workdir, say=self.say)[0]
            return _print_one(trial, result, f"files: {result['dir']} (log: {result['dir']}/log)",
                              "notes")
        try:
            if trial.s3:
                self.start_server()
            env = self.env("one", tmpfs=trial.fault in FULL_FAULTS)
            os.makedirs(env.workdir, exist_ok=True)
            os.makedirs(env.shm, exist_ok=True)
            try:
                result = run_trial(trial, env, "trial")
            finally:
                unmount(env.mount)
        finally:
            if self.server is not None:
                self.server.stop()
        print(f"trial {trial.spec}: {'passed' if result['passed'] else 'FAILED'} "
              f"in {result['seconds']} s {result['timings']}\njob: {result['scenario']}\n"
              f"files: {result['dir']}")
        for kind, rest in Journal.read(os.path.join(result["dir"], "journal")):
            print(f"  journal: {kind} {rest}")
        for v in result["violations"]:
            print(f"  VIOLATION: {v}")
        for n in result["notes"]:
            print(f"  note: {n}")
        return 0 if result["passed"] else 1


def warm_up() -> None:
    """Open, save, load and close a store once, so that every forked trial finds the imports
    and caches done; then wait until its threads are gone (forking beside a live thread could
    hand a child a lock nobody will release)."""
    import torch.distributed.checkpoint as dcp

    from .state import blank_like, state_for

    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="tierstore-faults-warm-")
    try:
        config = {"tier": [{"name": "a", "backend": "memory", "path": f"{root}/a"},
                           {"name": "b", "backend": "local", "path": f"{root}/b"}]}
        with tierstore.open(config) as store:
            dcp.save(state_for("step-1", 0), storage_writer=store.writer(),
                     checkpoint_id="step-1")
            store.wait()
            dcp.load(blank_like(state_for("step-1", 0)), storage_reader=store.reader(),
                     checkpoint_id="step-1")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    deadline = time.monotonic() + 10
    while threading.active_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    if threading.active_count() > 1:
        raise RuntimeError(f"threads still running after the warm-up: {threading.enumerate()}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trial", type=Trial.parse, help="run this one trial (ROW:FAULT:NTH:SEED"
                   "[:s3[:obstore]][:roomN][:VARIANT]) and show its journal and findings")
    p.add_argument("--sample", action="store_true",
                   help="the CI sample: one trial per cell, few S3 trials")
    p.add_argument("--per-cell", type=int, default=10,
                   help="trials per row and fault, and per room and backend of first-full (10)")
    p.add_argument("--s3-per-cell", type=int, default=1,
                   help="trials per drain row and fault on the S3 tier, on each S3 backend (1)")
    p.add_argument("--s3-trials", type=int, default=None,
                   help="at most this many of those (drawn at random)")
    p.add_argument("--server-deaths", type=int, default=5,
                   help="server-death trials under drains, on each S3 backend (5)")
    p.add_argument("--seeds", type=int, default=40,
                   help="how many jobs (seeds) the local trials are drawn from (40)")
    p.add_argument("--s3-seeds", type=int, default=4,
                   help="how many jobs the S3 trials are drawn from (4)")
    p.add_argument("--faults", type=lambda s: tuple(s.split(",")), default=FAULTS,
                   help=f"comma-separated subset of {','.join(FAULTS)}")
    p.add_argument("--kinds", type=lambda s: tuple(s.split(",")), default=KINDS,
                   help=f"comma-separated subset of {','.join(KINDS)} (issue 25's kinds: all "
                        f"but classic)")
    p.add_argument("--new-per-cell", type=int, default=3,
                   help="trials per row and fault of keep1 and ops (spoil: 4x per variant, "
                        "cli: 2x per row, stall: 4x in all) (3)")
    p.add_argument("--multinode-per-cell", type=int, default=1,
                   help="multi-node trials per rank, phase and fault (1)")
    p.add_argument("--multinode-seeds", type=int, default=2,
                   help="multi-node jobs (seeds; odd ones wait after each save) (2)")
    p.add_argument("--race-trials", type=int, default=50,
                   help="trials of each race kind asked for (backtoback, auto, pins), and of "
                        "each hostile kind (cotenant, fuzz) (50)")
    p.add_argument("--race-batch", type=int, default=25,
                   help="race trials per launch of the worker's ranks (25)")
    p.add_argument("--no-s3", dest="s3", action="store_false", help="skip the S3 trials")
    p.add_argument("--s3-only", action="store_true",
                   help="only the trials with an S3 tier (the object-store kinds: classic's "
                        "drains and server deaths, ops-s3)")
    p.add_argument("--s3-backends", type=lambda s: tuple(s.split(",")), default=S3_BACKENDS,
                   help=f"comma-separated subset of {','.join(S3_BACKENDS)}: the backends the "
                        f"S3 tier's trials run on (all)")
    p.add_argument("--seed", type=int, default=1, help="draws the jobs and the points (1)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel workers")
    p.add_argument("--table", help="also write the table (Markdown) to this file")
    p.add_argument("--json", help="write every trial's outcome (JSON) to this file")
    p.add_argument("--keep", action="store_true",
                   help="keep every trial's directories (--trial always keeps its own)")
    args = p.parse_args(argv)
    if args.sample:
        args.per_cell, args.s3_per_cell, args.s3_trials, args.server_deaths = 1, 1, 4, 1
        args.seeds, args.s3_seeds = 16, 2
        args.new_per_cell = 1
        args.race_trials = RACE_SAMPLE
        if args.kinds == KINDS:  # (the hostile kinds' CI sample is their own test's)
            args.kinds = tuple(k for k in KINDS if k not in HOSTILE_KINDS)
    if set(args.kinds) - set(KINDS):
        p.error(f"unknown kinds {sorted(set(args.kinds) - set(KINDS))}; choose from "
                f"{', '.join(KINDS)}")
    unknown = set(args.faults) - set(FAULTS)
    if unknown:
        p.error(f"unknown faults {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    unknown = set(args.s3_backends) - set(S3_BACKENDS)
    if unknown:
        p.error(f"unknown S3 backends {sorted(unknown)}; choose from {', '.join(S3_BACKENDS)}")
    if args.s3_only and not args.s3:
        p.error("--s3-only and --no-s3 leave nothing to run")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tests.faults``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = parse_args(argv)
    warm_up()
    if prewarm.ENV not in os.environ:
        # Run by hand (`make faults`): the multi-node and race launches start from prewarmed
        # interpreters of their own, as under pytest (tests/prewarm.py).
        from helpers import script_env, start_prewarm_server

        if start_prewarm_server():
            os.environ[prewarm.ENV] = script_env()[prewarm.ENV]
    matrix = Matrix(args)
    if args.trial is not None:
        return matrix.run_one(args.trial)
    return matrix.run()


def _print_one(trial: Trial, result: dict[str, Any], files: str, notes_key: str,
               timings: str = "") -> int:
    """Print the outcome of one trial run alone (``--trial``); its exit status."""
    print(f"trial {trial.spec}: {'passed' if result['passed'] else 'FAILED'} in "
          f"{result['seconds']} s{timings}\njob: {result['scenario']}\n{files}")
    for v in result["violations"]:
        print(f"  VIOLATION: {v}")
    for n in result.get(notes_key, []):
        print(f"  note: {n}")
    return 0 if result["passed"] else 1
