"""What a timed operation costs: wall seconds, this process's CPU seconds (all threads, user +
system), minor page faults, another process's CPU seconds (a server's), and the settling done
before each clock starts so that no earlier work is paid for on it."""

from __future__ import annotations

import gc
import os
import resource
import time


def minor_faults() -> int:
    """Minor page faults of this process so far (all threads): touching freshly allocated
    memory costs one per page, so they tell a fresh buffer from a reused one."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def proc_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (0 when unknown or gone):
    a server's work during a benchmark."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class Clock:
    """``with Clock() as c: op()``: afterwards ``c.seconds`` (wall), ``c.cpu`` (this process,
    all threads) and ``c.faults`` (minor page faults) of ``op``, also when it raised;
    ``c.started`` is its ``time.perf_counter()`` at the start (for a later total). On a shared
    machine the CPU figure is the steady one: a contender that needs more CPU per byte loses
    more when the neighbours are busy."""

    started: float
    seconds: float
    cpu: float
    faults: int

    def __enter__(self) -> "Clock":
        """Start the clocks (the wall clock last: nothing of the start is on it)."""
        self._f0, self._c0 = minor_faults(), time.process_time()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        """Stop the clocks (the wall clock first)."""
        self.seconds = time.perf_counter() - self.started
        self.cpu = time.process_time() - self._c0
        self.faults = minor_faults() - self._f0


def quiesce(*, sync: bool = True, cuda: bool = False) -> None:
    """Untimed, before a timed operation: collect garbage, write dirty pages back (``sync``),
    let the GPU finish what is queued (``cuda``), so that no earlier work (an earlier output's
    deletion, a writeback) lands on the next contender's clock."""
    gc.collect()
    if sync:
        os.sync()
    if cuda:
        import torch
        torch.cuda.synchronize()
