"""One contender's job under the scenario's failures, as a job scheduler would run it.

The supervisor launches the job (:mod:`tierstore_simulate.job`): one ``torchrun`` per simulated
node, each in a session of its own, meeting on a localhost rendezvous. It follows rank 0's
progress in the job's events log and strikes each failure of the schedule once rank 0 has
reported its step:

- ``kill-rank``: SIGKILL to that rank's process;
- ``hang-rank``: SIGSTOP to that rank's process: it neither answers nor dies, and the others
  must notice through their collective timeout (``[job] collective_timeout_s``);
- ``lose-node``: SIGKILL to the node's torchrun session and to its ranks, then its node-local
  directories deleted (what a replaced machine has lost);
- ``preempt``: SIGTERM to every rank, SIGKILL to what is left after a grace period;
- ``object-store-outage``: the simulator's object store (a SeaweedFS server) killed, and
  started again on the same data ``duration_s`` later, while the job goes on; the next
  failure of the schedule is watched for meanwhile.

A killed (or hung) rank makes the others fail; once the run has ended (or a short wait is over) every
process left of it is killed, the scheduler's delay passes, and the job is started again. It
records each run's process start and each failure's kind, what the goodput accounting needs.

Safety: a pid is signalled only after ``/proc/<pid>/cmdline`` showed it runs the job module
with this contender's job spec among its arguments (never pid 1 or below, never this process),
and a torchrun session only while its ``Popen`` is not reaped (so its process group id cannot
have been reused).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .job import JobSpec, pid_file
from .scenario import Contender, Failure, Job, Scenario, slug

__all__ = ["ContenderOutcome", "EventsTail", "Supervisor", "job_spec", "node_local_dirs"]

#: seconds between looks at the events log and the processes
POLL_S = 0.05
#: seconds the survivors of a killed rank or node get to fail on their own before SIGKILL
#: (sooner once a torchrun has failed: see _one_run)
FAILURE_GRACE_S = 5.0
#: seconds ranks get after SIGTERM before SIGKILL (a scheduler's usual grace is 30 s)
PREEMPT_GRACE_S = 30.0
#: seconds beyond the collective timeout that the ranks of a hung job get to fail on their own
HANG_GRACE_S = 30.0
#: seconds to wait for a rank's pid file before striking it
PID_WAIT_S = 60.0
#: seconds a killed process gets to disappear
EXIT_WAIT_S = 10.0
#: what the job's log says on a good end, once per rank
FINAL_OK = "FINAL OK"


# --------------------------------------------------------------------------- the job's spec

def bucket_name(contender: Contender, round_no: int = 1) -> str:
    """The object-store bucket of ``contender``'s ``s3`` tiers in round ``round_no`` of the
    simulation (a valid S3 bucket name: a round never resumes from another's checkpoints)."""
    base = f"sim-{slug(contender.name)}"[:56].rstrip("-")
    return base if round_no == 1 else f"{base}-r{round_no}"


def _tier_config(tier: Any, contender: Contender, job: Job, work_dir: Path, shm_dir: Path,
                 object_store: Any = None, round_no: int = 1) -> dict:
    """One ``[[tier]]`` of the store: the scenario's tier at the simulator's own path."""
    node = "/{node}" if tier.node_local else ""
    where = shm_dir if tier.backend in ("memory", "peer") else work_dir
    backend = tier.client if tier.backend == "s3" else tier.backend
    out: dict[str, Any] = {"name": tier.name, "backend": backend}
    location = f"{where}/{tier.name}{node}"
    if tier.backend == "fsspec":
        out["url"] = f"file://{location}"
    elif tier.backend == "s3":
        if object_store is None:
            raise ValueError(f"tier '{tier.name}' is on the object store, and none was started")
        out["url"] = f"s3://{bucket_name(contender, round_no)}/{tier.name}"
        out["options"] = object_store.storage_options()
    else:
        out["path"] = location
    if tier.backend == "peer":
        # Each rank's files replicated to the rank of the same local rank on the next node.
        out["replication"] = {"strategy": "clique", "factor": 2, "jump": job.ranks_per_node}
    # The job saves only at multiples of the contender's interval, so a tier with that interval
    # takes every save: tierstore spells that every = 1 (and needs one such tier).
    out["every"] = (tier.every if tier.every == "auto" else
                    1 if tier.every == contender.every else tier.every)
    if tier.keep is not None:
        out["keep"] = tier.keep
    return out


def job_spec(contender: Contender, job: Job, work_dir: Path, shm_dir: Path,
             object_store: Any = None, round_no: int = 1) -> JobSpec:
    """The spec of ``contender``'s job running in ``work_dir`` (RAM tiers under ``shm_dir``;
    ``s3`` tiers on ``object_store``, a started :class:`~tierstore_simulate.servers.SeaweedS3`)
    in round ``round_no`` of the simulation."""
    events_log = str(work_dir / "events.jsonl")
    store = None
    stock_on_s3 = contender.kind != "tierstore" and contender.storage == "s3"
    if stock_on_s3 and object_store is None:
        raise ValueError(f"contender '{contender.name}' saves to the object store, and none "
                         f"was started")
    if contender.kind == "tierstore":
        timeout = job.collective_timeout_s
        # The store's collectives give up as the training's do: a hung rank is noticed alike.
        options: dict[str, Any] = {"events_log": events_log, "collective_timeout": timeout,
                                   "part_timeout": max(60.0, timeout)}
        if contender.lazy:
            options["staging"] = {"name": "cpu", "lazy": True}
        if contender.mtbf_hours is not None:
            options["mtbf_hours"] = contender.mtbf_hours
        store = {"store": options,
                 "tier": [_tier_config(t, contender, job, work_dir, shm_dir, object_store,
                                       round_no) for t in contender.tiers]}
    return JobSpec(kind=contender.kind, steps=job.steps, step_s=job.step_s,
                   state_bytes=int(job.state_mib * 2**20), every=contender.every,
                   work_dir=str(work_dir), events_log=events_log,
                   emergency=contender.emergency, store=store,
                   shared_dir=str(work_dir / "shared") if store is None else None,
                   shared_url=(f"s3://{bucket_name(contender, round_no)}/checkpoints"
                               if stock_on_s3 else None),
                   storage_options=object_store.storage_options() if stock_on_s3 else None,
                   collective_timeout_s=job.collective_timeout_s, lazy=contender.lazy,
                   auto=contender.auto,
                   async_staging=contender.async_staging)


def node_local_dirs(spec: JobSpec, node: int) -> list[Path]:
    """The directories of ``spec``'s node-local tiers on node ``node``."""
    dirs = []
    for tier in (spec.store or {}).get("tier", []):
        location = tier.get("path") or tier.get("url", "").removeprefix("file://")
        if "{node}" in location:
            dirs.append(Path(location.replace("{node}", str(node))))
    return dirs


# --------------------------------------------------------------------------- progress

class EventsTail:
    """The events appended to a JSON-lines file since the last look: only whole lines (a line
    being written, or cut short by a killed process, is not parsed)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def forget_partial(self) -> None:
        """Drop an unfinished last line: with no writer left, it was cut short by a killed
        process and would spoil the next line appended after it."""
        self.partial = b""

    def new_events(self) -> list[dict[str, Any]]:
        """The events of the whole lines appended since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        out = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # cut short by a killed writer: the next line starts whole
            if isinstance(event, dict):
                out.append(event)
        return out


# --------------------------------------------------------------------------- processes

def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_env() -> dict[str, str]:
    """The job's environment: one OpenMP thread per rank (2 cores shared by every rank),
    unbuffered output, none of the torch.distributed variables of a job this may run in, and
    no current directory on ``sys.path`` (a work directory's ``shared/`` or a tier named like
    a module must never shadow one)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONSAFEPATH="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    return env


@dataclass
class ContenderOutcome:
    """What running one contender left: where its events are, when each run's processes
    started, the kind of each failure struck that ended a run, the object-store outages (the
    step each struck at, and how long the store was down), and whether the job ended right."""

    name: str
    work_dir: Path
    events_log: Path
    starts: list[float] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    outages: list[dict[str, Any]] = field(default_factory=list)
    final_ok: bool = False
    error: str | None = None
    logs: list[Path] = field(default_factory=list)


class Supervisor:
    """Runs one contender's job through the scenario's failures (see the module docstring)."""

    def __init__(self, scenario: Scenario, contender: Contender, work_dir: Path, shm_dir: Path,
                 progress: Callable[[str], None] = print, object_store: Any = None,
                 round_no: int = 1):
        self.scenario, self.contender, self.round_no = scenario, contender, round_no
        self.job = scenario.job
        self.work_dir, self.shm_dir = work_dir.resolve(), shm_dir
        self.progress = progress
        #: the simulator's SeaweedFS (started), where a contender has s3 tiers
        self.object_store = object_store
        #: when the object store, stopped by an outage, is to start again (monotonic)
        self.outage_ends: float | None = None
        self.outage_began = 0.0
        self.spec = job_spec(contender, self.job, self.work_dir, shm_dir, object_store,
                             round_no)
        self.spec_path = self.work_dir / "job.json"
        # What a process of this job (a rank, or its torchrun) has among its arguments, and
        # nothing else on the machine has (a user's `tail -f` of a log has neither): the proof
        # that a pid is ours to signal.
        self.marker = (b"tierstore_simulate.job", str(self.spec_path).encode())
        self.outcome = ContenderOutcome(contender.name, self.work_dir,
                                        Path(self.spec.events_log))
        self.procs: list[subprocess.Popen] = []

    def say(self, message: str) -> None:
        """One progress line, naming the contender (and the round, where there are several)."""
        rounds = self.scenario.supervisor.repeat
        where = f", round {self.round_no}/{rounds}" if rounds > 1 else ""
        self.progress(f"[{self.contender.name}{where}] {message}")

    # -- the whole schedule ------------------------------------------------------------------
    def run(self) -> ContenderOutcome:
        """Run the job until it ends well (or fails unexpectedly, or times out), restarting it
        after each failure of the schedule."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.spec.write(self.spec_path)
        if self.contender.uses_object_store:
            self.object_store.make_bucket(bucket_name(self.contender, self.round_no))
        tail = EventsTail(self.outcome.events_log)
        pending = list(self.scenario.failures)
        deadline = time.monotonic() + self.scenario.supervisor.timeout_s
        try:
            while True:
                run_no = len(self.outcome.starts) + 1
                struck = self._one_run(run_no, tail, pending, deadline)
                if struck is None:
                    break
                self.outcome.kinds.append(struck.kind)
                pending.remove(struck)
                delay = self.scenario.supervisor.restart_delay_s
                self.say(f"restarting in {delay:g} s (the scheduler's delay)")
                time.sleep(delay)
                self._end_outage()
        except _Stop as stop:
            self.outcome.error = str(stop)
            self.say(f"stopped: {stop}")
        finally:
            self._end_run()
            self._end_outage(now=True)  # the next contender finds the store up
        return self.outcome

    # -- one run -----------------------------------------------------------------------------
    def _one_run(self, run_no: int, tail: EventsTail, pending: list[Failure],
                 deadline: float) -> Failure | None:
        """Launch run ``run_no``, strike the next failure when its step comes, and return it
        once every process of the run is gone; None when the run ended on its own (the job
        is done)."""
        for r in range(self.job.world_size):
            pid_file(self.work_dir, r).unlink(missing_ok=True)  # a stale pid is never struck
        tail.new_events()  # what the previous run's last moments appended
        tail.forget_partial()
        self._launch(run_no)
        struck, struck_at = self._watch(run_no, tail, pending, deadline)
        self._end_run()
        if struck is not None:
            self.say(f"run {run_no} is gone, {time.monotonic() - struck_at:.1f} s after the "
                     f"{struck.kind}")
            return struck
        self.outcome.final_ok = self._final_ok(run_no)
        self.say(f"run {run_no} ended: " + ("every rank FINAL OK" if self.outcome.final_ok
                                             else "final state BAD (see its logs)"))
        if pending:
            self.say(f"not struck (the job ended first): "
                     f"{', '.join(f'{f.kind} at step {f.at_step}' for f in pending)}")
        return None

    def _watch(self, run_no: int, tail: EventsTail, pending: list[Failure],
               deadline: float) -> tuple[Failure | None, float]:
        """Follow the run until it is over, striking the failures of ``pending`` in turn once
        rank 0 has reported their steps: an outage is struck and taken off ``pending`` (the run
        goes on); return the failure that ended the run (None: none did) and when it struck."""
        struck, struck_at = None, 0.0
        while True:
            for e in tail.new_events():
                if (pending and struck is None and e.get("kind") == "step"
                        and e.get("rank") == 0 and e["detail"]["step"] >= pending[0].at_step):
                    failure = pending[0]
                    self._strike(failure, e["detail"]["step"])
                    if failure.fatal:
                        struck, struck_at = failure, time.monotonic()
                    else:
                        pending.pop(0)
            self._end_outage()
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                return struck, struck_at
            failed = any(c not in (None, 0) for c in codes)
            if struck is None and failed:
                # A torchrun failed with no failure struck: restarting would only repeat it.
                time.sleep(FAILURE_GRACE_S)  # the other nodes' logs say their part too
                raise _Stop(f"run {run_no} failed with no failure struck (torchrun exit "
                            f"statuses {[p.poll() for p in self.procs]}); see "
                            f"{', '.join(map(str, self.outcome.logs[-len(self.procs):]))}")
            if struck is not None:
                grace = {"preempt": PREEMPT_GRACE_S,
                         "hang-rank": self.job.collective_timeout_s + HANG_GRACE_S
                         }.get(struck.kind, FAILURE_GRACE_S)
                if time.monotonic() - struck_at > grace:
                    self._dump_stacks()
                    return struck, struck_at  # what is left is killed by _end_run
                if failed and struck.kind != "preempt":
                    # A scheduler ends the whole job once one of its nodes failed (Slurm's
                    # --kill-on-bad-exit): the survivors are killed, whatever they do.
                    return struck, struck_at
            if time.monotonic() > deadline:
                raise _Stop(f"the job did not finish within [supervisor] timeout_s = "
                            f"{self.scenario.supervisor.timeout_s:g} s (run {run_no}); raise "
                            f"it, or see {self.outcome.logs[-1]}")
            time.sleep(POLL_S)

    def _launch(self, run_no: int) -> None:
        port = _free_port()
        self.outcome.starts.append(time.time())
        self.procs = []
        for node in range(self.job.nodes):
            log_path = self.work_dir / "logs" / f"run{run_no}-node{node}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.job.nodes}",
                   f"--node-rank={node}", f"--nproc-per-node={self.job.ranks_per_node}",
                   "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0",
                   "-m", "tierstore_simulate.job", str(self.spec_path)]
            with open(log_path, "ab") as log:
                self.procs.append(subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=_job_env(), cwd=self.work_dir, start_new_session=True))
            self.outcome.logs.append(log_path)
        self.say(f"run {run_no} started: {self.job.nodes} node(s) x "
                 f"{self.job.ranks_per_node} rank(s)")

    # -- failures ----------------------------------------------------------------------------
    def _strike(self, failure: Failure, step: int) -> None:
        if failure.kind in ("kill-rank", "hang-rank"):
            sig = signal.SIGKILL if failure.kind == "kill-rank" else signal.SIGSTOP
            pid = self._rank_pid(failure.rank)
            sent = self._signal(pid, sig)
            self.say(f"step {step}: {failure.kind}: {sig.name} to rank {failure.rank} "
                     f"(pid {pid})" + ("" if sent else ": it had already exited")
                     + (f"; the others must give up within collective_timeout_s = "
                        f"{self.job.collective_timeout_s:g} s" if sig == signal.SIGSTOP else ""))
        elif failure.kind == "object-store-outage":
            if self.object_store is None or self.outage_ends is not None:
                self.say(f"step {step}: object-store-outage: "
                         + ("no object store in this simulation" if self.object_store is None
                            else "the object store is already down"))
                return
            self.object_store.kill()
            self.outage_began = time.monotonic()
            self.outage_ends = self.outage_began + failure.duration_s
            self.outcome.outages.append({"at_step": step, "duration_s": failure.duration_s})
            self.say(f"step {step}: object-store-outage: the object store is down for "
                     f"{failure.duration_s:g} s")
        elif failure.kind == "lose-node":
            node = failure.node
            ranks = range(node * self.job.ranks_per_node, (node + 1) * self.job.ranks_per_node)
            pids = [self._rank_pid(r) for r in ranks]
            proc = self.procs[node]
            if proc.poll() is None:  # not reaped: its group id is still its own
                os.killpg(proc.pid, signal.SIGKILL)
            for pid in pids:
                self._signal(pid, signal.SIGKILL)
            self._wait_gone(pids)
            lost = node_local_dirs(self.spec, node)
            for d in lost:
                shutil.rmtree(d, ignore_errors=True)
            self.say(f"step {step}: lose-node: node {node} killed (ranks {list(ranks)}), "
                     f"{len(lost)} node-local director{'y' if len(lost) == 1 else 'ies'} "
                     f"deleted")
        else:
            pids = [self._rank_pid(r) for r in range(self.job.world_size)]
            for pid in pids:
                self._signal(pid, signal.SIGTERM)
            self.say(f"step {step}: preempt: SIGTERM to every rank "
                     f"(SIGKILL after {PREEMPT_GRACE_S:g} s)")

    def _end_outage(self, now: bool = False) -> None:
        """Start the object store again once its outage is over (``now``: whether it is or
        not)."""
        if self.outage_ends is None or (not now and time.monotonic() < self.outage_ends):
            return
        self.outage_ends = None
        down = time.monotonic() - self.outage_began
        started = time.monotonic()
        self.object_store.restart()
        self.say(f"the object store is up again after {down:.1f} s down (it took "
                 f"{time.monotonic() - started:.1f} s to start)")

    def _rank_pid(self, rank: int) -> int:
        """The pid rank ``rank`` of this run wrote, once it has."""
        path = pid_file(self.work_dir, rank)
        until = time.monotonic() + PID_WAIT_S
        while time.monotonic() < until:
            try:
                return int(path.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                time.sleep(POLL_S)
        raise _Stop(f"rank {rank} wrote no pid file ({path}) within {PID_WAIT_S:g} s")

    def _ours(self, pid: int) -> bool:
        """Whether ``pid`` is a live process of this contender's job (see the module)."""
        if pid <= 1 or pid == os.getpid():
            return False
        args = _cmdline(pid).split(b"\0")
        return all(m in args for m in self.marker)

    def _signal(self, pid: int, sig: int) -> bool:
        """Send ``sig`` to ``pid`` if it is ours; whether it was sent."""
        if not self._ours(pid):
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def _wait_gone(self, pids: list[int]) -> None:
        until = time.monotonic() + EXIT_WAIT_S
        while any(_alive(p) for p in pids) and time.monotonic() < until:
            time.sleep(POLL_S)

    def _dump_stacks(self) -> None:
        """Ask every rank still running to print its threads' stacks to its log (the job
        registers SIGUSR1 with faulthandler), before the run is killed: where it waited."""
        ranks = [pid for pid in self._ours_on_machine() if b"torch.distributed.run"
                 not in _cmdline(pid).split(b"\0")[1:3]]
        for pid in ranks:
            self._signal(pid, signal.SIGUSR1)
        if ranks:
            self.say(f"{len(ranks)} process(es) still running after the grace period; their "
                     f"stacks are in the run's logs")
            time.sleep(0.5)

    def _ours_on_machine(self) -> list[int]:
        """Every live process of this job, found by its arguments: ranks that never wrote a
        pid file, and ranks whose torchrun is gone, included."""
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and self._ours(int(entry)):
                pids.append(int(entry))
        return pids

    def _end_run(self) -> None:
        """Make sure no process of the run is left: SIGKILL to each torchrun session not yet
        reaped, then to every process of the job still there (ranks run in sessions of their
        own, so a torchrun session does not hold them); wait until they are gone."""
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            try:
                proc.wait(timeout=EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        left = self._ours_on_machine()
        for pid in left:
            self._signal(pid, signal.SIGKILL)
        self._wait_gone(left)

    def _final_ok(self, run_no: int) -> bool:
        """Whether every rank of run ``run_no`` printed FINAL OK, and no run restored a wrong
        state."""
        texts = {p: p.read_text(errors="replace") for p in self.outcome.logs}
        last = "".join(t for p, t in texts.items() if p.name.startswith(f"run{run_no}-"))
        return (last.count(FINAL_OK) == self.job.world_size and "FINAL BAD" not in last
                and not any("RESTORE BAD" in t for t in texts.values()))


class _Stop(Exception):
    """The contender's job cannot go on (a failure nobody struck, a timeout)."""
