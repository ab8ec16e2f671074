"""Peer replication: its throughput against a raw gloo exchange, and what it costs training.

Why
---
A ``peer`` tier keeps every rank's files on another rank too (``replication = { strategy =
"ring", offset = 1 }``): after each save commits, a background thread on every rank sends that
rank's files to its holder and receives its source's files, point to point over a gloo group of
the store's own (``tierstore.engine.replication``, ``tierstore.transport.transfer``). Two questions decide
whether that is usable: does the replication move bytes about as fast as the link allows, and
does turning it on hold training up?

What is measured
----------------
The benchmark runs under torchrun (``--nproc`` ranks, default 2, gloo on loopback). Run without
torchrun, it launches itself with ``torchrun --standalone --nproc-per-node=<nproc>`` and rank 0
prints the report. Every rank has its own state dict of ``--size-mib`` MiB of random fp32 data in
``--tensors`` tensors (default 256 MiB in 64 tensors; the keys carry the rank, so DCP does not
deduplicate them and each rank writes all of its own bytes). Two stores are opened at the start,
with their directories under ``--dir`` (default /dev/shm; ``{rank}`` in the paths, so each rank
has its own directories even though a standalone torchrun puts every rank on node 0), each with
the one tier of the README's peer-replica set-up:

=========  ===============================================================================
``on``     tier ``peer`` (``peer``, keep 2, ``replication = { strategy = "ring", offset = 1 }``)
``off``    the same tier as a plain ``memory`` tier (keep 2): the same save, no replication
=========  ===============================================================================

A peer tier reuses the pages of the checkpoints ``keep`` drops (``tierstore_plugins.recycle``),
so saves, sends and receives touch only pages that exist once ``keep`` + 1 saves have been
made: the default two warm-up rounds (four saves into ``on``) get there, and the report adds the
first replication of the run (every page new) as a separate, *cold* line.

**Replication throughput** (``replicate`` against ``raw-gloo``, alternating, the first one
rotating per round):

* ``replicate``: ``dcp.save`` into ``on``, then ``store.wait()``; the figure is the
  ``replicated`` event of each rank (observed with a plugin passed to
  ``tierstore.open(plugins=[...])``): its ``seconds`` run from when every rank has agreed that
  the save committed everywhere (an all-gather) to when the received replicas are committed
  (file lists exchanged, staging directories made, every file sent from its mapped pages in
  pieces of ``[store] copy_chunk_mib`` MiB while received pieces land in the mapped pages of
  recycled files and are checksummed in a helper thread, the replicas' manifests checked and
  committed); its ``nbytes`` are the bytes sent plus the bytes received.
* ``raw-gloo``: the same bytes in the same pattern with nothing else: on a gloo group of its
  own, each rank ``isend``s pieces of exactly the sizes its replication sent (its files of the
  latest ``replicate`` save, cut at ``copy_chunk_mib`` MiB, to the ranks that event named in
  ``to``) and ``irecv``s what its sources send, round ``k`` moving the ``k``-th piece of every
  pair, ``ROUNDS_IN_FLIGHT`` rounds posted before the oldest is waited for, as
  ``run_transfers`` does. Sent from and received
  into buffers allocated and touched beforehand. Timed from a barrier on that group (the
  replication's clock also starts right after a collective) to this rank's last ``wait``.

A round's figure is its slowest rank's (the replication is done when the last rank is); GB/s is
10^9 bytes (sent + received, per rank) per second.

**Training stall and slowdown** (``on`` against ``off``, alternating, the first one rotating):
each rank "trains": a step is a 384x384 fp32 matmul chain plus a 64 KiB ``all_reduce`` on the
default group (the step's end is agreed in that all-reduce, so all ranks run the same steps).
For each store, in a round:

1. quiet steps for ``--train-s`` seconds with nothing in the background;
2. ``dcp.async_save(sd, storage_writer=store.writer(), process_group=store.process_group)``:
   the *stall* is the time until it returns (and its staging is complete), the slowest rank's;
3. busy steps from there until the save's upload is done (and, for ``on``, the replication has
   finished) on every rank, at least ``--train-s`` seconds;
4. ``future.result()`` and ``store.wait()``.

The slowdown is the median busy step over the median quiet step (all ranks' steps of the round);
for ``on`` also the steps that overlap the replication window (the ``replicate`` phase to the
``replicated`` event, per rank). The median says how much slower a typical step is, not for how
long; the training time *lost* to the background is the busy steps' total time minus as many
quiet steps (the median one), the slowest rank's: ``on`` minus ``off`` is what the replication
costs training per checkpoint.

Acceptance targets:

* replication >= 0.8x the raw gloo exchange (ratio of GB/s medians)
* async_save stall with the peer tier on <= 1.1x with it off (ratio of median seconds)

and informational lines for the training-step slowdown and the training time lost. Ratios are
of medians; the per-round ratios (same round, same machine state) are printed beside them. CPU s
is process CPU time (user + system, all threads) summed over the ranks: for ``replicate`` between
the ``replicate`` phase and the ``replicated`` event, for ``raw-gloo`` the exchange itself.

How to run
----------
From the repository root::

    .venv/bin/python benchmarks/replication.py              # 2 ranks, 256 MiB each, 5 rounds
    .venv/bin/python benchmarks/replication.py --nproc 4 --size-mib 128
    .venv/bin/python benchmarks/replication.py --repeat 9 --json /tmp/replication.json

Progress lines go to stderr (rank 0's), the report to stdout. ``--strict`` makes the exit status
1 when a target is missed (for CI). The temp directory is removed at the end, also after an error.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore.events import EventKind, Phase
from tierstore.transport.transfer import ROUNDS_IN_FLIGHT

from harness import (GB, benchmark_parser, finish_rank, finish_report, fs_type, median,
                     memory_parent, nbytes_of, parse_rounds, print_table, print_verdicts,
                     progress_log, rank_state_dict, ratios, relaunch, room_problem, rotated,
                     rounds_text, shared_temp_dir, torchrun_main, verdict)

REP_CONTENDERS = ("replicate", "raw-gloo")
STALL_CONTENDERS = ("on", "off")
PEER_TIER = "peer"
KEEP = 2                  # checkpoints each tier keeps
MANIFEST = "tierstore.json"  # the tier's manifest: not sent (the headers carry it)

MATMUL_N = 384            # training step: a chain of MATMUL_REPS matmuls of this size ...
MATMUL_REPS = 4
GRAD_FLOATS = 16 << 10    # ... and an all_reduce of 64 KiB
MAX_BUSY_S = 300.0        # a background that never finishes must not hang the benchmark

# Acceptance targets.
REPLICATION_VS_RAW_MIN = 0.8  # replicate GB/s / raw gloo exchange GB/s, at least
STALL_ON_VS_OFF_MAX = 1.1     # async_save stall, peer tier on / off (seconds), at most



# -- launching -----------------------------------------------------------------------------------

def without_nproc(argv: list[str]) -> list[str]:
    """``argv`` less ``--nproc N`` / ``--nproc=N`` (or an abbreviation): the ranks do not need
    it, and torchrun's own parser would take it for its ``--nproc-per-node``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if len(name) > 2 and "--nproc".startswith(name) and arg.startswith("--"):
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this script under ``torchrun --standalone --nproc-per-node=<nproc>`` with the same
    arguments; return rank 0's exit status (torchrun's own when a rank failed)."""
    return relaunch(__file__, without_nproc(argv), args.nproc)


# -- observing the stores ------------------------------------------------------------------------

@dataclass
class Trace:
    """What one checkpoint did on this rank, in ``time.perf_counter()`` seconds (and process CPU
    seconds at the replication's start and end)."""
    replicate_at: float | None = None     # Phase.REPLICATE announced
    replicate_cpu: float | None = None
    publish_at: float | None = None       # first replica commit reached PUBLISH (transfers done)
    replicated_at: float | None = None    # the replicated event
    replicated_cpu: float | None = None
    replicated: Any = None                # the event itself
    failed: list[str] = field(default_factory=list)


class Recorder:
    """Observer passed to ``tierstore.open(plugins=[...])``: keeps a :class:`Trace` per
    checkpoint id from the phases and events of the replication (and the staged event)."""

    def __init__(self) -> None:
        """Nothing seen yet."""
        self.traces: dict[str, Trace] = {}
        self.staged: Any = None  # the latest staged event (async_save's copy; it has no id)
        self._lock = threading.Lock()

    def trace(self, cid: str) -> Trace:
        """The trace of ``cid`` (an empty one until something happens)."""
        with self._lock:
            return self.traces.setdefault(cid, Trace())

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail) -> None:
        """Time the replication's start and the end of its transfers."""
        now, cpu = time.perf_counter(), time.process_time()
        if checkpoint_id is None:
            return
        t = self.trace(checkpoint_id)
        if phase == Phase.REPLICATE:
            t.replicate_at, t.replicate_cpu = now, cpu
        elif (phase == Phase.PUBLISH and tier and tier.startswith(f"{PEER_TIER}:")
              and t.publish_at is None):
            t.publish_at = now

    @tierstore.hookimpl
    def tierstore_event(self, event) -> None:
        """Keep the replicated and staged events (and failures)."""
        now, cpu = time.perf_counter(), time.process_time()
        if event.kind == EventKind.STAGED:
            self.staged = event
        if event.checkpoint_id is None:
            return
        t = self.trace(event.checkpoint_id)
        if event.kind == EventKind.REPLICATED:
            t.replicated, t.replicated_at, t.replicated_cpu = event, now, cpu
        elif event.kind == EventKind.FAILED:
            t.failed.append(str(event.detail.get("error", event)))

    def background_done(self, cid: str, replicated: bool) -> bool:
        """True once (with ``replicated``) the replication of ``cid`` has finished or failed
        on this rank."""
        t = self.trace(cid)
        return bool(t.failed) or not replicated or t.replicated is not None


# -- stores --------------------------------------------------------------------------------------

def store_config(root: str, peer: bool, args: argparse.Namespace) -> dict:
    """One tier: ``peer`` (``peer`` True) or a plain memory tier in its place."""
    tier: dict = {"name": PEER_TIER, "backend": "peer" if peer else "memory",
                  "path": f"{root}/peer/{{rank}}", "keep": KEEP}
    if peer:
        tier["replication"] = {"strategy": "ring", "offset": 1}
    config: dict = {"tier": [tier]}
    store_table = {}
    if args.io_threads is not None:
        store_table["io_threads"] = args.io_threads
    if args.chunk_mib is not None:
        store_table["copy_chunk_mib"] = args.chunk_mib
    if store_table:
        config["store"] = store_table
    return config


@dataclass
class Bench:
    """Everything a rank's rounds need."""
    args: argparse.Namespace
    rank: int
    world: int
    base: str
    sd: dict[str, torch.Tensor]
    stores: dict[str, "tierstore.Store"]
    recorders: dict[str, Recorder]
    raw_group: Any
    piece_bytes: int
    trainer: "Trainer"
    saves: dict[str, int] = field(default_factory=lambda: {"on": 0, "off": 0})
    last_on: str | None = None           # id of the latest save into "on"
    pattern: "RawPattern | None" = None  # the raw exchange, built from the latest replication

    def next_id(self, name: str) -> str:
        """A fresh checkpoint id for store ``name``."""
        self.saves[name] += 1
        return f"step-{self.saves[name]}"


# -- the raw gloo exchange -----------------------------------------------------------------------

def rank_files(bench: Bench, cid: str) -> list[tuple[str, int]]:
    """(name, size) of the files this rank's replication sends for ``cid``: its files in the
    ``on`` store's ``peer`` tier directory, manifest excepted (rank 0's include ``.metadata``),
    in name order (the order of ``Replicator._replicate``)."""
    d = os.path.join(bench.base, "on", "peer", str(bench.rank), cid)
    names = sorted(n for n in os.listdir(d) if n != MANIFEST)
    return [(n, os.path.getsize(os.path.join(d, n))) for n in names]


def pieces_of(files: list[tuple[str, int]], piece_bytes: int) -> list[int]:
    """Piece lengths of a pair's files, in order: each file cut at ``piece_bytes``."""
    return [min(piece_bytes, size - off) for _name, size in files
            for off in range(0, size, piece_bytes)]


@dataclass
class RawPattern:
    """This rank's side of the raw exchange: the pieces it sends to each holder and receives
    from each source, and the buffers they come from and go to (allocated and touched once)."""
    send: dict[int, list[int]]
    recv: dict[int, list[int]]
    send_buf: torch.Tensor
    recv_bufs: dict[int, torch.Tensor]
    nbytes: int                           # sent + received

    @staticmethod
    def build(bench: Bench, event: Any) -> "RawPattern":
        """From the latest replication: this rank's files and the replicated event's ``to`` and
        ``from``. Collective on the raw group (every rank's file sizes are shared)."""
        mine = rank_files(bench, bench.last_on)
        sent = sum(size for _n, size in mine) * len(event.detail["to"])
        if sent != event.detail["sent"]:
            raise SystemExit(f"rank {bench.rank}: the replication sent {event.detail['sent']} "
                             f"bytes, this rank's files in the peer tier hold {sent}")
        everyone: list[Any] = [None] * bench.world
        dist.all_gather_object(everyone, mine, group=bench.raw_group)
        send = {dst: pieces_of(mine, bench.piece_bytes) for dst in event.detail["to"]}
        recv = {src: pieces_of(everyone[src], bench.piece_bytes) for src in event.detail["from"]}
        out = max((sum(p) for p in send.values()), default=0)
        send_buf = torch.full((out,), 7, dtype=torch.uint8)
        recv_bufs = {src: torch.full((sum(p),), 0, dtype=torch.uint8) for src, p in recv.items()}
        nbytes = sum(sum(p) for p in send.values()) + sum(sum(p) for p in recv.values())
        return RawPattern(send, recv, send_buf, recv_bufs, nbytes)

    def run(self, group: Any) -> None:
        """Round ``k`` posts the ``k``-th piece of every pair (isend and irecv at once);
        ``ROUNDS_IN_FLIGHT`` rounds are posted before the oldest is waited for; as
        ``tierstore.transport.transfer.run_transfers`` does."""
        plan = [(dst, True, p) for dst, p in self.send.items()]
        plan += [(src, False, p) for src, p in self.recv.items()]
        offsets = {(peer, out): 0 for peer, out, _p in plan}
        depth = max((len(p) for _peer, _out, p in plan), default=0)
        in_flight: collections.deque = collections.deque()
        for k in range(depth):
            works = []
            for peer, out, pieces in plan:
                if k >= len(pieces):
                    continue
                off, n = offsets[(peer, out)], pieces[k]
                offsets[(peer, out)] = off + n
                if out:
                    works.append(dist.isend(self.send_buf[off:off + n], group_dst=peer,
                                            group=group))
                else:
                    works.append(dist.irecv(self.recv_bufs[peer][off:off + n], group_src=peer,
                                            group=group))
            in_flight.append(works)
            if len(in_flight) == ROUNDS_IN_FLIGHT:
                for w in in_flight.popleft():
                    w.wait()
        for works in in_flight:
            for w in works:
                w.wait()


# -- training ------------------------------------------------------------------------------------

class Trainer:
    """A stand-in training loop: each step a chain of matmuls, then an all_reduce of a small
    "gradient" on the default group, whose last element carries each rank's wish to stop (so all
    ranks run the same number of steps and never leave one waiting in the all_reduce)."""

    def __init__(self, world: int) -> None:
        """The matrices and the gradient buffer, allocated once."""
        gen = torch.Generator().manual_seed(1)
        self.a = torch.randn(MATMUL_N, MATMUL_N, generator=gen) / MATMUL_N ** 0.5
        self.x = torch.randn(MATMUL_N, MATMUL_N, generator=gen)
        self.grad = torch.zeros(GRAD_FLOATS + 1)
        self.world = world

    def run(self, min_s: float, done: Callable[[], bool],
            max_s: float = MAX_BUSY_S) -> list[tuple[float, float]]:
        """Steps until every rank has run ``min_s`` seconds and ``done()`` is true on every
        rank (or ``max_s`` passed); returns each step's (start, end) ``perf_counter`` times."""
        steps: list[tuple[float, float]] = []
        t_start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            y = self.x
            for _ in range(MATMUL_REPS):
                y = torch.tanh(self.a @ y)
            self.grad[:GRAD_FLOATS] = y[0, 0]
            elapsed = t0 - t_start
            self.grad[GRAD_FLOATS] = float((elapsed >= min_s and done()) or elapsed >= max_s)
            dist.all_reduce(self.grad)
            t1 = time.perf_counter()
            steps.append((t0, t1))
            if int(self.grad[GRAD_FLOATS].item()) == self.world:
                return steps


# -- the run -------------------------------------------------------------------------------------

def settle() -> None:
    """Untimed, before each timed operation: collect garbage, then line every rank up."""
    gc.collect()
    dist.barrier()


def run_replicate(bench: Bench) -> dict:
    """``dcp.save`` into the ``on`` store, ``store.wait()``; this rank's replicated event."""
    store, rec = bench.stores["on"], bench.recorders["on"]
    cid = bench.next_id("on")
    settle()
    t0 = time.perf_counter()
    dcp.save(bench.sd, storage_writer=store.writer(), checkpoint_id=cid,
             process_group=store.process_group)
    t_saved = time.perf_counter()
    store.wait()
    t_done = time.perf_counter()
    bench.last_on = cid
    t = rec.trace(cid)
    if t.failed or t.replicated is None:
        raise SystemExit(f"rank {bench.rank}: {cid} was not replicated: "
                         f"{'; '.join(t.failed) or 'no replicated event'}")
    ev = t.replicated
    return {"seconds": ev.seconds, "nbytes": ev.nbytes, "sent": ev.detail["sent"],
            "received": ev.detail["received"], "to": ev.detail["to"], "from": ev.detail["from"],
            "cpu": t.replicated_cpu - t.replicate_cpu,
            "transfer_s": (t.publish_at or t.replicated_at) - t.replicate_at,
            "commit_s": t.replicated_at - (t.publish_at or t.replicated_at),
            "save_s": t_saved - t0,
            "wait_s": t_done - t_saved, "event": ev}


def run_raw(bench: Bench) -> dict:
    """The raw exchange of the latest replication's pieces, timed from a barrier on its group."""
    assert bench.pattern is not None
    gc.collect()
    dist.barrier()
    dist.barrier(group=bench.raw_group)
    c0, t0 = time.process_time(), time.perf_counter()
    bench.pattern.run(bench.raw_group)
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"seconds": secs, "nbytes": bench.pattern.nbytes, "cpu": cpu}


def run_stall(bench: Bench, name: str) -> dict:
    """Quiet steps, ``dcp.async_save`` (the stall), busy steps until the background is done on
    every rank, then ``future.result()`` and ``store.wait()``."""
    store, rec = bench.stores[name], bench.recorders[name]
    cid = bench.next_id(name)
    train_s = bench.args.train_s
    settle()
    quiet = bench.trainer.run(train_s, lambda: True)
    settle()
    rec.staged = None
    t0 = time.perf_counter()
    resp = dcp.async_save(bench.sd, storage_writer=store.writer(), checkpoint_id=cid,
                          process_group=store.process_group)
    staging_completion = getattr(resp, "staging_completion", None)
    if staging_completion is not None:  # an AsyncSaveResponse
        staging_completion.result()
    stall = time.perf_counter() - t0
    upload = getattr(resp, "upload_completion", resp)
    busy = bench.trainer.run(
        train_s, lambda: upload.done() and rec.background_done(cid, replicated=name == "on"))
    t_busy = time.perf_counter()
    upload.result()
    store.wait()
    t = rec.trace(cid)
    if t.failed:
        raise SystemExit(f"rank {bench.rank}: {name} {cid} failed: {'; '.join(t.failed)}")
    if name == "on":
        bench.last_on = cid
    during_rep: list[float] = []
    if t.replicate_at is not None and t.replicated_at is not None:
        during_rep = [e - s for s, e in busy if e > t.replicate_at and s < t.replicated_at]
    quiet_s, busy_s = [e - s for s, e in quiet], [e - s for s, e in busy]
    staged = rec.staged
    return {"stall": stall, "staged_s": staged.seconds if staged else None,
            "staged_waited_s": staged.detail.get("waited_s") if staged else None,
            "quiet": quiet_s, "busy": busy_s, "during_rep": during_rep,
            "lost_s": sum(busy_s) - len(busy_s) * median(quiet_s),
            "busy_s": t_busy - t0,
            "rep_s": (t.replicated.seconds if t.replicated is not None else None)}


def run_round(rnd: int, bench: Bench, log: Callable[[str], None]) -> list[dict]:
    """One round on this rank: the replication and the raw exchange (rotated), then
    the stall with the peer tier on and off (rotated). Returns every rank's figures (rank
    order), gathered untimed at the end."""
    mine: dict[str, Any] = {}
    for name in rotated(REP_CONTENDERS, rnd):
        if name == "replicate":
            mine[name] = run_replicate(bench)
            # The raw pattern follows the latest replication's files (sizes barely change).
            bench.pattern = RawPattern.build(bench, mine[name].pop("event"))
        else:
            mine[name] = run_raw(bench)  # round 0 runs "replicate" first: pattern set
    for name in rotated(STALL_CONTENDERS, rnd):
        mine[name] = run_stall(bench, name)
    everyone: list[Any] = [None] * bench.world
    dist.all_gather_object(everyone, mine)
    if bench.rank == 0:
        rep = max(everyone, key=lambda r: r["replicate"]["seconds"])["replicate"]
        raw = max(everyone, key=lambda r: r["raw-gloo"]["seconds"])["raw-gloo"]
        stall = {n: max(r[n]["stall"] for r in everyone) for n in STALL_CONTENDERS}
        log(f"  round {rnd + 1} replicate {rep['seconds']:6.3f} s "
            f"{rep['nbytes'] / rep['seconds'] / GB:5.2f} GB/s (transfer {rep['transfer_s']:.3f}"
            f" s, commit {rep['commit_s']:.3f} s)"
            f" | raw-gloo {raw['seconds']:6.3f} s {raw['nbytes'] / raw['seconds'] / GB:5.2f} GB/s"
            f" | stall on {stall['on']:.3f} s, off {stall['off']:.3f} s")
    return everyone


# -- the report ----------------------------------------------------------------------------------

def summarize(rounds: list[list[dict]], payload: int) -> dict:
    """Per round the slowest rank's figures (step times: every rank's steps), medians, ratios
    and verdicts as a JSON-able dict."""
    fig: dict[str, dict] = {}
    for name in REP_CONTENDERS:
        secs, gbps, cpu, nbytes = [], [], [], []
        for ranks in rounds:
            slowest = max(ranks, key=lambda r: r[name]["seconds"])[name]
            secs.append(slowest["seconds"])
            nbytes.append(slowest["nbytes"])
            gbps.append(slowest["nbytes"] / slowest["seconds"] / GB)
            cpu.append(sum(r[name]["cpu"] for r in ranks))
        fig[name] = {"seconds": secs, "median_s": median(secs), "gbps_rounds": gbps,
                     "gbps": median(gbps), "bytes_per_rank": median(nbytes), "cpu_seconds": cpu,
                     "median_cpu_s": median(cpu)}
    rep_rounds = [max(ranks, key=lambda r: r["replicate"]["seconds"])["replicate"]
                  for ranks in rounds]
    fig["replicate"]["parts"] = {
        k: median([r[k] for r in rep_rounds])
        for k in ("transfer_s", "commit_s", "save_s", "wait_s")}
    for name in STALL_CONTENDERS:
        stalls = [max(r[name]["stall"] for r in ranks) for ranks in rounds]
        quiet = [median([s for r in ranks for s in r[name]["quiet"]]) for ranks in rounds]
        busy = [median([s for r in ranks for s in r[name]["busy"]]) for ranks in rounds]
        # Rounds whose replication window held no step (or "off", which has none) are left out.
        during = [median([s for r in ranks for s in r[name]["during_rep"]]) for ranks in rounds]
        during_q = [(d, q) for d, q in zip(during, quiet) if d is not None]
        # The staged event of the rank with the longest stall: the copy inside that stall.
        staged = [max(ranks, key=lambda r: r[name]["stall"])[name]["staged_s"]
                  for ranks in rounds]
        fig[f"stall-{name}"] = {
            "seconds": stalls, "median_s": median(stalls), "staged_s": staged,
            "median_staged_s": median([x for x in staged if x is not None]),
            "quiet_step_s": quiet, "busy_step_s": busy, "during_rep_step_s": during,
            "median_quiet_step_s": median(quiet), "median_busy_step_s": median(busy),
            "median_during_rep_step_s": median([d for d, _q in during_q]),
            "slowdown_rounds": [b / q for b, q in zip(busy, quiet)],
            "rep_slowdown_rounds": [d / q for d, q in during_q],
            "busy_s": [max(r[name]["busy_s"] for r in ranks) for ranks in rounds],
            "lost_s": [max(r[name]["lost_s"] for r in ranks) for ranks in rounds],
            "steps_busy": [len(ranks[0][name]["busy"]) for ranks in rounds]}

    rep, raw = fig["replicate"], fig["raw-gloo"]
    on, off = fig["stall-on"], fig["stall-off"]
    verdicts = [
        verdict(f"replication >= {REPLICATION_VS_RAW_MIN}x raw gloo exchange of the same "
                f"pieces (GB/s, slowest rank)",
                rep["gbps"] / raw["gbps"],
                ratios(rep["gbps_rounds"], raw["gbps_rounds"]),
                least=REPLICATION_VS_RAW_MIN),
        verdict(f"async_save stall with the peer tier on <= {STALL_ON_VS_OFF_MAX}x off "
                f"(seconds, slowest rank)",
                on["median_s"] / off["median_s"],
                ratios(on["seconds"], off["seconds"]),
                most=STALL_ON_VS_OFF_MAX),
    ]
    info = [
        {"target": "training step while the background runs (save, replication), "
                   "peer tier on, vs quiet steps",
         "ratio": median(on["slowdown_rounds"]), "per_round": on["slowdown_rounds"]},
        {"target": "training step while the background runs (save), peer tier off, "
                   "vs quiet steps",
         "ratio": median(off["slowdown_rounds"]), "per_round": off["slowdown_rounds"]},
        {"target": "training step during the replication window (replicate phase to "
                   "replicated event), peer tier on, vs quiet steps",
         "ratio": median(on["rep_slowdown_rounds"]), "per_round": on["rep_slowdown_rounds"]},
        {"target": "training time lost to the replication per checkpoint (training s lost, "
                   "peer tier on minus off, slowest rank)",
         "seconds": median(on["lost_s"]) - median(off["lost_s"]),
         "per_round": [a - b for a, b in zip(on["lost_s"], off["lost_s"])]},
    ]
    return {"figures": fig, "payload_bytes": payload, "verdicts": verdicts,
            "informational": info}


def print_report(summary: dict, args: argparse.Namespace, base: str, world: int,
                 piece_bytes: int) -> None:
    """Markdown tables and verdict lines on stdout."""
    f = summary["figures"]
    payload = summary["payload_bytes"]
    rep, raw = f["replicate"], f["raw-gloo"]
    print()
    print(f"{world} ranks (torchrun --standalone, gloo on loopback), {payload / (1 << 20):.0f} "
          f"MiB fp32 per rank in {args.tensors} tensors, {args.repeat} rounds after "
          f"{args.warmup} warm-up; tiers under {base} ({fs_type(base)}); ring offset 1, pieces "
          f"of {piece_bytes >> 20} MiB; {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"tierstore io_threads={args.io_threads or 'default'}")
    print(f"A round's figure is its slowest rank's. GB/s: bytes sent + received per rank "
          f"({rep['bytes_per_rank'] / 1e6:.1f} MB) per second. CPU s: process CPU time "
          f"(user+system, all threads) summed over the ranks.")
    print()
    rows = [[op, label, f"{s['median_s']:.3f}", f"{s['gbps']:.2f}", r,
             f"{s['median_cpu_s']:.2f}", rounds_text(s["seconds"])] for op, label, s, r in (
        ("replicate", "tierstore peer replication (replicated event)",
         rep, f"{rep['gbps'] / raw['gbps']:.2f}x raw-gloo"),
        ("replicate", "raw gloo isend/irecv, same pieces, same pattern", raw,
         "1.00x (baseline)"))]
    for name, label in (("on", "async_save stall, peer tier on"),
                        ("off", "async_save stall, peer tier off")):
        s = f[f"stall-{name}"]
        r = (f"{s['median_s'] / f['stall-off']['median_s']:.2f}x off (time)" if name == "on"
             else "1.00x (baseline)")
        rows.append(["stall", label, f"{s['median_s']:.3f}", "-", r, "-",
                     rounds_text(s["seconds"])])
    print_table(["op", "contender", "median s:", "GB/s:", "ratio", "CPU s:", "rounds (s)"], rows)
    parts = rep["parts"]
    print()
    print(f"Replication (slowest rank, medians): {parts['transfer_s']:.3f} s from the "
          f"replicate phase to the first replica's publish (headers, every piece sent, "
          f"received and checksummed, manifests checked), {parts['commit_s']:.3f} s "
          f"committing. dcp.save itself took {parts['save_s']:.3f} s, store.wait() after it "
          f"{parts['wait_s']:.3f} s.")
    cold = summary["cold"]
    print(f"Cold (the first replication of the run, warm-up: no dropped checkpoint's pages to "
          f"reuse yet, every page new): {cold['seconds']:.3f} s, "
          f"{cold['nbytes'] / cold['seconds'] / GB:.2f} GB/s; dcp.save {cold['save_s']:.3f} s.")
    print()
    print(f"Training: a step is {MATMUL_REPS} matmuls of {MATMUL_N}x{MATMUL_N} fp32 and an "
          f"all_reduce of {GRAD_FLOATS * 4 >> 10} KiB on the default group. Quiet steps: "
          f"{args.train_s} s with nothing in the background; busy steps: from async_save's "
          f"return until the save (and the replication) are done on every rank. "
          f"Step times: medians over all ranks' steps; busy s, busy steps (per rank) and "
          f"training s lost (busy steps' time minus as many quiet steps): the slowest rank's. "
          f"Staging copy s: the staged event's seconds (tierstore's copy of the state dict) "
          f"inside the longest stall of the round.")
    print()
    rows = []
    for name in STALL_CONTENDERS:
        s = f[f"stall-{name}"]
        during = s["median_during_rep_step_s"]
        rep_slow = median(s["rep_slowdown_rounds"])
        dr = [f"{during * 1e3:.1f}", f"{rep_slow:.2f}x"] if during is not None else ["-", "-"]
        copy = "-" if s["median_staged_s"] is None else f"{s['median_staged_s']:.3f}"
        rows.append([name, f"{s['median_s']:.3f}", copy, f"{s['median_quiet_step_s'] * 1e3:.1f}",
                     f"{s['median_busy_step_s'] * 1e3:.1f}",
                     f"{median(s['slowdown_rounds']):.2f}x", *dr, f"{median(s['busy_s']):.2f}",
                     f"{median(s['steps_busy']):.0f}", f"{median(s['lost_s']):.2f}"])
    print_table(["store", "stall s:", "staging copy s:", "quiet step ms:", "busy step ms:",
                 "slowdown:", "step ms during replication:", "slowdown:", "busy s:",
                 "busy steps:", "training s lost:"], rows)
    print()
    print_verdicts(summary["verdicts"], missed="MISS")
    for v in summary["informational"]:
        unit = " s" if "seconds" in v else "x"
        value = v.get("seconds", v.get("ratio"))
        rounds = ", ".join(f"{x:.2f}{unit}" for x in v["per_round"])
        shown = "n/a" if value is None else f"{value:.2f}{unit}"
        print(f"INFO: {v['target']}: {shown} (per round: {rounds or 'none'})")


# -- main ----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The shared options (``--size-mib`` defaulting to 256 here) plus ``--nproc``,
    ``--chunk-mib`` and ``--train-s``."""
    p = benchmark_parser(__doc__, 5, "gloo connections, thread start-up, allocator growth, "
                         "and the first keep + 1 saves, which find no dropped checkpoint's "
                         "pages to reuse",
                         "parent of the temp directory holding every tier (default /dev/shm)",
                         size_mib=256, per_rank=True, warmup=2)
    p.set_defaults(dir="/dev/shm")
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks (torchrun --nproc-per-node) when not already under torchrun "
                        "(default 2)")
    p.add_argument("--chunk-mib", type=int, default=None,
                   help="tierstore [store] copy_chunk_mib, the piece size of the transfers and "
                        "of the raw exchange (default: tierstore's own default)")
    p.add_argument("--train-s", type=float, default=0.5,
                   help="seconds of quiet training steps, and the least seconds of busy ones "
                        "(default 0.5)")
    args = parse_rounds(p, argv)
    if args.nproc < 2:
        p.error("--nproc must be at least 2 (ring replication needs a peer)")
    return args


def worker(args: argparse.Namespace) -> int:
    """One rank: set up, warm-up and timed rounds, then rank 0 reports."""
    t_start = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = progress_log(args.quiet or rank != 0)
    base = None
    stores: dict[str, tierstore.Store] = {}
    status = 0
    try:
        def problem() -> str | None:
            memory_parent(args.dir, "--dir", "the memory and peer tiers would be on disk")
            # keep + 1 (a recycled one) in both stores, as many replicas held, and slack.
            return room_problem(args.dir,
                                (4 * (KEEP + 1) + 2) * args.size_mib * (1 << 20) * world)

        base = shared_temp_dir("tierstore-replication-", args.dir, problem)
        sd = rank_state_dict(args.size_mib, args.tensors, rank)
        recorders = {"on": Recorder(), "off": Recorder()}
        for name in STALL_CONTENDERS:
            stores[name] = tierstore.open(
                store_config(os.path.join(base, name), name == "on", args),
                plugins=[recorders[name]])
        raw_group = dist.new_group(backend="gloo")
        bench = Bench(args, rank, world, base, sd, stores, recorders, raw_group,
                      stores["on"]._ctx.config.copy_chunk_mib << 20, Trainer(world))
        log(f"{world} ranks, benchmark dir {base} ({fs_type(base)}), pieces of "
            f"{bench.piece_bytes >> 20} MiB")
        warm = []
        for w in range(args.warmup):
            log(f"warm-up round {w + 1} (not counted)")
            warm.append(run_round(w, bench, lambda _m: None))
        rounds = [run_round(rnd, bench, log) for rnd in range(args.repeat)]
        for store in stores.values():
            store.close()
        stores.clear()
        if rank == 0:
            summary = summarize(rounds, nbytes_of(sd))
            first = warm[0] if warm else rounds[0]
            slowest = max(first, key=lambda r: r["replicate"]["seconds"])["replicate"]
            summary["cold"] = {k: slowest[k] for k in ("seconds", "nbytes", "save_s")}
            print_report(summary, args, base, world, bench.piece_bytes)
            config = {"nproc": world, "size_mib": args.size_mib, "tensors": args.tensors,
                      "repeat": args.repeat, "warmup": args.warmup, "bytes_per_rank":
                      nbytes_of(sd), "dir": args.dir, "fs_type": fs_type(args.dir),
                      "io_threads": args.io_threads, "piece_bytes": bench.piece_bytes,
                      "replication": {"strategy": "ring", "offset": 1},
                      "train_s": args.train_s, "matmul": [MATMUL_N, MATMUL_REPS],
                      "all_reduce_floats": GRAD_FLOATS}
            status = finish_report(args, config, summary, t_start)
        dist.barrier()
    finally:
        for store in stores.values():
            store.close(wait=False)
        if rank == 0 and base is not None:
            shutil.rmtree(base, ignore_errors=True)
    return finish_rank(rank, status)


def main(argv: list[str] | None = None) -> int:
    """Under torchrun: be one rank. Otherwise: launch torchrun with these arguments."""
    return torchrun_main(argv, parse_args, worker, launch)


if __name__ == "__main__":
    sys.exit(main())
