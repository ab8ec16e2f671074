"""Multi-node trials: 2 simulated nodes x 2 ranks under torchrun (gloo), a node-local ``memory``
tier and a shared tier behind it, ``keep = 1`` (see ``tests/scripts/faults_node_worker.py``).

A trial is ``node/PHASE@RANK:FAULT:NTH:SEED``, or ``parity/PHASE@RANK:...`` for the same job
with a ``peer`` tier protecting every save with parity (``erasure`` 3+1 over the 4 ranks; the
check then also decodes every save's parity, each member lost in turn): the job of ``SEED`` (3 saves; a wait after each
when the seed is odd) with ``FAULT`` (``raise``, ``sigkill``, ``corrupt-source``,
``vanish-source``) striking rank ``RANK`` at its ``NTH`` announcement of ``PHASE``. Launching
four ranks costs seconds, so trials run as a chain: each launch checks the trial before it
(fresh processes) and runs the next one's job; a trial costs about one launch. The checks are
the worker's (its docstring): latest() not older than the newest returned save, nothing mixed,
the newest committed checkpoint loads bitwise from one tier alone, the same id saved again
after the fault commits on every rank, nothing left behind.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import prewarm

from .plan import Trial

__all__ = ["MULTINODE_FAULTS", "plan_multinode", "plan_parity", "run_chain", "spec_of",
           "wait_or_kill"]

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "faults_node_worker.py"
NPROC, NNODES = 2, 2
WORLD = NPROC * NNODES
#: Faults of the multi-node trials.
MULTINODE_FAULTS = ("raise", "sigkill", "corrupt-source", "vanish-source")
#: Seconds one launch (a check and a job) may take.
LAUNCH_TIMEOUT = 150
_ROW = re.compile(r"(?P<kind>node|parity)/(?P<phase>[a-z_]+)@(?P<rank>\d+)")


def spec_of(trial: Trial | None, parity: bool = False) -> dict[str, Any]:
    """What the worker's job takes for ``trial`` (None: a dry run, with parity or not)."""
    if trial is None:
        return {"fault": None, "saves": 3, "wait_each": False, "rank": -1, "row": "", "nth": 0,
                "parity": parity}
    m = _ROW.fullmatch(trial.row)
    return {"fault": trial.fault, "saves": 3, "wait_each": trial.seed % 2 == 1,
            "rank": int(m["rank"]), "row": f"{m['kind']}/{m['phase']}", "nth": trial.nth,
            "parity": m["kind"] == "parity"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def launch(check_root: str | None, job_root: str | None, spec: dict, log: str) -> dict:
    """One torchrun launch on 2 simulated nodes: check ``check_root``, then run the job at
    ``job_root``. Returns the torchruns' exit statuses and whether it timed out."""
    port = _free_port()
    procs = []
    with open(log, "ab") as out:
        for node in range(NNODES):
            cmd = prewarm.torchrun_command(
                [f"--nproc-per-node={NPROC}", f"--nnodes={NNODES}", f"--node-rank={node}",
                 "--master-addr=127.0.0.1", f"--master-port={port}"],
                str(SCRIPT), check_root or "-", job_root or "-", json.dumps(spec),
                warm=prewarm.available())
            procs.append(subprocess.Popen(cmd, env=_env(), stdout=out, stderr=out,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
        timed_out = wait_or_kill(procs, LAUNCH_TIMEOUT)
    return {"codes": [p.returncode for p in procs], "timed_out": timed_out}


def wait_or_kill(procs: list[subprocess.Popen], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``procs`` to end, then kill the sessions of those
    still running (SIGKILL); returns whether any had to be killed."""
    deadline, timed_out = time.monotonic() + timeout, False
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    return timed_out


def _journal(root: str) -> list[list[str]]:
    try:
        with open(os.path.join(root, "journal")) as f:
            return [line.split() for line in f.read().splitlines()]
    except FileNotFoundError:
        return []


def dry_counts(workdir: str, seed: int, parity: bool = False) -> dict[int, dict[str, int]]:
    """What each rank announces per row in the job of ``seed`` without a fault."""
    root = os.path.join(workdir, f"dry-{seed}{'-parity' if parity else ''}")
    os.makedirs(root, exist_ok=True)
    spec = spec_of(None, parity)
    spec["wait_each"] = seed % 2 == 1
    launch(None, root, spec, os.path.join(root, "log"))
    counts = {}
    for rank in range(WORLD):
        try:
            with open(os.path.join(root, f"counts.r{rank}")) as f:
                counts[rank] = json.load(f)
        except FileNotFoundError:
            raise RuntimeError(f"the multi-node job of seed {seed} without a fault failed; "
                               f"see {root}/log") from None
    return counts


def plan_parity(counts: dict[int, dict[int, dict[str, int]]], per_cell: int,
                rng: random.Random) -> list[Trial]:
    """The parity job: SIGKILL and ``raise`` at every rank's ``replicate`` (the encoding
    begins) and at points of its ``write_manifest``, ``publish`` and ``retain`` (among them
    the parity's commit, and the eviction of the previous save's parity), ``per_cell`` each."""
    trials = []
    seeds = sorted(counts)
    for rank in range(WORLD):
        for row in ("parity/replicate", "parity/write_manifest", "parity/publish",
                    "parity/retain"):
            reached = [(s, counts[s][rank][row]) for s in seeds
                       if counts[s].get(rank, {}).get(row)]
            if not reached:
                continue
            for fault in ("sigkill", "raise"):
                for _ in range(per_cell):
                    seed, n = reached[rng.randrange(len(reached))]
                    trials.append(Trial(f"{row}@{rank}", fault, rng.randint(1, n), seed))
    return trials


def plan_multinode(counts: dict[int, dict[int, dict[str, int]]], per_cell: int,
                   rng: random.Random) -> list[Trial]:
    """SIGKILL at every phase of every rank (``per_cell`` points each); ``raise`` at every
    phase of the coordinator's ``finish`` and of the other node's part; a corrupt or vanishing
    source part under every rank's gathered drain."""
    trials = []
    seeds = sorted(counts)
    for rank in range(WORLD):
        rows = sorted({r for c in counts.values() for r in c.get(rank, {})})
        for row in rows:
            for fault in ("sigkill", "raise", "corrupt-source", "vanish-source"):
                if fault == "raise" and not (rank in (0, 2) and row in (
                        "node/write_metadata", "node/write_manifest", "node/publish",
                        "node/retain")):
                    continue
                if fault in ("corrupt-source", "vanish-source") and row != "node/drain_file":
                    continue
                reached = [(s, counts[s][rank][row]) for s in seeds
                           if counts[s].get(rank, {}).get(row)]
                for k in range(per_cell):
                    seed, n = reached[rng.randrange(len(reached))]
                    trials.append(Trial(f"{row}@{rank}", fault, rng.randint(1, n), seed))
    return trials


def run_chain(trials: list[Trial], workdir: str, say=print) -> list[dict[str, Any]]:
    """Run ``trials`` as a chain of launches (see the module docstring); their outcomes."""
    roots = [os.path.join(workdir, f"n{i}") for i in range(len(trials))]
    for r in roots:
        os.makedirs(r, exist_ok=True)
    launches: list[dict] = [{} for _ in trials]
    started = [0.0] * len(trials)
    for i in range(len(trials) + 1):
        check_root = roots[i - 1] if i > 0 else None
        job_root = roots[i] if i < len(trials) else None
        spec = spec_of(trials[i]) if i < len(trials) else spec_of(None)
        if i < len(trials):
            started[i] = time.monotonic()
        log = os.path.join(job_root or check_root, "log")
        result = launch(check_root, job_root, spec, log)
        if job_root is not None and check_root is not None and not any(
                w and w[0] == "begin" for w in _journal(job_root)):
            # The check failed in a way that ended its launch before the job began (a rank
            # that raised leaves the others' process group broken): the job alone, again.
            result = launch(None, job_root, spec, log)
        if i < len(trials):
            launches[i] = result
        if i > 0:
            say(f"multi-node trials: {i}/{len(trials)}")
    return [outcome(t, roots[i], launches[i], time.monotonic() - started[i])
            for i, t in enumerate(trials)]


def outcome(trial: Trial, root: str, job: dict, seconds: float) -> dict[str, Any]:
    """A trial's outcome from its job's launch, its journal and its check's files."""
    violations, notes = [], []
    journal = _journal(root)
    if not any(w and w[0] == "fired" for w in journal):
        violations.append(f"the fault point was never reached (torchrun exit statuses "
                          f"{job.get('codes')})")
    if job.get("timed_out"):
        notes.append(f"the faulty job did not end in {LAUNCH_TIMEOUT} s (ranks left waiting)")
    notes += [" ".join(w[1:]) for w in journal if w and w[0] == "note"]
    done = 0
    for rank in range(WORLD):
        try:
            with open(os.path.join(root, f"check.r{rank}")) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            continue
        done += "DONE" in lines
        violations += [f"rank {rank}: {line}" for line in lines if line != "DONE"]
    if done < WORLD and not violations:
        violations.append(f"the check ended on {done} of {WORLD} ranks only (hung or failed: "
                          f"see {root}/log and the next trial's log)")
    seen, unique = set(), []
    for v in violations:  # every rank says the same thing of a shared state: once is enough
        key = re.sub(r"^rank \d+: ", "", v)
        if key not in seen:
            seen.add(key)
            unique.append(v)
    m = _ROW.fullmatch(trial.row)
    parity = m["kind"] == "parity"
    return {"spec": trial.spec, "row": f"{m['kind']}/{m['phase']}", "fault": trial.fault,
            "s3": False,
            "room": None, "backend": "memory", "passed": not unique, "violations": unique,
            "notes": notes, "scenario": f"2 nodes x 2 ranks, memory({{node}}) -> "
            f"{'peer({node}, erasure 3+1) -> ' if parity else ''}shared local, "
            f"keep 1, 3 saves{', wait each' if trial.seed % 2 else ''}, rank {m['rank']}",
            "seconds": round(seconds, 3), "timings": {}, "dir": root}
