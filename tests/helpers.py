"""What the tests share: state dicts and their bitwise comparison, free ports, and running the
scripts under tests/scripts (plain processes and torchrun jobs).

State dicts and comparisons are the conformance kit's (``tierstore_conformance``), which checks
plugins with the same ones; they come through ``tests/scripts/worker_common.py`` (imported here
as ``scripts.worker_common``), where the scripts, which run in subprocesses and cannot import
this module, find them too.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import prewarm
import pytest
from scripts.worker_common import (assert_state_dicts_equal, assert_trees_equal, empty_like,
                                   load_like, make_async_state, make_state_dict,
                                   mutate_everything)

__all__ = ["SCRIPTS", "assert_state_dicts_equal", "assert_trees_equal", "empty_like",
           "free_port", "load_like", "make_async_state", "make_state_dict", "mutate_everything",
           "run_script", "run_torchrun", "script_command", "script_env", "start_prewarm_server",
           "torchrun_command"]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
PREWARM = Path(__file__).resolve().parent / "prewarm.py"

# What a worker prints on a line of its own when something is wrong (run_worker's labels).
PROBLEM_WORDS = ("MISMATCH", "PROBLEM")


# --------------------------------------------------------------------------- subprocesses

def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_env(**extra: str) -> dict[str, str]:
    """The environment of a script's process: one OpenMP thread, unbuffered output, and none of
    the torch.distributed variables of a job this test may itself run in; where this process
    started a prewarmed-interpreter server (:func:`torchrun_command`), its socket; ``extra`` on
    top."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", prewarm.ENV):
        env.pop(name, None)
    if _prewarm.get("sockets"):
        env[prewarm.ENV] = _prewarm["sockets"]
    env[STACKS_ENV] = _stacks_directory()
    env.update(extra)
    return env


#: Names the directory where the ranks put their stack dumps (tests/scripts/worker_common.py).
STACKS_ENV = "TIERSTORE_TEST_STACKS"
_stacks: list[str] = []


def _stacks_directory() -> str:
    """This process's directory for its jobs' stack dumps, made on first use and removed at
    exit with what was left there (a rank killed with SIGKILL leaves its empty file)."""
    if not _stacks:
        _stacks.append(tempfile.mkdtemp(prefix="tierstore-test-stacks-"))
        atexit.register(shutil.rmtree, _stacks[0], True)
    return _stacks[0]


#: Servers per pytest worker: a process that starts afresh gets a hash seed of its own (string
#: hashes, and with them the order of sets of strings, differ between the ranks of a real job),
#: while the processes forked from one server share its seed. Rank r is forked from server
#: r % PREWARM_SERVERS, so the ranks of a job of up to 4 differ as they would.
PREWARM_SERVERS = 4

#: This process's prewarmed-interpreter servers: their processes, sockets and directory.
_prewarm: dict[str, Any] = {}


def start_prewarm_server() -> bool:
    """Start this process's prewarmed-interpreter servers (tests/prewarm.py) unless they run;
    whether torchrun's agents and ranks can be started from them. ``TIERSTORE_TEST_PREWARM=off``
    in the environment turns them off (every process then imports torch itself, as a plain
    ``torchrun`` does)."""
    if os.environ.get(prewarm.ENV) == "off":
        return False
    if "processes" not in _prewarm:
        directory = tempfile.mkdtemp(prefix="tierstore-prewarm-")
        paths = [os.path.join(directory, f"socket-{i}") for i in range(PREWARM_SERVERS)]
        env = script_env()
        env.pop(prewarm.ENV, None)
        env.pop("PYTHONHASHSEED", None)  # (a seed of its own for each server)
        log_path = os.path.join(directory, "servers.log")
        # (a log, not a pipe: nobody reads it while the servers run, and a full pipe would
        # stop whichever of their processes writes to it)
        with open(log_path, "wb") as log:
            procs = [subprocess.Popen([sys.executable, str(PREWARM), "--serve", path], env=env,
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=log)
                     for path in paths]
        _prewarm.update(processes=procs, directory=directory)
        deadline = time.monotonic() + 120
        while not all(map(os.path.exists, paths)) and time.monotonic() < deadline \
                and all(p.poll() is None for p in procs):
            time.sleep(0.05)
        if all(map(os.path.exists, paths)):
            _prewarm["sockets"] = os.pathsep.join(paths)
            atexit.register(_stop_prewarm_server)
        else:  # the tests run without them, saying why
            with open(log_path, errors="replace") as log:
                warnings.warn(f"the prewarmed-interpreter servers did not start; every process "
                              f"imports torch itself: {log.read()[-2000:]}", stacklevel=2)
            _stop_prewarm_server()
    return bool(_prewarm.get("sockets"))


def _stop_prewarm_server() -> None:
    for proc in _prewarm.get("processes", []):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _prewarm["sockets"] = None
    if _prewarm.get("directory"):
        shutil.rmtree(_prewarm.pop("directory"), ignore_errors=True)


def script_command(script: str, *args: Any) -> list[str]:
    """``python tests/scripts/<script> args...``: the script in one plain process."""
    return [sys.executable, str(SCRIPTS / script), *map(str, args)]


def run_script(script: str, *args: Any, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``script_command(script, *args)`` with ``script_env()``; its result, whatever its
    exit status (a test that kills it expects one)."""
    return subprocess.run(script_command(script, *args), env=script_env(), capture_output=True,
                          text=True, timeout=timeout)


def torchrun_command(script: str, *args: Any, nproc: int = 2, nnodes: int = 1,
                     node_rank: int = 0, port: int | None = None) -> list[str]:
    """``python -m torch.distributed.run`` running ``tests/scripts/<script>``: one node with its
    own rendezvous (``--standalone``), or node ``node_rank`` of ``nnodes`` meeting on
    127.0.0.1:``port``."""
    # Started from the prewarmed-interpreter server where it runs (tests/prewarm.py: torchrun
    # itself, each rank through a launcher as torchrun's script), saving each process the
    # seconds of importing torch.
    options = [f"--nproc-per-node={nproc}"]
    if nnodes == 1:
        options.append("--standalone")
    else:
        options += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--master-addr=127.0.0.1",
                    f"--master-port={port}"]
    return prewarm.torchrun_command(options, str(SCRIPTS / script), *map(str, args),
                                    warm=start_prewarm_server())


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM torchrun (it stops its ranks, which run in sessions of their own), then SIGKILL
    its session if it is still there after a grace period."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _dump_stacks(procs: list[subprocess.Popen]) -> str:
    """Ask every rank below ``procs`` for its threads' stacks, before a timed-out job is
    stopped, and return them: worker_common registers faulthandler on SIGUSR1, writing to
    ``tierstore-test-stacks-<pid>.txt`` in :func:`_stacks_directory`. What the job waited for
    is then in the report."""
    # (started from the prewarmed-interpreter server, the job's processes are below it)
    servers = _prewarm.get("processes", []) if _prewarm.get("sockets") else []
    pids = [pid for proc in [*procs, *servers] for pid in _descendants(proc.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(1)
    dumps = []
    for pid in pids:
        path = os.path.join(_stacks_directory(), f"tierstore-test-stacks-{pid}.txt")
        try:
            with open(path) as f:
                dumps.append(f"--- stacks of process {pid}\n{f.read()}")
            os.unlink(path)
        except OSError:
            pass
    return "\n".join(dumps)


def run_torchrun(script: str, *args: Any, nproc: int = 2, nnodes: int = 1,
                 timeout: float = 150, expect_ok: bool = True, killed: bool = False) -> str:
    """Run ``tests/scripts/<script>`` under torchrun, ``nproc`` ranks on each of ``nnodes``
    simulated nodes (one torchrun per node, concurrently, on a localhost rendezvous), and
    return the ranks' stdout (the nodes' one after the other).

    Fails the test, with stdout and the end of stderr, unless every torchrun exited 0 in time
    and no line says MISMATCH or PROBLEM; with ``expect_ok``, also unless every rank printed
    ``RANK <r> OK`` (what ``worker_common.run_worker`` prints for a rank without problems).
    ``killed``: the job's ranks kill themselves; every torchrun must still end in time, and
    its stdout is returned whatever the exit statuses."""
    port = free_port() if nnodes > 1 else None
    procs = [subprocess.Popen(
        torchrun_command(script, *args, nproc=nproc, nnodes=nnodes, node_rank=node, port=port),
        env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True) for node in range(nnodes)]
    outs, errs, timed_out, stacks = [], [], False, ""
    try:
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                stacks = _dump_stacks(procs)
                for p in procs:
                    _stop(p)
                out, err = proc.communicate()
            outs.append(out)
            errs.append(err)
    finally:
        for p in procs:
            _stop(p)
    stdout, stderr = "\n".join(outs), "\n".join(errs)
    # each node's stderr, its end: one node's long output must not hide another's
    report = f"--- stdout\n{stdout}\n" + "".join(
        f"--- stderr of node {n}\n{err[-20000 // len(errs):]}\n" for n, err in enumerate(errs))
    if timed_out:
        pytest.fail(f"torchrun ({script}) did not finish in {timeout} s\n{report}\n{stacks}")
    problems = [line for line in stdout.splitlines() if any(w in line for w in PROBLEM_WORDS)]
    codes = [p.returncode for p in procs]
    if killed:
        assert not problems, "\n".join(problems) + "\n" + report
        return stdout
    assert codes == [0] * nnodes and not problems, \
        f"torchrun exit statuses {codes}\n" + "\n".join(problems) + "\n" + report
    if expect_ok:
        for rank in range(nproc * nnodes):
            assert f"RANK {rank} OK" in stdout, report
    return stdout
