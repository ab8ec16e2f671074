"""Restore at other world sizes: from node-local RAM and peer replicas, against a ``file://`` tier
on tmpfs and an S3 tier (SeaweedFS), side by side in one run.

Why
---
A job that lost a node most often comes back in another shape: fewer nodes while the
replacement is provisioned, more when capacity returns, another number of ranks per node. The
fast tiers are for that moment. This measures what a restore costs at each shape from them, and
from the slower tiers a job would otherwise read.

What is measured
----------------
One checkpoint is saved by 2 simulated nodes x 2 ranks (two torchrun invocations on a localhost
rendezvous, ``{node}`` in the tier paths): ``--tensors`` fp32 tensors of ``--size-mib`` MiB in
all, each a DTensor sharded by rows over the job (so another world size reshards it). Tiers,
every one taking every save: ``ram`` (``memory``, ``<dir>/ram/{node}``), ``peer`` (``peer``,
``<dir>/peer/{node}``, clique factor 2 jump 2: every rank's files also on the other node),
``files`` (``fsspec`` ``file://<dir>/files``) and ``s3`` (``fsspec`` into a SeaweedFS bucket the
benchmark starts). The RAM and peer directories are then copied aside, and put back before each
contender. Each contender is a job of its own shape (a torchrun per node) that opens a store
with one source's tiers only and times ``dcp.load`` of the checkpoint on every rank, from a
barrier to the slowest rank's end (torchrun, imports and the store's open are not timed); every
rank then checks what it loaded against the saved values, bit for bit.

Shapes: ``2x2`` (intact: every rank reads its own node's RAM), ``2x2-lost`` (node 1's RAM and peer
directories deleted: its ranks get their files from node 0's replicas), ``2x1`` (N -> N/2),
``4x2`` (N -> 2N: nodes 2 and 3 are new and empty) and ``2x3`` (2 -> 3 ranks per node). Sources:
``fast`` (ram + peer), ``files``, ``s3``; the lost node only from ``fast`` (the others do not
depend on nodes).

Each new shape also gets an intact reference, ``own`` (with ``--own``, the default): a checkpoint
of the same tensors that this shape saved itself, restored by it from its own RAM. Every "node"
here shares the same 2 CPUs, so a job of 8 ranks loads slower than one of 4 whatever it reads
(and one of 2 faster): ``fast / own`` is what the change of shape itself costs, apart from the
job's size, where ``fast / 2x2`` mixes the two.

    .venv/bin/python benchmarks/restore_shapes.py                 # 128 MiB, 1 round (~4 min)
    .venv/bin/python benchmarks/restore_shapes.py --size-mib 32 --rounds 2 --json /tmp/r.json

The raw floor (``raw``, always run): the 2x2 checkpoint restored with nothing but the work no
restore can skip (:func:`raw_job`: map, hash, copy; the lost node's files sent over gloo), intact
and with node 1 lost. Its lost / intact ratio is what moving the lost node's bytes costs on this
machine, whatever the software.

Reading guide: ``2x2-lost / 2x2`` is what the lost node costs (target 1.1x); each resharded
shape from ``fast`` against ``2x2`` from ``fast`` is the price of the new shape (target 1.3x),
against ``own`` the price of resharding alone, and against the same shape from ``files`` and
``s3``, the point of the fast tiers. On this
2-core machine every "node" shares the same CPUs and the "network" is loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from contextlib import nullcontext

from harness import rotated, run_nodes, scratch, seaweed

SHAPES = {"2x2": (2, 2), "2x2-lost": (2, 2), "2x1": (2, 1), "4x2": (4, 2), "2x3": (2, 3)}
SOURCES = ("fast", "files", "s3")
#: shapes that save a checkpoint of their own for the ``own`` reference (the others are 2x2)
RESHARDED = ("2x1", "4x2", "2x3")
CID = "step-1"
BUCKET = "restore-shapes"


# -- the job (under torchrun) ------------------------------------------------------------------

def tiers(base: str, source: str, s3_options: dict | None) -> list[dict]:
    """The tiers of ``source`` ("all" for the save; no S3 tier without ``s3_options``)."""
    out = []
    if source in ("all", "fast"):
        out += [{"name": "ram", "backend": "memory", "path": base + "/ram/{node}"},
                {"name": "peer", "backend": "peer", "path": base + "/peer/{node}",
                 "replication": {"strategy": "clique", "factor": 2, "jump": 2}}]
    if source in ("all", "files"):
        out.append({"name": "files", "backend": "fsspec", "url": f"file://{base}/files"})
    if source in ("all", "s3") and s3_options is not None:
        out.append({"name": "s3", "backend": "fsspec", "url": f"s3://{BUCKET}/ckpt",
                    "options": s3_options})
    return out


def full_tensor(i: int, rows: int):
    """Tensor ``i`` of the checkpoint, whole (the same on every rank)."""
    import torch

    gen = torch.Generator().manual_seed(1000 + i)
    return torch.rand(rows, 1024, generator=gen)


def raw_job(spec: dict) -> int:
    """One rank of the raw floor at 2x2 (``spec["shape"]``: ``2x2`` or ``2x2-lost``): the
    least any restore of these files must do, with no tierstore, DCP or checks beyond one
    hash. Each rank maps its own files from its node's RAM directory, hashes them (XXH3, as an
    unsigned store) and copies them into destination tensors touched beforehand (as a model's
    are). With node 1 lost, ranks 0 and 1 also send ranks 2 and 3 their files from the replica
    sets node 0 holds, over gloo, while they read their own; ranks 2 and 3 receive them into
    fresh buffers (as any check before landing must), then hash and copy them. Prints the
    slowest rank's seconds and the CPU seconds of all ranks, like :func:`job`."""
    import glob
    import mmap
    import warnings

    import torch
    import torch.distributed as dist
    import xxhash

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    lost = spec["shape"] == "2x2-lost"
    node, base = rank // 2, spec["base"]

    def files_of(r: int, directory: str) -> list[str]:
        return sorted(glob.glob(os.path.join(directory, CID, f"__{r}_*.distcp")))

    def mapped(path: str) -> torch.Tensor:
        with open(path, "rb") as f:
            region = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                               prot=mmap.PROT_READ)
        return torch.frombuffer(region, dtype=torch.uint8)

    def land(data: torch.Tensor, into: torch.Tensor) -> None:
        xxhash.xxh3_128(data.numpy()).hexdigest()
        into.copy_(data)

    own = files_of(rank, os.path.join(base, "ram", str(node)))
    to_send = (files_of(rank + 2, os.path.join(base, "peer", "0", ".replicas",
                                                f"{rank + 2}-held-by-{rank}"))
               if lost and node == 0 else [])
    if lost and node == 1:  # the sizes of what is coming (a restore knows them: manifests)
        own = files_of(rank, os.path.join(base, "peer", "0", ".replicas",
                                          f"{rank}-held-by-{rank - 2}"))
    sizes = [os.path.getsize(p) for p in own]
    with warnings.catch_warnings():
        # The files are mapped read-only: torch warns that writes would fail; none are made.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        destinations = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        dist.barrier()
        started, cpu_started = time.perf_counter(), time.process_time()
        if lost and node == 1:
            buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
            works = [dist.irecv(b, src=rank - 2) for b in buffers]
            for w, b, d in zip(works, buffers, destinations):
                w.wait()
                land(b, d)
        else:
            works = [dist.isend(mapped(p), dst=rank + 2) for p in to_send]
            for p, d in zip(own, destinations):
                land(mapped(p), d)
            for w in works:
                w.wait()
        seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        cpu = torch.tensor([time.process_time() - cpu_started], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    if rank == 0:
        print("RESULT " + json.dumps({"seconds": float(seconds), "cpu_seconds": float(cpu),
                                      "mismatched": 0}), flush=True)
    dist.destroy_process_group()
    return 0


def job(spec: dict) -> int:
    """One rank: save (``spec["phase"] == "save"``) or load and time it."""
    if spec["phase"] == "raw":
        return raw_job(spec)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    import tierstore

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rows = spec["size_mib"] * (1 << 20) // 4 // 1024 // spec["tensors"]
    full = {f"t{i}": full_tensor(i, rows) for i in range(spec["tensors"])}
    config = {"tier": tiers(spec["base"], spec["source"], spec["s3"])}
    if spec.get("io_threads"):
        config["store"] = {"io_threads": spec["io_threads"]}
    with tierstore.open(config) as store:
        if spec["phase"] == "save":
            state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
            dcp.save(state, storage_writer=store.writer(), checkpoint_id=CID,
                     process_group=store.process_group)
            store.wait(all_ranks=True)
            return 0
        state = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)])
                 for k, v in full.items()}
        profiler = None
        if spec.get("profile"):
            import cProfile

            profiler = cProfile.Profile()
        dist.barrier()
        started, cpu_started = time.perf_counter(), time.process_time()
        if profiler is not None:
            profiler.enable()
        dcp.load(state, storage_reader=store.reader(), checkpoint_id=CID,
                 process_group=store.process_group)
        seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        # CPU time of every thread of this process (gloo's included), summed over the ranks:
        # on a machine whose cores all the "nodes" share, the wall time follows it.
        cpu = torch.tensor([time.process_time() - cpu_started], dtype=torch.float64)
        if profiler is not None:
            profiler.disable()
            label = spec.get("label", spec["source"])
            profiler.dump_stats(os.path.join(
                spec["profile"], f"{spec['shape']}-{label}-rank{rank}.prof"))
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    bad = sum(not torch.equal(state[k].to_local(), distribute_tensor(v, mesh, [Shard(0)])
                              .to_local()) for k, v in full.items())
    flag = torch.tensor([bad])
    dist.all_reduce(flag)
    if rank == 0:
        print("RESULT " + json.dumps({"seconds": float(seconds), "cpu_seconds": float(cpu),
                                      "mismatched": int(flag)}),
              flush=True)
    dist.destroy_process_group()
    return 0 if int(flag) == 0 else 1


# -- the launcher ------------------------------------------------------------------------------

def run_job(spec: dict, nnodes: int, nproc: int, timeout: float) -> dict | None:
    """``job(spec)`` under one torchrun per node; rank 0's RESULT (None for the save)."""
    name = f"job-{time.monotonic_ns()}"
    path = os.path.join(spec["base"], f"{name}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    run = run_nodes([os.path.abspath(__file__), "--job", path], nnodes, nproc, timeout=timeout,
                    log_dir=spec["base"], label=name, torchrun_args=("--max-restarts=0",))
    if run.why is not None:
        raise RuntimeError(f"{spec['phase']} at {nnodes}x{nproc} from {spec['source']} failed "
                           f"({run.why}):\n{run.tail()}")
    for log in run.logs:
        with open(log, errors="replace") as f:
            for line in f:
                if "RESULT " in line:
                    return json.loads(line[line.index("RESULT ") + len("RESULT "):])
    return None


def put_back(base: str, pristine: str, lost: bool) -> None:
    """The RAM and peer directories as the save left them (node 1's gone when ``lost``), and
    no node directory beyond the save's two."""
    for name in ("ram", "peer"):
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        shutil.copytree(os.path.join(pristine, name), os.path.join(base, name), symlinks=True)
        if lost:
            shutil.rmtree(os.path.join(base, name, "1"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--size-mib", type=int, default=128, help="the checkpoint's size (128)")
    p.add_argument("--tensors", type=int, default=16, help="tensors it has (16)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of every contender (1)")
    p.add_argument("--dir", default="/dev/shm", help="where the tiers go (/dev/shm)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per job (300)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help="comma-separated shapes to run (all: " + ",".join(SHAPES) + "); 2x2 "
                        "from fast is always run, as the reference")
    p.add_argument("--sources", default=",".join(SOURCES), help="comma-separated sources")
    p.add_argument("--io-threads", type=int, default=0,
                   help="[store] io_threads of every job (default: the store's default)")
    p.add_argument("--no-own", dest="own", action="store_false",
                   help="skip the intact reference of each new shape (a checkpoint it saved "
                        "itself, restored from its own RAM)")
    p.add_argument("--profile", metavar="DIR",
                   help="write each rank's cProfile of its load to DIR/<shape>-<source>-rank<r>"
                        ".prof (the timed load then runs under the profiler)")
    args = p.parse_args(argv)
    if args.job:
        with open(args.job) as f:
            return job(json.load(f))
    began = time.time()
    # The S3 server only when S3 is a source (a machine without seaweedfs measures the rest).
    with scratch("restore-shapes-", args.dir) as base, \
            scratch("restore-shapes-pristine-", args.dir) as pristine, \
            (seaweed(BUCKET) if "s3" in args.sources.split(",") else nullcontext()) as server:
        spec = {"base": base, "size_mib": args.size_mib, "tensors": args.tensors,
                "s3": server.storage_options() if server is not None else None,
                "io_threads": args.io_threads}
        run_job({**spec, "phase": "save", "source": "all"}, 2, 2, args.timeout)
        for name in ("ram", "peer"):
            shutil.copytree(os.path.join(base, name), os.path.join(pristine, name),
                            symlinks=True)
        shapes, sources = args.shapes.split(","), args.sources.split(",")
        unknown = sorted(set(shapes) - set(SHAPES)) + sorted(set(sources) - set(SOURCES))
        if unknown:
            p.error(f"unknown shapes or sources: {', '.join(unknown)}")
        contenders = [(shape, source) for shape in SHAPES for source in SOURCES
                      if (shape == "2x2" and source == "fast") or (
                          shape in shapes and source in sources
                          and (shape != "2x2-lost" or source == "fast"))]
        own_base = {}
        for shape in (s for s in RESHARDED if args.own and s in shapes):
            # The same tensors saved by this shape into fast tiers of their own: never
            # changed by a load at that shape, so saved once.
            own_base[shape] = os.path.join(base, f"own-{shape}")
            os.makedirs(own_base[shape])
            run_job({**spec, "base": own_base[shape], "phase": "save", "source": "fast"},
                    *SHAPES[shape], args.timeout)
            contenders.append((shape, "own"))
        # The floor of the lost node's cost on this machine: the same bytes moved and
        # landed with nothing else done (raw_job).
        contenders += [("2x2", "raw")] + ([("2x2-lost", "raw")] if "2x2-lost" in shapes else [])
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
            spec["profile"] = os.path.abspath(args.profile)
        seconds: dict[str, list[float]] = {}
        cpu_seconds: dict[str, list[float]] = {}
        for rnd in range(args.rounds):
            for shape, source in rotated(contenders, rnd):
                nnodes, nproc = SHAPES[shape]
                if source == "own":
                    job_spec = {**spec, "base": own_base[shape], "source": "fast"}
                elif source == "raw":
                    put_back(base, pristine, lost=shape == "2x2-lost")
                    job_spec = {**spec, "source": "fast", "phase": "raw"}
                else:
                    put_back(base, pristine, lost=shape == "2x2-lost")
                    job_spec = {**spec, "source": source}
                result = run_job({"phase": "load", **job_spec, "shape": shape,
                                  "label": source}, nnodes, nproc, args.timeout)
                if result is None or result["mismatched"]:
                    print(f"MISMATCH: {shape} from {source}: {result}", file=sys.stderr)
                    return 1
                seconds.setdefault(f"{shape} {source}", []).append(result["seconds"])
                cpu_seconds.setdefault(f"{shape} {source}", []).append(result["cpu_seconds"])
                print(f"round {rnd + 1}: {shape} from {source}: {result['seconds']:.3f} s "
                      f"({result['cpu_seconds']:.3f} s of CPU, all ranks)",
                      file=sys.stderr, flush=True)
    median = {k: statistics.median(v) for k, v in seconds.items()}
    gb = args.size_mib * (1 << 20) / 1e9
    intact = median["2x2 fast"]
    print(f"restore of {args.size_mib} MiB saved at 2x2, {args.rounds} round(s), median of the "
          f"slowest rank ({time.time() - began:.0f} s in all)")
    print(f"{'shape':10} {'fast s':>8} {'own s':>8} {'files s':>8} {'s3 s':>8} "
          f"{'fast/intact':>12} {'fast/own':>9} {'fast/files':>11} {'fast/s3':>8}")
    for shape in SHAPES:
        if f"{shape} fast" not in median:
            continue
        fast = median[f"{shape} fast"]
        files, s3 = median.get(f"{shape} files"), median.get(f"{shape} s3")
        own = median.get(f"{shape} own")
        row = [f"{shape:10}", f"{fast:8.3f}", f"{own:8.3f}" if own else f"{'':>8}",
               f"{files:8.3f}" if files else f"{'':>8}",
               f"{s3:8.3f}" if s3 else f"{'':>8}", f"{fast / intact:11.2f}x",
               f"{fast / own:8.2f}x" if own else f"{'':>9}",
               f"{fast / files:10.2f}x" if files else f"{'':>11}",
               f"{fast / s3:7.2f}x" if s3 else f"{'':>8}"]
        print(" ".join(row))
    print(f"(intact from fast: {gb / intact:.2f} GB/s)")
    if "2x2-lost raw" in median:
        raw, raw_lost = median["2x2 raw"], median["2x2-lost raw"]
        print(f"raw floor (no tierstore: map, hash, copy; the lost node's files over gloo): "
              f"intact {raw:.3f} s, node 1 lost {raw_lost:.3f} s, lost/intact "
              f"{raw_lost / raw:.2f}x (tierstore: {median['2x2-lost fast'] / intact:.2f}x); "
              f"tierstore / raw: intact {intact / raw:.2f}x, lost "
              f"{median['2x2-lost fast'] / raw_lost:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size_mib": args.size_mib, "rounds": args.rounds, "seconds": seconds,
                       "median_s": median, "cpu_seconds": cpu_seconds}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
