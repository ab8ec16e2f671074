"""The race kinds: no fault is injected; the library's own concurrency is the adversary.

- ``backtoback``: 2 simulated nodes x 1 rank or 3 x 2 (alternating by seed), a node-local
  ``ram`` tier (``memory``, ``{node}`` in its path) then a node-local ``disk`` tier (``local``,
  ``{node}``), and on half the seeds a shared ``local`` tier; ``keep`` and ``every`` drawn by
  seed; 6 to 10 saves back to back (``dcp.save``, or ``dcp.async_save`` without waiting between
  them, alternating by seed; 1 to 4 MiB per rank), then ``store.wait()``.
- ``auto``: 2 ranks, two shared ``local`` tiers with ``every = "auto"`` (``[store] mtbf_hours``
  small, so that the chosen intervals are a few steps), ``[store] overwrite = true`` on odd
  seeds, the documented loop (``if store.should_save(step): dcp.save(...)``) over 40 to 60
  steps, rank 1's steps slower than rank 0's.
- ``pins``: one process, ``ram`` then ``disk`` (``keep`` 1 or 2 each) and on half the seeds an
  ``archive`` tier only ``promote`` reaches; a second thread calls ``store.pin``, ``unpin`` and
  ``promote`` after each save, while drains copy (the checkpoint being drained) and as ``keep``
  begins a pass (a checkpoint beyond ``keep``).

The jobs and the checks are tests/scripts/faults_race_worker.py's (its docstring says what each
check holds). A trial is ``KIND/VARIANT:race:1:SEED`` (``backtoback/3x2:race:1:7``): the seed
draws everything. Trials run in batches (``--race-batch``, 25) of one shape per launch of the
worker's ranks (started with torchrun's environment: ``RANK``, ``GROUP_RANK``,
``LOCAL_WORLD_SIZE``, ...), each with fresh tier roots; each launch first checks the batch before
it (fresh processes) and then runs the next batch's jobs, so a trial costs a fraction of a
launch.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import prewarm

from .multinode import wait_or_kill
from .plan import Trial

__all__ = ["RACE_FAULT", "RACE_KINDS", "kind_of_trial", "launch", "params", "plan_races",
           "row_of", "run_races", "shape_of", "trial_dict"]

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "faults_race_worker.py"
#: The kinds of this module (``--kinds``).
RACE_KINDS = ("backtoback", "auto", "pins")
#: The table's column for them: no fault injected, the library's own races.
RACE_FAULT = "race"
#: Seconds a launch may take: this, plus ``PER_TRIAL_S`` per trial it checks or runs.
LAUNCH_BASE_S = 90
PER_TRIAL_S = 45
_ROW = re.compile(r"(?P<kind>backtoback|auto|pins)/(?P<variant>[a-z0-9-]+)")


def shape_of(kind: str, seed: int) -> tuple[int, int]:
    """(nodes, ranks per node) of the trial of ``kind`` and ``seed``."""
    if kind == "backtoback":
        return (2, 1) if seed % 2 == 0 else (3, 2)
    if kind == "auto":
        return (1, 2)
    return (1, 1)


def params(kind: str, seed: int) -> dict[str, Any]:
    """Everything the worker's job of ``kind`` takes from ``seed``."""
    rng = random.Random(f"{kind}-{seed}")
    nnodes, nproc = shape_of(kind, seed)
    if kind == "backtoback":
        big = nnodes * nproc > 2
        return {"nnodes": nnodes, "nproc": nproc, "async": (seed // 2) % 2 == 1,
                "saves": rng.randint(6, 8 if big else 10),
                "mib": rng.choice([1, 2] if big else [1, 2, 4, 4]),
                "ram_keep": rng.choice([None, 1, 2]), "disk_keep": rng.choice([None, 2, 3]),
                "disk_every": rng.choice([1, 2]), "shared": rng.random() < 0.5,
                "shared_keep": rng.choice([None, 2]), "shared_every": rng.choice([1, 2])}
    if kind == "auto":
        return {"nnodes": 1, "nproc": 2, "overwrite": seed % 2 == 1,
                "steps": rng.randint(40, 60), "step_s": round(rng.uniform(0.004, 0.01), 4),
                "mtbf_hours": round(rng.uniform(0.00002, 0.0001), 7), "mib": rng.choice([1, 2]),
                "fast_keep": rng.choice([2, 3]), "slow_keep": rng.choice([2, 3])}
    if kind == "pins":
        return {"nnodes": 1, "nproc": 1, "async": seed % 2 == 1, "saves": rng.randint(6, 10),
                "mib": rng.choice([1, 2]), "ram_keep": rng.choice([1, 2]),
                "disk_keep": rng.choice([1, 2]), "archive": rng.random() < 0.5,
                "archive_keep": rng.choice([None, 1]), "gap_s": round(rng.uniform(0, 0.03), 4),
                "drain_rate": rng.choice([0.3, 0.6, 0.9]),
                "retain_rate": rng.choice([0.3, 0.6, 0.9])}
    raise ValueError(f"unknown race kind {kind!r}")


def row_of(kind: str, seed: int) -> str:
    """The table's row of a trial: the kind and its variant."""
    p = params(kind, seed)
    if kind == "backtoback":
        return f"backtoback/{p['nnodes']}x{p['nproc']}-{'async' if p['async'] else 'sync'}"
    if kind == "auto":
        return f"auto/{'overwrite' if p['overwrite'] else 'plain'}"
    return f"pins/{'async' if p['async'] else 'sync'}"


def describe(kind: str, seed: int) -> str:
    """The job of a trial, in words."""
    p = params(kind, seed)
    if kind == "backtoback":
        tiers = (f"ram(memory, {{node}}, keep {p['ram_keep']}) -> disk(local, {{node}}, every "
                 f"{p['disk_every']}, keep {p['disk_keep']})"
                 + (f" -> shared(local, every {p['shared_every']}, keep {p['shared_keep']})"
                    if p["shared"] else ""))
        return (f"{p['nnodes']} nodes x {p['nproc']} ranks, {tiers}, {p['saves']} "
                f"{'async ' if p['async'] else ''}saves of {p['mib']} MiB per rank back to "
                f"back, then wait()")
    if kind == "auto":
        return (f"2 ranks, fast(local, auto, keep {p['fast_keep']}) -> slow(local, auto, keep "
                f"{p['slow_keep']}), mtbf_hours {p['mtbf_hours']}"
                f"{', overwrite' if p['overwrite'] else ''}, {p['steps']} steps of "
                f"{p['step_s']}/{2 * p['step_s']} s (rank 0/1), {p['mib']} MiB per rank")
    return (f"1 rank, ram(keep {p['ram_keep']}) -> disk(keep {p['disk_keep']})"
            + (f" + archive(promote only, keep {p['archive_keep']})" if p["archive"] else "")
            + f", {p['saves']} {'async ' if p['async'] else ''}saves of {p['mib']} MiB, pin/"
              f"unpin/promote from a thread (drain cues {p['drain_rate']}, keep cues "
              f"{p['retain_rate']})")


def plan_races(kind: str, count: int, seed: int, *, shapes: tuple | None = None) -> list[Trial]:
    """``count`` trials of ``kind`` on seeds drawn from ``seed`` (consecutive seeds, so that
    the variants alternate); ``shapes``: only seeds of these (nodes, ranks) shapes."""
    base = seed * 100_000 + 90_000 + RACE_KINDS.index(kind) * 3_000
    trials, s = [], base
    while len(trials) < count:
        if shapes is None or shape_of(kind, s) in shapes:
            trials.append(Trial(row_of(kind, s), RACE_FAULT, 1, s))
        s += 1
    return trials


def kind_of_trial(trial: Trial) -> str:
    m = _ROW.fullmatch(trial.row)
    if m is None:
        raise ValueError(f"{trial.row!r} is not a race row (backtoback/..., auto/..., pins/...)")
    return m["kind"]


# -- launches ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, world: int, node: int, nproc: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "MASTER_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "ROLE_RANK", "GROUP_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RANK=str(rank), WORLD_SIZE=str(world),
               LOCAL_RANK=str(rank % nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(node),
               ROLE_RANK=str(rank), GROUP_WORLD_SIZE=str(world // nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # the worker imports its neighbours (as torchrun would run it: its folder on sys.path)
    return env


def launch(kind: str, shape: tuple[int, int], check: list[dict], run: list[dict], plan_path: str,
           log: str) -> dict[str, Any]:
    """One launch of the worker's ranks: check the trials of ``check``, then run the jobs of
    ``run``. Returns the exit statuses, whether it timed out, and its wall time."""
    nnodes, nproc = shape
    world = nnodes * nproc
    with open(plan_path, "w") as f:
        json.dump({"kind": kind, "check": check, "run": run}, f)
    port = _free_port()
    started = time.monotonic()
    timeout = LAUNCH_BASE_S + PER_TRIAL_S * (len(check) + len(run))
    procs = []
    with open(log, "ab") as out:
        for rank in range(world):
            procs.append(subprocess.Popen(
                prewarm.python_command(str(SCRIPT), plan_path, warm=prewarm.available()),
                env=_env(rank, world, rank // nproc, nproc, port),
                stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True))
        timed_out = wait_or_kill(procs, timeout)
    return {"codes": [p.returncode for p in procs], "timed_out": timed_out,
            "seconds": time.monotonic() - started, "timeout": timeout}


def trial_dict(trial: Trial, root: str, shm: str) -> dict[str, Any]:
    kind = kind_of_trial(trial)
    return {"spec": trial.spec, "kind": kind, "seed": trial.seed, "root": root, "shm": shm,
            **params(kind, trial.seed)}


def _read(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_races(trials: list[Trial], workdir: str, shm: str, *, batch: int = 25, say=print,
              keep: bool = False) -> list[dict[str, Any]]:
    """Run ``trials`` (any race kinds) in batches of one kind and shape, each batch's jobs in one
    launch and its checks in the next; their outcomes (in the matrix's form)."""
    groups: dict[tuple[str, tuple[int, int]], list[int]] = {}
    for i, t in enumerate(trials):
        kind = kind_of_trial(t)
        groups.setdefault((kind, shape_of(kind, t.seed)), []).append(i)
    dicts = [trial_dict(t, os.path.join(workdir, f"r{i}"), os.path.join(shm, f"r{i}"))
             for i, t in enumerate(trials)]
    for d in dicts:
        os.makedirs(d["root"], exist_ok=True)
        os.makedirs(d["shm"], exist_ok=True)
    launches: dict[int, dict] = {i: {} for i in range(len(trials))}
    done, total, started = 0, len(trials), time.monotonic()
    logs = os.path.join(workdir, "launches")
    os.makedirs(logs, exist_ok=True)
    n = 0
    for (kind, shape), members in groups.items():
        world = shape[0] * shape[1]
        queue, previous, tries = list(members), [], {i: 0 for i in members}
        while queue or previous:
            run, queue = queue[:batch], queue[batch:]
            n += 1
            log = os.path.join(logs, f"{n}-{kind}.log")
            result = launch(kind, shape, [dicts[i] for i in previous], [dicts[i] for i in run],
                            os.path.join(logs, f"{n}-{kind}.json"), log)
            for i in previous:
                launches[i]["check"], launches[i]["check_log"] = result, log
            done += len(previous)
            if previous:
                say(f"{kind} trials: {done}/{total} ({time.monotonic() - started:.0f} s)")
            previous, again = [], []
            for i in run:
                tries[i] += 1
                begun = any(os.path.exists(os.path.join(dicts[i]["root"], f"begun.r{r}"))
                            for r in range(world))
                if begun or tries[i] >= 3:
                    launches[i]["job"], launches[i]["log"] = result, log
                    previous.append(i)
                else:  # an earlier trial of this launch (its check or job) ended it
                    again.append(i)
            queue = again + queue
    outcomes = [outcome(trials[i], dicts[i], launches[i]) for i in range(total)]
    for o, d in zip(outcomes, dicts):
        if o["passed"] and not keep:
            shutil.rmtree(d["root"], ignore_errors=True)
            shutil.rmtree(d["shm"], ignore_errors=True)
    return outcomes


def outcome(trial: Trial, t: dict, launched: dict) -> dict[str, Any]:
    """A trial's outcome from its job and check files (every rank's)."""
    kind = t["kind"]
    nnodes, nproc = shape_of(kind, t["seed"])
    world = nnodes * nproc
    violations: list[str] = []
    notes: list[str] = []
    jobs = [_read(os.path.join(t["root"], f"job.r{r}.json")) for r in range(world)]
    checks = [_read(os.path.join(t["root"], f"check.r{r}.json")) for r in range(world)]
    job, check = launched.get("job", {}), launched.get("check", {})
    if any(j is None for j in jobs):
        late = ", timed out" if job.get("timed_out") else ""
        violations.append(f"the job did not end on ranks "
                          f"{[r for r, j in enumerate(jobs) if j is None]} (launch exit statuses "
                          f"{job.get('codes')}{late}; a rank that hung wrote every thread's stack "
                          f"to {launched.get('log')})")
    for r, c in enumerate(checks):
        if c is None:
            late = ", timed out" if check.get("timed_out") else ""
            violations.append(f"the check did not end on rank {r} (launch exit statuses "
                              f"{check.get('codes')}{late}; see {launched.get('check_log')})")
            continue
        violations += c["violations"]
        if r == 0:
            notes += c["notes"]
    seen, unique = set(), []
    for v in violations:
        if v not in seen:
            seen.add(v)
            unique.append(v)
    job_s = max((j.get("seconds", 0) for j in jobs if j), default=0)
    check_s = max((c.get("seconds", 0) for c in checks if c), default=0)
    return {"spec": trial.spec, "row": trial.row, "fault": RACE_FAULT, "s3": False, "room": None,
            "variant": "", "backend": "memory", "passed": not unique, "violations": unique,
            "notes": [], "details": notes,
            "scenario": describe(kind, t["seed"]), "seconds": round(job_s + check_s, 3),
            "timings": {"job_s": round(job_s, 3), "check_s": round(check_s, 3)},
            "dir": t["root"]}
