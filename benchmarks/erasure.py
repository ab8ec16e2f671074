"""Parity against replicas on a ``peer`` tier: memory per node, time to protect a save and time
to restore a lost node, for ``clique`` factor 2, ``erasure`` 3+1 and ``erasure`` 2+1, beside raw
gloo and a memory copy of the same bytes, in one run.

What is measured
----------------
Each simulated node is one rank with a ``peer`` tier of its own (``{rank}`` in the path, tmpfs
when ``/dev/shm`` has room, ``keep = 2``). Every rank saves ``--mib`` MiB of fp32 in 16 tensors
with ``dcp.save`` straight into that tier, then ``store.wait()`` lets the strategy protect it:

=====================  ==========================================================================
``clique f2``          4 ranks, pairs {0,1} {2,3}: each keeps its partner's files (a replica)
``erasure 3+1``        4 ranks, one set: each keeps 1/3 of a checkpoint of XOR parity
``erasure 2+1``        3 ranks, one set: each keeps 1/2
=====================  ==========================================================================

* **memory per node**: bytes the node's tier holds for the newest save (its own files, the
  replicas or parity it keeps) over its own files' bytes;
* **at rest**: everything the node's tier holds after the save and ``store.wait()`` (every
  checkpoint ``keep = 2`` keeps, with their replicas or parity; not the ``.recycle`` bin of
  pages kept for the next save to write into), over one save's own files: ``keep`` times the
  line above is what the strategy promises, the largest node's figure is what it holds;
* **protect**: the ``replicated`` event's seconds, slowest rank (what ``store.wait()`` waits
  for once the save returned);
* **restore, intact**: ``dcp.load`` of the newest save into zeroed tensors, slowest rank;
* **restore, node lost**: rank 1's directory is deleted and the store opened again (a replaced
  node); ``dcp.load`` of the same save, slowest rank: a replica is fetched from the partner,
  parity is decoded by the set first. Checked bitwise.
* baselines, the same bytes in the same processes: **raw gloo**, every rank sends its payload to
  the next rank and receives the previous one's (one replica's network part), and **copy**, one
  memory copy of the payload.

Medians over ``--rounds`` rounds (each: save, protect, intact load, lose rank 1, load again).
Every simulated node shares this machine's cores, and the "network" is loopback TCP.

Run::

    .venv/bin/python benchmarks/erasure.py                 # 64 MiB per rank, 3 rounds
    .venv/bin/python benchmarks/erasure.py --mib 128 --rounds 5 --json /tmp/erasure.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tierstore

from harness import (dir_bytes, max_over_ranks, parser, print_table, run_torchrun, scratch,
                     shm_or_tmp)

STRATEGIES = {
    "clique f2": (4, {"strategy": "clique", "factor": 2, "jump": 1}),
    "erasure 3+1": (4, {"strategy": "erasure", "data": 3, "parity": 1, "jump": 1}),
    "erasure 2+1": (3, {"strategy": "erasure", "data": 2, "parity": 1, "jump": 1}),
}
LOST = 1


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--mib", type=int, default=64, help="MiB saved per rank (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per strategy (default 3)")
    p.add_argument("--dir", default=None, help="parent of the tiers (default /dev/shm)")
    p.add_argument("--json", default=None, help="also write the figures as JSON here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- the worker (one rank of a torchrun) ---------------------------------------------------------

class _Protected:
    """Collects the ``replicated`` events' seconds."""

    def __init__(self):
        self.seconds: list[float] = []

    @tierstore.hookimpl
    def tierstore_event(self, event):
        if event.kind == tierstore.EventKind.REPLICATED:
            self.seconds.append(event.seconds)


def _slowest(seconds: float) -> float:
    return max_over_ranks([seconds])[0]


def _state(rank: int, mib: int) -> dict:
    gen = torch.Generator().manual_seed(rank)
    numel = (mib << 20) // 4 // 16
    # Keys of this rank's own: DCP writes a tensor every rank has under one name once.
    return {f"rank{rank}.t{i}": torch.randn(numel, generator=gen) for i in range(16)}


def _at_rest(root: str) -> int:
    """Bytes a node's tier holds, its ``.recycle`` bins apart."""
    total = 0
    for base, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".recycle"]
        total += sum(os.path.getsize(os.path.join(base, f)) for f in files)
    return total


def _held_for(root: str, cid: str) -> tuple[int, int]:
    """(own files' bytes, bytes of replicas and parity) of ``cid`` in a node's tier."""
    own = dir_bytes(os.path.join(root, cid))
    extra = 0
    for sub in (".replicas", ".parity"):
        top = os.path.join(root, sub)
        if os.path.isdir(top):
            for name in os.listdir(top):
                extra += dir_bytes(os.path.join(top, name, cid))
    return own, extra


def _raw_gloo(payload: torch.Tensor) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(payload)
    dist.barrier()
    t0 = time.perf_counter()
    works = [dist.isend(payload, (rank + 1) % world), dist.irecv(got, (rank - 1) % world)]
    for w in works:
        w.wait()
    return _slowest(time.perf_counter() - t0)


def _copy(payload: torch.Tensor) -> float:
    dst = torch.empty_like(payload)
    dst.fill_(0)
    t0 = time.perf_counter()
    dst.copy_(payload)
    return _slowest(time.perf_counter() - t0)


def _timed_load(store, cid: str, sd: dict, who: str) -> float:
    """``dcp.load`` of ``cid`` into zeroed tensors like ``sd``: the slowest rank's seconds;
    the run stops when the bytes differ from ``sd``."""
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(out, storage_reader=store.reader(), checkpoint_id=cid,
             process_group=store.process_group)
    seconds = _slowest(time.perf_counter() - t0)
    if not all(torch.equal(out[k], sd[k]) for k in sd):
        raise SystemExit(f"{who} loaded wrong bytes")
    return seconds


def worker(args: argparse.Namespace) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    name = args.worker
    _, table = STRATEGIES[name]
    root = os.path.join(args.dir, name.replace(" ", "-").replace("+", "p"))
    config = {"tier": [{"name": "peer", "backend": "peer", "path": root + "/{rank}", "keep": 2,
                        "replication": table}]}
    sd = _state(rank, args.mib)
    payload = torch.cat([t.view(torch.uint8) for t in sd.values()])
    rows = []
    for rnd in range(args.rounds):
        cid = f"step-{rnd}"
        seen = _Protected()
        store = tierstore.open(config, plugins=[seen])
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id=cid,
                 process_group=store.process_group)
        store.wait()
        protect = _slowest(seen.seconds[-1] if seen.seconds else 0.0)
        own, extra = _held_for(os.path.join(root, str(rank)), cid)
        memory = torch.tensor([(own + extra) / own, _at_rest(os.path.join(root, str(rank))) / own],
                              dtype=torch.float64)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        intact = _timed_load(store, cid, sd, f"{name}: rank {rank}")
        store.close()
        dist.barrier()
        if rank == LOST:
            shutil.rmtree(os.path.join(root, str(rank)))
        dist.barrier()
        store = tierstore.open(config)
        lost = _timed_load(store, cid, sd, f"{name}: rank {rank}, after rank {LOST} was lost,")
        store.close()
        rows.append({"protect_s": protect, "memory_x": float(memory[0]),
                     "at_rest_x": float(memory[1]), "intact_s": intact,
                     "lost_s": lost, "raw_gloo_s": _raw_gloo(payload),
                     "copy_s": _copy(payload)})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world": dist.get_world_size(), "rounds": rows}, f)
    dist.destroy_process_group()
    return 0


# -- the driver ------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    results = {}
    with scratch("tierstore-erasure-", args.dir or shm_or_tmp()) as base:
        for name, (world, _) in STRATEGIES.items():
            out = os.path.join(base, "result.json")
            print(f"running {name} on {world} ranks ...", file=sys.stderr, flush=True)
            code = run_torchrun([os.path.abspath(__file__), "--worker", name, "--mib",
                                 str(args.mib), "--rounds", str(args.rounds), "--dir", base,
                                 "--out", out], world)
            if code != 0:
                raise SystemExit(f"{name}: torchrun exited with status {code}")
            with open(out) as f:
                results[name] = json.load(f)
    summary = {}
    for name, got in results.items():
        rows = got["rounds"]
        summary[name] = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        summary[name]["world"] = got["world"]
    clique = summary["clique f2"]
    print(f"\n{args.mib} MiB per rank, {args.rounds} rounds, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}; medians, slowest rank\n")
    rows = []
    for name, s in summary.items():
        # (the last round's: by then keep holds two saves on every node)
        at_rest = results[name]["rounds"][-1]["at_rest_x"]
        rows.append([name, s["world"], f"{s['memory_x']:.2f}x",
                     f"{at_rest:.2f}x ({2 * s['memory_x']:.2f}x)", f"{s['protect_s']:.3f}",
                     f"{s['protect_s'] / clique['protect_s']:.2f}x", f"{s['raw_gloo_s']:.3f}",
                     f"{s['copy_s']:.3f}", f"{s['intact_s']:.3f}", f"{s['lost_s']:.3f}",
                     f"{s['lost_s'] / clique['lost_s']:.2f}x"])
    print_table(["strategy", "ranks:", "memory per node:", "at rest, keep 2 (promised):",
                 "protect s:", "vs clique:", "raw gloo s:", "copy s:", "restore intact s:",
                 "restore, node lost s:", "lost / clique's lost:"], rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mib": args.mib, "rounds": args.rounds, "summary": summary,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
