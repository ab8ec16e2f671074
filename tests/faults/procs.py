"""Forked processes: one child per step of a trial, and a pool of workers running trials.

torch is imported once, in the parent; every trial forks from it, which keeps a trial in the
tens of milliseconds. Nothing here starts a thread, and the processes that fork (the parent, the
workers) never open a store, so no child inherits a lock some other thread held.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import select
import selectors
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ChildResult", "run_child", "run_pool"]


@dataclass
class ChildResult:
    """How a forked child ended and what its function returned (None when it did not)."""

    code: int | None = None       # exit status, when it exited
    signal: int | None = None     # the signal that ended it
    timed_out: bool = False
    value: Any = None

    @property
    def killed(self) -> bool:
        """Whether SIGKILL ended it (and not our timeout)."""
        return self.signal == signal.SIGKILL and not self.timed_out

    def describe(self) -> str:
        """How it ended, in words."""
        if self.timed_out:
            return "did not finish in time (stacks in the log)"
        if self.signal is not None:
            return f"died of {signal.Signals(self.signal).name}"
        return f"exited with status {self.code}"


def run_child(fn: Callable[[], Any], *, log_path: str, timeout: float) -> ChildResult:
    """Run ``fn()`` in a forked child whose stdout and stderr go to ``log_path``; its return
    value comes back as JSON. A child still running after ``timeout`` seconds gets SIGUSR1
    (faulthandler writes every thread's stack to the log) and then SIGKILL."""
    _before_fork()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _child(fn, log_path, write_end)
    os.close(write_end)
    data, deadline, timed_out = b"", time.monotonic() + timeout, False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            _stop(pid)
            break
        ready, _, _ = select.select([read_end], [], [], left)
        if ready:
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            data += chunk
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    result = ChildResult(timed_out=timed_out)
    if os.WIFSIGNALED(status):
        result.signal = os.WTERMSIG(status)
    else:
        result.code = os.WEXITSTATUS(status)
    if data and result.code == 0:
        result.value = json.loads(data)["value"]
    return result


def _before_fork() -> None:
    """Flush what is buffered (or the child would write it again), and move every object to
    the collector's permanent generation: a collection in the child would otherwise write to
    every object's header and copy the parent's memory page by page."""
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()


def _child(fn: Callable[[], Any], log_path: str, write_end: int) -> None:
    """The forked side of :func:`run_child`: never returns."""
    code = 3
    try:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        data = json.dumps({"value": fn()}).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(write_end, view):]
        code = 0
    except BaseException:  # noqa: BLE001 - reported through the log and the exit status
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _stop(pid: int) -> None:
    """Ask a hung child for its stacks, then kill it."""
    try:
        os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_pool(count: int, run_one: Callable[[int, Any], Any], *, jobs: int,
             setup: Callable[[int], Any] = lambda worker: None,
             teardown: Callable[[Any], None] = lambda context: None,
             on_result: Callable[[int, Any], None] = lambda index, result: None) -> list[Any]:
    """Run ``run_one(i, context)`` for i in range(count) on ``jobs`` forked workers, handing
    out the next index to whichever worker is free (trials differ in length). Each worker
    builds its ``context`` with ``setup(worker)`` and ends with ``teardown(context)``. Results
    (JSON) come back in index order; a worker that dies takes its trial with it (the result is
    ``{"error": ...}``)."""
    results: list[Any] = [None] * count
    next_index = 0
    workers = []
    for w in range(max(1, min(jobs, count))):
        command_read, command_write = os.pipe()  # main -> worker: trial indexes
        answer_read, answer_write = os.pipe()    # worker -> main: results
        _before_fork()
        pid = os.fork()
        if pid == 0:
            os.close(command_write)
            os.close(answer_read)
            for other in workers:  # the other workers' pipe ends are not ours
                os.close(other["send"])
                os.close(other["receive"])
            _worker(w, command_read, answer_write, run_one, setup, teardown)
        os.close(command_read)
        os.close(answer_write)
        worker = {"pid": pid, "send": command_write, "receive": answer_read, "buffer": b"",
                  "busy": None}
        workers.append(worker)
    # Made after the forks: an epoll set is shared with the children that inherit it.
    sel = selectors.DefaultSelector()
    for worker in workers:
        sel.register(worker["receive"], selectors.EVENT_READ, worker)

    def hand_out(worker: dict) -> None:
        nonlocal next_index
        if next_index < count:
            worker["busy"] = next_index
            os.write(worker["send"], f"{next_index}\n".encode())
            next_index += 1
        else:
            worker["busy"] = None
            os.close(worker["send"])
            worker["send"] = None

    for worker in workers:
        hand_out(worker)
    while sel.get_map():
        for key, _ in sel.select():
            worker = key.data
            chunk = os.read(worker["receive"], 1 << 16)
            if not chunk:  # the worker is gone
                sel.unregister(worker["receive"])
                os.close(worker["receive"])
                if worker["busy"] is not None:
                    results[worker["busy"]] = {"error": "the worker running it died"}
                    on_result(worker["busy"], results[worker["busy"]])
                if worker["send"] is not None:
                    os.close(worker["send"])
                continue
            worker["buffer"] += chunk
            while b"\n" in worker["buffer"]:
                line, worker["buffer"] = worker["buffer"].split(b"\n", 1)
                message = json.loads(line)
                results[message["index"]] = message["result"]
                on_result(message["index"], message["result"])
                hand_out(worker)
    for worker in workers:
        os.waitpid(worker["pid"], 0)
    return [{"error": "never ran: every worker died"} if r is None else r for r in results]


def _worker(number: int, commands: int, answers: int, run_one: Callable[[int, Any], Any],
            setup: Callable[[int], Any], teardown: Callable[[Any], None]) -> None:
    """The forked side of :func:`run_pool`: never returns."""
    code = 0
    context = None
    try:
        context = setup(number)
        pending = b""
        while True:
            chunk = os.read(commands, 1 << 12)
            if not chunk:
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                index = int(line)
                try:
                    result = run_one(index, context)
                except Exception:  # noqa: BLE001 - a bug of the harness, reported as the result
                    result = {"error": traceback.format_exc()}
                data = json.dumps({"index": index, "result": result}).encode() + b"\n"
                view = memoryview(data)
                while view:
                    view = view[os.write(answers, view):]
    except BaseException:  # noqa: BLE001 - the worker ends; its trials are reported lost
        traceback.print_exc()
        code = 3
    finally:
        try:
            teardown(context)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
