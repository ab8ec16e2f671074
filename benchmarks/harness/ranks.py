"""Benchmarks that run as a job of several ranks: how a script started by hand launches itself
under ``torchrun`` (one invocation, ``--standalone``, or one per simulated node on a localhost
rendezvous), how its ranks share a temp dir and agree on a timed figure, and how rank 0's exit
status gets back to the launcher.

A script ``main`` is ``torchrun_main(argv, parse_args, worker, launch)``: inside torchrun it is
one rank (``worker``), else ``launch`` starts the torchrun invocations, typically with
:func:`relaunch` (the same arguments, rank 0's status back) or :func:`run_nodes`. A worker
ends with ``return finish_rank(rank, status)``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from .servers import free_port

#: set by a launcher that runs a benchmark under torchrun: where rank 0 leaves its exit status
STATUS_ENV = "TIERSTORE_BENCH_STATUS_FILE"

#: what torchrun sets in its ranks: left out of a launcher's environment, so that a launcher
#: that is itself inside a job starts a job of its own
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def under_torchrun() -> bool:
    """True inside a torchrun worker (torchrun sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_main(argv: list[str] | None, parse_args: Callable[[list[str]], argparse.Namespace],
                  worker: Callable[[argparse.Namespace], int],
                  launch: Callable[[argparse.Namespace, list[str]], int]) -> int:
    """A torchrun benchmark's entry point: inside torchrun be one rank (``worker``), else start
    the torchrun invocations (``launch``) with these arguments."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return worker(args) if under_torchrun() else launch(args, argv)


# -- launching -----------------------------------------------------------------------------------

def worker_env(**extra: str) -> dict[str, str]:
    """The environment of the torchrun invocations: this one less torchrun's own variables,
    one OpenMP thread a rank (the ranks share this machine's cores), unbuffered output (progress
    lines arrive as they come), and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def torchrun_command(script_args: list[str], nproc: int, *, nnodes: int | None = None,
                     node_rank: int = 0, port: int | None = None,
                     torchrun_args: tuple[str, ...] = ()) -> list[str]:
    """``torchrun`` (this interpreter's) running ``script_args``: ``--standalone`` with
    ``nproc`` ranks, or node ``node_rank`` of ``nnodes`` on a rendezvous at 127.0.0.1:``port``
    (``GROUP_RANK`` in the ranks is the node)."""
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--master-addr=127.0.0.1",
                f"--master-port={port}"]
    return [*cmd, f"--nproc-per-node={nproc}", *torchrun_args, *script_args]


def run_torchrun(script_args: list[str], nproc: int, *, env: dict[str, str] | None = None,
                 timeout: float | None = None) -> int:
    """One ``torchrun --standalone`` of ``script_args``, its output inherited; its exit
    status. Raises TimeoutError (after stopping it and its ranks) past ``timeout`` seconds;
    stops them too when this process is interrupted."""
    procs = [subprocess.Popen(torchrun_command(script_args, nproc),
                              env=worker_env() if env is None else env, start_new_session=True)]
    try:
        return procs[0].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"timed out after {timeout:.0f} s") from None
    finally:
        kill_all(procs)


def relaunch(script: str, argv: list[str], nproc: int, *, timeout: float | None = None,
             **env: str) -> int:
    """``script`` again under ``torchrun --standalone --nproc-per-node nproc`` with ``argv``
    (and ``env`` set in the ranks): rank 0's exit status (left by :func:`finish_rank`), or
    torchrun's own when a rank failed."""
    with temp_file("tierstore-bench-status-") as status:
        rc = run_torchrun([os.path.abspath(script), *argv], nproc,
                          env=worker_env(**env, **{STATUS_ENV: status}), timeout=timeout)
        return rc if rc != 0 else read_status(status)


@dataclass
class NodesRun:
    """How the torchrun invocations of :func:`run_nodes` ended: their exit statuses (None:
    stopped), why they failed (None: every one exited 0) and their log files (when logged)."""

    codes: list[int | None]
    why: str | None
    logs: list[str] = field(default_factory=list)

    def tail(self, lines: int = 25, marks: tuple[str, ...] = ("PROBLEM", "Error")) -> str:
        """The end of every node's log, after its lines with one of ``marks`` (a failure's
        likely cause, from anywhere in the log)."""
        out = []
        for path in self.logs:
            try:
                with open(path, errors="replace") as f:
                    got = f.read().splitlines()
            except OSError:
                got = []
            marked = [ln for ln in got if any(m in ln for m in marks)]
            out.append(f"--- {os.path.basename(path)}\n" + "\n".join(marked[-8:] + got[-lines:]))
        return "\n".join(out)


def run_nodes(script_args: list[str], nnodes: int, nproc: int, *, timeout: float,
              env: dict[str, str] | None = None, log_dir: str | None = None, label: str = "job",
              grace: float = 30.0, torchrun_args: tuple[str, ...] = ()) -> NodesRun:
    """One torchrun per simulated node (``nproc`` ranks each), all at once on a localhost
    rendezvous, as a multi-node job runs. Their output goes to ``log_dir/<label>-node<n>.log``
    (inherited without ``log_dir``). Every one is stopped, ranks included, once ``timeout``
    seconds have passed, ``grace`` seconds after one of them failed (the others would wait for
    it forever), or when this process is interrupted."""
    port = free_port()
    env = worker_env() if env is None else env
    logs = ([os.path.join(log_dir, f"{label}-node{n}.log") for n in range(nnodes)]
            if log_dir else [])
    procs: list[subprocess.Popen] = []
    why = None
    try:
        for node in range(nnodes):
            cmd = torchrun_command(script_args, nproc, nnodes=nnodes, node_rank=node, port=port,
                                   torchrun_args=torchrun_args)
            if logs:
                with open(logs[node], "w") as out:
                    procs.append(subprocess.Popen(cmd, env=env, stdout=out,
                                                  stderr=subprocess.STDOUT,
                                                  start_new_session=True))
            else:
                procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + grace):
                why = f"timed out after {timeout:.0f} s" if now > deadline else "a node failed"
                kill_all(procs)
                break
            time.sleep(0.2)
    finally:
        kill_all(procs)
    codes = [p.returncode for p in procs]
    if why is None and any(codes):
        why = f"torchrun exit statuses {codes}"
    return NodesRun(codes, why, logs)


def descendants(pids: list[int]) -> list[int]:
    """Every living descendant of ``pids`` (torchrun starts its ranks in new sessions, so a
    process-group kill would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM the torchrun invocations still running (they stop their ranks), then SIGKILL
    whatever of them and their ranks is left after a grace period."""
    alive = [p for p in procs if p.poll() is None]
    if not alive:
        return
    victims = descendants([p.pid for p in alive])
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(p.poll() is None for p in alive):
        time.sleep(0.2)
    for pid in [*victims, *(p.pid for p in alive if p.poll() is None)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in alive:
        p.wait()


# -- inside the job --------------------------------------------------------------------------------

def shared_temp_dir(prefix: str, parent: str | None,
                    problem: Callable[[], str | None] | None = None) -> str:
    """A fresh temp dir under ``parent`` that rank 0 makes, its path given to every rank of the
    default group. ``problem`` (run on rank 0 first): why not (the room it lacks), which every
    rank then exits with."""
    box: list = [None]
    if dist.get_rank() == 0:
        why = problem() if problem is not None else None
        box = [why or tempfile.mkdtemp(prefix=prefix, dir=parent)]
    dist.broadcast_object_list(box, src=0)
    if not os.path.isabs(box[0]):
        raise SystemExit(box[0])
    return box[0]


def max_over_ranks(values: list[float]) -> list[float]:
    """Each value's maximum over the ranks of the default group (``all_reduce`` MAX): a timed
    operation's figure is its slowest rank's. Without torch.distributed: ``values`` as they are."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def barrier() -> None:
    """Every rank here (nothing without torch.distributed)."""
    if dist.is_initialized():
        dist.barrier()


@contextmanager
def temp_file(prefix: str) -> Iterator[str]:
    """An empty temp file for what a rank hands back to its launcher (its exit status, its
    results), removed afterwards."""
    fd, path = tempfile.mkstemp(prefix=prefix)
    os.close(fd)
    try:
        yield path
    finally:
        os.remove(path)


def read_status(path: str) -> int:
    """The exit status rank 0 left in ``path`` (1 when it left none)."""
    with open(path) as f:
        text = f.read().strip()
    return int(text) if text else 1


def finish_rank(rank: int, status: int) -> int:
    """End a torchrun rank: tear down its default process group and return its exit code.
    Under a launcher (``STATUS_ENV`` set) rank 0 leaves ``status`` in its file and every rank
    exits 0: a failed acceptance target is the report's verdict, not a crash for torchrun to
    bury under its own failure report."""
    dist.destroy_process_group()
    if not os.environ.get(STATUS_ENV):
        return status
    if rank == 0:
        with open(os.environ[STATUS_ENV], "w") as f:
            f.write(str(status))
    return 0
