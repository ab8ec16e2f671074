"""Start the suite's torchrun agents and ranks from an interpreter that has torch imported.

Every launch of a multi-rank test starts a torchrun agent per simulated node and a process per
rank, and each of them spends most of its CPU importing torch and DCP (about 1 s for an agent,
2 s for a rank on the 2-core CI machine: most of the suite's time). A *server* process imports
them once; a *launcher* (this file run as a script, importing only the standard library) asks
the server to fork a process that runs the real program: ``torch.distributed.run`` for an agent,
a test script for a rank. The agent is torchrun's own code and starts each rank through its own
launcher as it would start ``python script.py``; every rank is still a process of its own,
under torchrun, talking over gloo. Only the import is shared.

The launcher stands for the forked process: it passes on its standard streams, its
environment, its working directory and its arguments, forwards the signals it gets (SIGTERM
from torchrun or the test, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2) to the forked process's group,
and ends as the forked process ended (its exit status, or killed by the same signal). A forked
process whose launcher is gone (SIGKILLed) kills itself at once: nothing is left running. The
server imports no part of tierstore, fsspec or s3fs (tests check what a rank imports), and is
found through ``TIERSTORE_TEST_PREWARM`` (its socket, or several: rank r takes the r-th modulo
their number, so that the ranks of a job do not share a hash seed); without it, or when it does
not answer, the launcher runs the program itself, as ``python`` would.

    python tests/prewarm.py --serve SOCKET              # the server (tests/helpers.py starts it)
    python tests/prewarm.py -m torch.distributed.run ...  # an agent
    python tests/prewarm.py tests/scripts/worker.py ...   # a rank (as torchrun's script)
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import sys

#: Names the servers' sockets (joined by os.pathsep) in the environment of the launchers.
ENV = "TIERSTORE_TEST_PREWARM"
#: The signals a launcher passes on to the process it stands for.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_LEN = struct.Struct("!I")


def _send(conn: socket.socket, doc: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(doc).encode()
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    conn.sendmsg([_LEN.pack(len(data)) + data], ancillary)


def _receive(conn: socket.socket, with_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message (None at the end of the stream) and the descriptors that came with it."""
    fds = array.array("i")
    raw, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_LEN(with_fds * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    if not raw:
        return None, list(fds)
    (size,) = _LEN.unpack_from(raw)
    raw = raw[_LEN.size:]
    while len(raw) < size:
        more = conn.recv(size - len(raw))
        if not more:
            return None, list(fds)
        raw += more
    return json.loads(raw), list(fds)


def available() -> bool:
    """Whether this process's environment names a server (its children's launchers find it)."""
    return os.environ.get(ENV, "off") != "off"


def python_command(*argv: str, warm: bool) -> list[str]:
    """``python ARGV``; with ``warm``, started from the server (see :func:`torchrun_command`)."""
    return [sys.executable, *([__file__] if warm else []), *argv]


def torchrun_command(options: list[str], script: str, *args: str, warm: bool) -> list[str]:
    """``python -m torch.distributed.run OPTIONS SCRIPT ARGS``; with ``warm``, torchrun and
    each rank started from the server (whose socket the command's environment must name)."""
    launcher = [__file__] if warm else []
    return [sys.executable, *launcher, "-m", "torch.distributed.run", *options, *launcher,
            script, *args]


# -- the launcher ------------------------------------------------------------------------------

def launch(argv: list[str]) -> None:
    """Run ``python *argv`` in a process forked from the server; end as it ended."""
    # One of the servers (a list of sockets), by rank: ranks of one job get different
    # servers, and so different hash seeds, as processes started afresh would.
    paths = os.environ.get(ENV, "off").split(os.pathsep)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if paths == ["off"]:
            raise OSError("no server")
        conn.connect(paths[int(os.environ.get("RANK", "0")) % len(paths)])
        _send(conn, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}, [0, 1, 2])
        started, _ = _receive(conn)
    except OSError:
        started = None
    if started is None:  # no server: be the program itself
        conn.close()
        os.execv(sys.executable, [sys.executable, *argv])
    pid = started["pid"]

    def forward(signum, _frame):
        try:
            os.killpg(pid, signum)
        except OSError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    ended, _ = _receive(conn)
    status = ended["status"] if ended else 128 + signal.SIGKILL
    if status < 0:  # killed by a signal: so is the launcher
        for signum in {*FORWARDED, -status} - {signal.SIGKILL, signal.SIGSTOP}:
            signal.signal(signum, signal.SIG_DFL)  # (python ignores SIGPIPE, for one)
        sys.stdout.flush()
        os.kill(os.getpid(), -status)
    sys.exit(status)


# -- the server --------------------------------------------------------------------------------

def serve(path: str) -> None:
    """Import torch and DCP, then fork a process for every launcher that connects, until the
    process that started the server is gone."""
    import threading

    import torch  # noqa: F401 - what every forked process is spared
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.run  # noqa: F401

    # Forking is safe only from a process with one thread.
    assert threading.active_count() == 1, threading.enumerate()
    parent = os.getppid()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the managers below reap themselves
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # (a rank registers its own handler)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    listener.settimeout(1.0)
    os.rename(path + ".new", path)  # ready: the socket appears once it listens
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        if os.fork() == 0:
            listener.close()
            _manage(conn)
        conn.close()


def _manage(conn: socket.socket) -> None:
    """In a forked manager: fork the program's process, tell the launcher its pid, wait for it
    and tell the launcher how it ended."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    request, fds = _receive(conn, with_fds=3)
    if request is None or len(fds) != 3:
        os._exit(1)
    pid = os.fork()
    if pid == 0:
        _become(request, fds, conn)
    for fd in fds:
        os.close(fd)
    _send(conn, {"pid": pid})
    _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    try:
        _send(conn, {"status": code})
    except OSError:
        pass
    os._exit(0)


def _become(request: dict, fds: list[int], conn: socket.socket) -> None:
    """In the program's process: take the launcher's streams, environment, directory and
    arguments, and run the program; never returns."""
    import io
    import runpy
    import threading

    os.setsid()  # a group of its own, as torchrun gives a rank: signals reach its children too
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    # SIGUSR1 stays ignored (the server's): a test asking every process of a hung job for its
    # stacks reaches torchrun too, and only a rank registers a handler for it.
    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False))
    sys.stdout = io.TextIOWrapper(open(1, "wb", 0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", 0, closefd=False), write_through=True)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])

    def die_with_the_launcher():
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=die_with_the_launcher, daemon=True).start()
    argv, code = request["argv"], 0
    try:
        while argv and argv[0] in ("-u", "-B"):  # (the interpreter's flags torchrun passes)
            argv = argv[1:]
        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as python reports it
        import traceback

        traceback.print_exc()
        code = 1
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        launch(sys.argv[1:])
