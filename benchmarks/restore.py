"""Restore after a lost node: shards back from the peer replicas, against the object tier.

Why
---
A ``peer`` tier exists for one moment: a node is lost, its replacement has empty node-local
tiers, and its ranks must get their checkpoint shards back. With replicas of every rank's files
on another node (``replication = { strategy = "clique", factor = 2, jump = <ranks per node> }``)
those shards come over torch.distributed from the surviving node's memory instead of from the
slower shared/object tier behind it. This benchmark measures how much faster that restore is,
with same-run baselines (the machine is noisy: ratios are reported, timings never asserted).

What is measured
----------------
Two simulated nodes x 2 ranks: run without torchrun, the script starts two torchrun invocations
itself (``--nnodes=2 --node-rank=N --nproc-per-node=2`` on a localhost rendezvous, as
tests/test_node_local.py does), so ``{node}`` in the tier paths differs per node; rank 0 prints
the report. Every rank has its own state dict of ``--size-mib`` MiB (default 64) of random fp32 in
``--tensors`` tensors (keys carry the rank: each rank saves and loads its own bytes). Tiers, all
under a fresh temp dir under ``--dir`` (default /dev/shm, removed at the end, also on failure):

===========  ===================================================================================
``ram``      ``memory``, path ``<dir>/ram/{node}``, keep 2
``peer``     ``peer``, path ``<dir>/peer/{node}``, keep 2, ``replication = { strategy = "clique",
             factor = 2, jump = 2 }``: rank r's replica sits on rank r +- 2, the other node
``objects``  ``fsspec``, url ``file://<dir>/objects`` (shared, no keep)
===========  ===================================================================================

One checkpoint is saved (``dcp.save`` through ``store.writer()``, then
``store.wait(all_ranks=True)``: the replicas and the drain to ``objects`` are complete) and that
store is closed. Node 1's leader then copies node 1's ``ram`` and ``peer`` directories (its
``.replicas`` included) aside once; before each contender the state is put back from that copy,
so every load starts from the same files (re-saving would cost a full save + replication per
contender and move the files' pages around). Contenders, in an order rotating per round:

* ``peer-restore``: node 1 lost (its leader deletes ``ram/1`` and ``peer/1`` between barriers).
  The load on node 1's ranks gets their files from node 0's replicas (``peer_fetched`` events;
  checked: every node-1 file fetched, no ``read_file`` phase from ``objects`` on any rank).
* ``object-tier``: node 1 lost, and node 0's replicas of node 1's ranks hidden too (its
  ``.replicas/<src>-held-by-<holder>`` directories for src on node 1 moved aside), so node 1's
  ranks read their files from ``objects`` (checked: ``read_file`` from ``objects``, no fetch).
* ``intact``: nothing lost; every rank reads its own node's ``ram`` copy (checked): the lower
  bound.

Each contender opens a fresh store on every rank (``tierstore.open`` with the same config, an
observer plugin attached; untimed), zeroes the destination tensors (untimed), waits at a barrier,
then times ``dcp.load(..., storage_reader=store.reader(), process_group=store.process_group)``
on every rank. A round's figure is its slowest rank's seconds; GB/s is this rank's tensor bytes
(10^9) over that. After every load each rank compares what it loaded with what it saved
bitwise; a difference prints ``MISMATCH`` and the run exits non-zero. A load that took its
files from an unexpected place exits non-zero too (the figure would mean something else).

Reading guide
-------------
``peer-restore / object-tier`` below 1 is the point of the peer tier: the fraction of the
object-tier restore time the peer restore needs. ``peer-restore / intact`` says what the lost
node costs beyond a load from local RAM (the transfer from node 0 plus its checksum). Here
``objects`` is ``file://`` on tmpfs, far faster than a real object store (no network, no server,
no request latency; compare benchmarks/object_store.py: ~0.5 GB/s from a local S3 server), so the
peer-vs-object ratio here is an upper bound of what a real S3 would give: the real gain is larger.
Both "nodes" share this machine's CPUs and the "network" is loopback, so the peer transfer is
CPU-bound here, not link-bound: on a 2-CPU machine the peer restore can be *slower* than a
``file://`` read from tmpfs, which is a memory copy. The INFO lines split the slowest rank's
load into DCP's metadata and planning, the reader's ``read_data`` (peer fetch and file reads)
and DCP's finish (observed ``peer_fetch`` phase and ``loaded`` event), and give the
``peer_fetched`` seconds (the transfer and its checksum) alone.

How to run
----------
From the repository root::

    .venv/bin/python benchmarks/restore.py                       # 64 MiB per rank, 1 warm-up + 3 rounds
    .venv/bin/python benchmarks/restore.py --size-mib 16 --repeat 1
    .venv/bin/python benchmarks/restore.py --repeat 7 --json /tmp/restore.json

Progress lines go to stderr (rank 0's), the report to stdout. ``--timeout`` (default 600 s) kills
both torchrun invocations and their ranks when the run takes longer.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore import EventKind
from tierstore.events import Phase

from harness import (GB, STATUS_ENV, benchmark_parser, finish_rank, finish_report, fs_type,
                     memory_parent, nbytes_of, need_room, parse_rounds, print_table,
                     progress_log, rank_state_dict, ratios, read_status, rotated, rounds_text,
                     run_nodes, scratch, shared_temp_dir, temp_file, torchrun_main, worker_env)

CONTENDERS = ("peer-restore", "object-tier", "intact")
NODES, PER_NODE = 2, 2
KEEP = 2
CID = "step-1"
LOST = 1                     # the node that is lost
DIR_ENV = "TIERSTORE_BENCH_RESTORE_DIR"        # set by the launcher: the temp dir
HELD_RE = re.compile(r"^(\d+)-held-by-(\d+)$")


# -- launching -----------------------------------------------------------------------------------

def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Both nodes' torchrun running this script, concurrently; returns rank 0's exit status
    (non-zero when a torchrun failed or the run timed out). The temp dir is made here and
    removed here, whatever happens to the ranks."""
    memory_parent(args.dir, "--dir", "the ram and peer tiers would be on disk")
    # tiers, replicas, the copy aside
    need_room(args.dir, 7 * args.size_mib * (1 << 20) * NODES * PER_NODE)
    with scratch("tierstore-restore-", args.dir) as base, \
            temp_file("tierstore-restore-status-") as status:
        run = run_nodes([os.path.abspath(__file__), *argv], NODES, PER_NODE,
                        timeout=args.timeout,
                        env=worker_env(**{DIR_ENV: base, STATUS_ENV: status}))
        if run.why is not None:
            print(f"restore benchmark: {run.why}", file=sys.stderr)
            return 1
        return read_status(status)


# -- the store and the simulated loss ------------------------------------------------------------

def store_config(base: str, args: argparse.Namespace) -> dict:
    """The three tiers (see the module docstring)."""
    config: dict = {"tier": [
        {"name": "ram", "backend": "memory", "path": f"{base}/ram/{{node}}", "keep": KEEP},
        {"name": "peer", "backend": "peer", "path": f"{base}/peer/{{node}}", "keep": KEEP,
         "replication": {"strategy": "clique", "factor": 2, "jump": PER_NODE}},
        {"name": "objects", "backend": "fsspec", "url": f"file://{base}/objects"},
    ]}
    if args.io_threads is not None:
        config["store"] = {"io_threads": args.io_threads}
    return config


class Observer:
    """Plugin: which tier each data file was read from (``read_file`` phases, in order), which
    files came from peers (``peer_fetched``) and failures."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, str]] = []
        self.fetched: list[tuple[str, int, float]] = []
        self.failed: list[str] = []
        self.fetch_at: float | None = None   # perf_counter() at the peer_fetch phase
        self.loaded: tuple[float, float] | None = None  # (perf_counter(), seconds) of loaded

    @tierstore.hookimpl
    def tierstore_phase(self, phase, tier, detail) -> None:
        if phase == Phase.READ_FILE:
            self.reads.append((detail["file"], tier))
        elif phase == Phase.PEER_FETCH and self.fetch_at is None:
            self.fetch_at = time.perf_counter()

    @tierstore.hookimpl
    def tierstore_event(self, event) -> None:
        if event.kind == EventKind.PEER_FETCHED:
            self.fetched.append((event.detail["file"], event.detail["from"], event.seconds))
        elif event.kind == EventKind.LOADED:
            self.loaded = (time.perf_counter(), event.seconds)
        elif event.kind == EventKind.FAILED:
            self.failed.append(str(event.detail.get("error", event)))


def node_dirs(base: str, node: int) -> dict[str, str]:
    return {"ram": os.path.join(base, "ram", str(node)),
            "peer": os.path.join(base, "peer", str(node))}


def lost_ranks() -> set[int]:
    return {LOST * PER_NODE + i for i in range(PER_NODE)}


def set_scene(name: str, base: str, node: int, local_rank: int) -> None:
    """Collective: put the files as contender ``name`` needs them. Node 1's leader restores its
    directories from the copy aside (``intact``) or deletes them (node lost); node 0's leader
    puts back node 1's replicas, and hides them again for ``object-tier``."""
    dist.barrier()
    if local_rank == 0 and node == LOST:
        for path in node_dirs(base, LOST).values():
            shutil.rmtree(path, ignore_errors=True)
        if name == "intact":
            for kind, path in node_dirs(base, LOST).items():
                shutil.copytree(os.path.join(base, "aside", kind), path, symlinks=True)
    if local_rank == 0 and node != LOST:
        replicas = os.path.join(node_dirs(base, node)["peer"], ".replicas")
        hidden = os.path.join(base, "aside", f"replicas-{node}")
        os.makedirs(hidden, exist_ok=True)
        for entry in os.listdir(hidden):  # put back what an object-tier round hid
            target = os.path.join(replicas, entry)
            shutil.rmtree(target, ignore_errors=True)  # an empty one a store may have made
            os.rename(os.path.join(hidden, entry), target)
        if name == "object-tier":
            for entry in os.listdir(replicas):
                m = HELD_RE.match(entry)
                if m and int(m.group(1)) in lost_ranks():
                    os.rename(os.path.join(replicas, entry), os.path.join(hidden, entry))
    dist.barrier()


def expected_sources(name: str, rank: int, obs: Observer) -> list[str]:
    """What is wrong with where this rank's files came from for contender ``name``."""
    problems = [f"failure event: {f}" for f in obs.failed]
    fetched = {f for f, _src, _s in obs.fetched}
    last_tier: dict[str, str] = {}
    for f, tier in obs.reads:
        last_tier[f] = tier
    files = fetched | set(last_tier)
    if not files:
        problems.append("read no data file")
    if any(not f.startswith(f"__{rank}_") for f in files):
        problems.append(f"read other ranks' files: {sorted(files)}")
    lost = rank in lost_ranks()
    from_objects = sorted(f for f, t in obs.reads if t == "objects")
    if name == "peer-restore":
        if lost and (set(last_tier) or not fetched):
            problems.append(f"expected every file from a peer, got fetched {sorted(fetched)}, "
                            f"read {last_tier}")
        if from_objects:
            problems.append(f"read_file from objects: {from_objects}")
    elif name == "object-tier":
        if fetched:
            problems.append(f"fetched from peers: {sorted(fetched)}")
        if lost and any(t != "objects" for t in last_tier.values()):
            problems.append(f"expected every file from objects, got {last_tier}")
    from_ram = not fetched and all(t == "ram" for t in last_tier.values())
    if (not lost or name == "intact") and not from_ram:
        problems.append(f"expected every file from ram, got {last_tier}, fetched "
                        f"{sorted(fetched)}")
    return problems


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def run_contender(name: str, base: str, args: argparse.Namespace, sd: dict[str, torch.Tensor],
                  dest: dict[str, torch.Tensor], node: int, local_rank: int) -> dict:
    """One contender on every rank; returns every rank's figures (all-gathered)."""
    rank = dist.get_rank()
    set_scene(name, base, node, local_rank)
    for t in dest.values():
        t.zero_()
    obs = Observer()
    store = tierstore.open(store_config(base, args), plugins=[obs])
    try:
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        dcp.load(dest, storage_reader=store.reader(), checkpoint_id=CID,
                 process_group=store.process_group)
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        store.close()
    bad = [k for k, v in sd.items() if not bitwise_equal(dest[k], v)]
    for k in bad[:5]:
        print(f"MISMATCH rank {rank} contender {name}: {k} differs from what was saved",
              flush=True)
    # Where the time went: DCP's metadata and planning up to the reader's read_data, then
    # read_data (the peer fetch, if any, and the reads), then DCP's finish.
    split = None
    if obs.loaded is not None:
        at, rd = obs.loaded
        split = (at - rd - t0, rd, t0 + secs - at)
    mine = {"rank": rank, "seconds": secs, "cpu": cpu, "mismatch": len(bad), "split": split,
            "problems": expected_sources(name, rank, obs),
            "fetch_s": max((s for *_x, s in obs.fetched), default=None)}
    return {"name": name, "ranks": dist_all_gather(mine)}


def dist_all_gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# -- report --------------------------------------------------------------------------------------

def summarize(rounds: list[dict[str, dict]], nbytes: int) -> dict:
    """Per contender: slowest-rank seconds per round and medians; the node-level slowest too."""
    out: dict[str, Any] = {"contenders": {}, "verdicts": []}
    for name in CONTENDERS:
        per = [r[name]["ranks"] for r in rounds]
        slowest = [max(x["seconds"] for x in ranks) for ranks in per]
        lost = [max(x["seconds"] for x in ranks if x["rank"] in lost_ranks()) for ranks in per]
        kept = [max(x["seconds"] for x in ranks if x["rank"] not in lost_ranks())
                for ranks in per]
        fetch = [max((x["fetch_s"] for x in ranks if x["fetch_s"] is not None), default=None)
                 for ranks in per]
        # the slowest rank's split of each round
        splits = [max(ranks, key=lambda x: x["seconds"])["split"] for ranks in per]
        med = statistics.median(slowest)
        out["contenders"][name] = {
            "seconds": slowest, "median_s": med, "gbps": nbytes / med / GB,
            "node1_median_s": statistics.median(lost), "node0_median_s": statistics.median(kept),
            "cpu_s": statistics.median(sum(x["cpu"] for x in ranks) for ranks in per),
            "fetch_s": fetch, "splits": splits}
    c = out["contenders"]
    for a, b in (("peer-restore", "object-tier"), ("peer-restore", "intact")):
        out["ratios"] = out.get("ratios", [])
        out["ratios"].append({
            "name": f"{a} / {b}", "ratio": c[a]["median_s"] / c[b]["median_s"],
            "per_round": ratios(c[a]["seconds"], c[b]["seconds"])})
    return out


def print_report(summary: dict, args: argparse.Namespace, nbytes: int, base: str) -> None:
    print()
    print(f"{NODES} nodes x {PER_NODE} ranks, {nbytes / (1 << 20):.0f} MiB fp32 per rank in "
          f"{args.tensors} tensors, {args.repeat} rounds after {args.warmup} warm-up; dir {base} "
          f"({fs_type(os.path.dirname(base))}); {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"tierstore {tierstore.__version__}")
    print("Load time: dcp.load on every rank from a barrier, the slowest rank's; GB/s: one "
          "rank's bytes over it. Node 0 / node 1 s: the slowest rank of that node. CPU s: process "
          "CPU time summed over the 4 ranks. The object tier is file:// on tmpfs: far faster than "
          "a real object store.")
    print()
    c = summary["contenders"]
    where = {"peer-restore": "node 0's replicas (peer fetch)",
             "object-tier": "`objects` (file://)", "intact": "own node's `ram`"}
    rows = []
    for name in CONTENDERS:
        s = c[name]
        if name == "peer-restore":
            r = (f"{s['median_s'] / c['object-tier']['median_s']:.2f}x object-tier, "
                 f"{s['median_s'] / c['intact']['median_s']:.2f}x intact")
        else:
            r = f"{c['peer-restore']['median_s'] / s['median_s']:.2f}x (peer-restore / this)"
        rows.append([name, where[name], f"{s['median_s']:.3f}", f"{s['gbps']:.2f}", r,
                     f"{s['node0_median_s']:.3f}", f"{s['node1_median_s']:.3f}",
                     f"{s['cpu_s']:.2f}", rounds_text(s["seconds"])])
    print_table(["contender", "node 1's ranks read from", "median s:", "GB/s:", "ratio",
                 "node 0 s:", "node 1 s:", "CPU s:", "rounds (s)"], rows)
    print()
    for v in summary["ratios"]:
        rounds = ", ".join(f"{x:.2f}" for x in v["per_round"])
        print(f"INFO: time {v['name']}: {v['ratio']:.2f}x (per round: {rounds})")
    for name in CONTENDERS:
        sp = [x for x in c[name]["splits"] if x is not None]
        if sp:
            before, read, after = (statistics.median(x[i] for x in sp) for i in range(3))
            print(f"INFO: {name}: slowest rank's load = {before:.3f} s metadata and plan + "
                  f"{read:.3f} s read_data (peer fetch and reads) + {after:.3f} s finish (medians)")
    fetch = [f for f in c["peer-restore"]["fetch_s"] if f is not None]
    if fetch:
        print(f"INFO: peer fetch alone (peer_fetched event seconds, slowest rank): median "
              f"{statistics.median(fetch):.3f} s of the peer-restore load")


# -- the ranks -----------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, 3, "gloo connections, thread start-up, first touch of the "
                         "destination and fetch buffers",
                         "parent of the temp directory holding every tier (default /dev/shm)",
                         size_mib=64, tensors=16, per_rank=True)
    p.set_defaults(dir="/dev/shm")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds before both torchrun invocations are killed (default 600)")
    return parse_rounds(p, argv)


def worker(args: argparse.Namespace) -> int:
    """One rank: save once, then warm-up and timed rounds; rank 0 reports."""
    t_start = time.perf_counter()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(60, args.timeout / 2)))
    rank, world = dist.get_rank(), dist.get_world_size()
    node, local_rank = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    if world != NODES * PER_NODE or int(os.environ["LOCAL_WORLD_SIZE"]) != PER_NODE:
        raise SystemExit(f"run with {NODES} nodes x {PER_NODE} ranks (got {world} ranks)")
    log = progress_log(args.quiet or rank != 0)
    base = os.environ.get(DIR_ENV)
    own_base = base is None  # started under torchrun by hand: rank 0 makes and removes it
    status = 0
    try:
        if own_base:
            base = shared_temp_dir("tierstore-restore-", args.dir)
        sd = rank_state_dict(args.size_mib, args.tensors, rank)
        dest = {k: torch.empty_like(v) for k, v in sd.items()}
        nbytes = nbytes_of(sd)

        obs = Observer()
        with tierstore.open(store_config(base, args), plugins=[obs]) as store:
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=store.writer(), checkpoint_id=CID,
                     process_group=store.process_group)
            t1 = time.perf_counter()
            store.wait(all_ranks=True)
            t2 = time.perf_counter()
        if obs.failed:
            raise SystemExit(f"rank {rank}: the save failed: {obs.failed}")
        log(f"benchmark dir {base}; saved {CID}: dcp.save {t1 - t0:.3f} s, replicas and drain "
            f"{t2 - t1:.3f} s (rank 0)")
        dist.barrier()
        if local_rank == 0 and node == LOST:  # the copy that puts node 1 back before a round
            for kind, path in node_dirs(base, LOST).items():
                shutil.copytree(path, os.path.join(base, "aside", kind), symlinks=True)
        dist.barrier()

        rounds: list[dict[str, dict]] = []
        failed = False
        total = args.warmup + args.repeat
        for rnd in range(total):
            warm = rnd < args.warmup
            results = {}
            for name in rotated(CONTENDERS, rnd):
                res = run_contender(name, base, args, sd, dest, node, local_rank)
                results[name] = res
                slowest = max(x["seconds"] for x in res["ranks"])
                label = "warm-up" if warm else f"round {rnd - args.warmup + 1}"
                each = " ".join(f"{x['seconds']:.3f}" for x in res["ranks"])
                log(f"  {label} {name:<13} {slowest:7.3f} s  {nbytes / slowest / GB:6.2f} GB/s  "
                    f"(ranks: {each})")
                for x in res["ranks"]:
                    for p in x["problems"]:
                        if rank == 0:
                            print(f"WRONG SOURCE rank {x['rank']} contender {name}: {p}",
                                  flush=True)
                        failed = True
                    failed |= x["mismatch"] > 0
            if failed:
                break
            if not warm:
                rounds.append(results)
        # Put node 1's files back: a later look at the directory sees the saved state.
        set_scene("intact", base, node, local_rank)
        if failed:
            status = 1
            if rank == 0:
                print("restore benchmark: a load returned wrong data or read from the wrong "
                      "place (lines above); no report", flush=True)
        elif rank == 0:
            summary = summarize(rounds, nbytes)
            print_report(summary, args, nbytes, base)
            config = {"nodes": NODES, "ranks_per_node": PER_NODE, "size_mib": args.size_mib,
                      "tensors": args.tensors, "repeat": args.repeat, "warmup": args.warmup,
                      "bytes_per_rank": nbytes, "dir": args.dir, "fs_type": fs_type(args.dir),
                      "io_threads": args.io_threads,
                      "replication": {"strategy": "clique", "factor": 2, "jump": PER_NODE}}
            status = finish_report(args, config, summary, t_start)
        dist.barrier()
    finally:
        if own_base and rank == 0 and base is not None:
            shutil.rmtree(base, ignore_errors=True)
    return finish_rank(rank, status)


def main(argv: list[str] | None = None) -> int:
    """Under torchrun: be one rank. Otherwise: launch both nodes' torchrun."""
    return torchrun_main(argv, parse_args, worker, launch)


if __name__ == "__main__":
    sys.exit(main())
