"""The prewarmed-interpreter launcher (tests/prewarm.py) stands for the process it starts: what
the multi-rank tests (and torchrun) see of a rank must be what they would see of ``python
script.py``: its arguments, environment, directory and streams, its exit status, its death by a
signal, signals sent to it, and no process left behind when the launcher is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import helpers
import prewarm
import pytest

#: prints what it was given, then does what argv[1] says
PROGRAM = """
import os, signal, sys, time
print("ARGV", sys.argv[1:], flush=True)
print("CWD", os.getcwd(), flush=True)
print("ENV", os.environ.get("PREWARM_PROBE"), flush=True)
print("TORCH ALREADY", "torch" in sys.modules, flush=True)
print("HASH", hash("tierstore"), flush=True)
print("LINE", sys.stdin.readline().strip(), flush=True)
what = sys.argv[1]
if what == "exit":
    sys.exit(int(sys.argv[2]))
if what == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
if what == "sigpipe":  # (a signal python itself ignores)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)
if what == "raise":
    raise ValueError("from the program")
if what in ("wait", "term"):
    if what == "term":
        signal.signal(signal.SIGTERM, lambda *_: (print("GOT SIGTERM", flush=True), os._exit(7)))
    with open(sys.argv[2], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)
"""


@pytest.fixture
def program(tmp_path):
    path = tmp_path / "program.py"
    path.write_text(PROGRAM)
    return str(path)


def start(program: str, *args: str, warm: bool = True, **env: str) -> subprocess.Popen:
    if warm:
        if os.environ.get(prewarm.ENV) == "off":
            pytest.skip(f"the prewarmed interpreter is turned off ({prewarm.ENV}=off)")
        assert helpers.start_prewarm_server(), "the prewarmed-interpreter server did not start"
    env = helpers.script_env(PREWARM_PROBE="probe", **env)
    if not warm:
        env.pop(prewarm.ENV, None)
    return subprocess.Popen([sys.executable, str(helpers.PREWARM), program, *args], env=env,
                            cwd=os.path.dirname(program), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("warm", [True, False], ids=["from-the-server", "without-a-server"])
def test_the_program_gets_what_python_would_give_it_and_its_exit_status(program, warm):
    proc = start(program, "exit", "3", warm=warm)
    out, err = proc.communicate("a line on stdin\n", timeout=60)
    assert proc.returncode == 3, err
    assert f"ARGV ['exit', '3']\nCWD {os.path.dirname(program)}\nENV probe\n" in out, out
    # torch was imported by the server, once, and by nobody without it
    assert f"TORCH ALREADY {warm}" in out, out
    assert "LINE a line on stdin" in out, out


def test_the_ranks_of_a_job_do_not_share_a_hash_seed(program):
    """String hashes (and the order of sets of strings) differ between processes started
    afresh; ranks forked from one server would share them and agree where a real job's ranks
    do not."""
    hashes = set()
    for rank in range(helpers.PREWARM_SERVERS):
        proc = start(program, "exit", "0", RANK=str(rank))
        out, err = proc.communicate("\n", timeout=60)
        assert proc.returncode == 0 and "TORCH ALREADY True" in out, err
        hashes.add(next(line for line in out.splitlines() if line.startswith("HASH ")))
    assert len(hashes) == helpers.PREWARM_SERVERS, hashes


def test_an_exception_prints_its_traceback_and_exits_1(program):
    proc = start(program, "raise")
    out, err = proc.communicate("\n", timeout=60)
    assert proc.returncode == 1
    assert "ValueError: from the program" in err and "Traceback" in err, err


@pytest.mark.parametrize("sig", ["sigkill", "sigpipe"])
def test_a_program_killed_by_a_signal_is_a_launcher_killed_by_it(program, sig):
    proc = start(program, sig)
    proc.communicate("\n", timeout=60)
    assert proc.returncode == -getattr(signal, sig.upper())


def test_sigterm_to_the_launcher_reaches_the_program(program, tmp_path):
    proc = start(program, "term", str(tmp_path / "pid"))
    proc.stdin.write("\n")
    proc.stdin.flush()
    _wait_for(tmp_path / "pid")
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 7 and "GOT SIGTERM" in out, out


def test_a_launcher_killed_leaves_no_program_running(program, tmp_path):
    proc = start(program, "wait", str(tmp_path / "pid"))
    proc.stdin.write("\n")
    proc.stdin.flush()
    pid = int(_wait_for(tmp_path / "pid"))
    assert pid != proc.pid  # the program is the server's fork, not the launcher
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), f"the program {pid} outlived its launcher"


def _wait_for(path) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.exists(path) and open(path).read():
            return open(path).read()
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
