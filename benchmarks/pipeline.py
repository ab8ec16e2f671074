"""Tier pipeline: save latency with a drain behind it, and drain throughput against a raw copy.

What is measured
----------------
A state dict of ``--size-mib`` MiB of random fp32 data in ``--tensors`` tensors (default 1 GiB in
64 tensors) is saved with ``dcp.save`` by two contenders, each into fresh directories:

=============  ===============================================================================
``pipeline``   a store with three tiers, all ``every = 1``: tier 1 ``memory`` (a directory under
               ``--shm-dir``, default /dev/shm), tier 2 ``local`` and tier 3 ``local`` (two
               directories under ``--dir``, a disk filesystem, fsync on). The save commits on
               tier 1; the drain then copies the checkpoint to tier 2, then to tier 3, in
               tierstore's background threads.
``alone``      a store with only the ``memory`` tier: the same save with no drain behind it.
=============  ===============================================================================

Both saves are timed until ``dcp.save`` returns; the drain is not waited for inside that figure
(it starts while the save commits and runs on afterwards). After the pipeline save returns the
benchmark calls ``store.wait()``, so no drain of one operation ever overlaps the next one.

From the same pipeline save come the drain figures:

* ``drain-t2``: the ``drain_finished`` event of tier 2 (observed with a plugin passed to
  ``tierstore.open(plugins=[...])``): its ``seconds`` (from the start of the drain of that tier
  to its commit there, fsyncs and rename included) and its ``nbytes``;
* ``drain-t3``: the same for tier 3 (it starts when tier 2 is done);
* ``drain-wall``: wall time from ``dcp.save`` returning to ``store.wait()`` returning (the tier 2
  drain started a little before the save returned; the tier 3 drain is all inside).

They are compared with raw copies of the same files (every file of the committed checkpoint in
the pipeline's memory tier directory, largest first) into a fresh directory on the same disk
filesystem as tier 2:

=============  ===============================================================================
``copy-seq``   ``shutil.copyfile`` then ``os.fsync`` of each file, one file after the other
``copy-par4``  the same per file, four files at a time (4 threads): a stricter baseline, since
               the drain copies with ``[store] drain_threads`` (default 4) threads too
=============  ===============================================================================

The drain reads each byte into a buffer, checks it against the manifest's checksum and writes
it, then commits (manifest, directory fsyncs, rename); the raw copies only copy and fsync
(``shutil.copyfile`` uses ``sendfile``, in the kernel), so they are what the two directories
allow.

Each round runs the two saves in round-robin order (the first rotates from round to round), then
the two raw copies likewise. Before each timed operation the disk outputs of the earlier
operations of the round are deleted (the pipeline's memory-tier checkpoint stays: it is the raw
copies' source) and ``os.sync()`` is called, so no dirty page or pending delete of one contender
is flushed on the next one's clock. Stores are built, and their directories created, outside the
timed region. The whole set is repeated ``--repeat`` times (default 9: a save of 1 GiB into tmpfs
takes well under a second, and wall times move by ±50% between rounds on a busy 2-core
machine) after ``--warmup`` untimed rounds (default 1).

The report gives median seconds, GB/s (10^9 bytes per second: tensor payload for saves, the
bytes copied for drains and copies; ``drain-wall`` moves the checkpoint twice) and ratios, then
the acceptance verdicts:

* pipeline save <= 1.1x the save into the memory tier alone (ratio of seconds, pipeline/alone)
* drain to tier 2 >= 0.8x the raw sequential copy (ratio of GB/s)

and an informational line with the drain's ratio to the parallel raw copy. Ratios are of
medians; the per-round ratios (same round, same machine state) are printed beside them as a noise
indicator. CPU s is the median process CPU time (user + system, all threads) of the operation:
for saves, while ``dcp.save`` runs (for ``pipeline`` this includes what the drain's threads used
before the save returned); for ``drain-t2``/``drain-t3``, between the drain's started and finished
events; for ``drain-wall``, from the save's return to ``store.wait()``'s return.

How to run
----------
From the repository root::

    .venv/bin/python benchmarks/pipeline.py              # 1 GiB, 64 tensors, 1 warm-up + 9 rounds
    .venv/bin/python benchmarks/pipeline.py --repeat 9 --json /tmp/pipeline.json
    .venv/bin/python benchmarks/pipeline.py --size-mib 256 --tensors 16 --dir /local_nvme/tmp

Progress lines go to stderr, the report to stdout. ``--strict`` makes the exit status 1 when a
target is missed (for CI). Temp directories (under ``--dir`` and under ``--shm-dir``) are removed
at the end, also after an error.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp

import tierstore

from harness import (GB, Clock, DrainTimer, Samples, benchmark_parser, checkpoint_files,
                     disk_parent, finish_report, fs_type, make_state_dict, memory_parent,
                     nbytes_of, need_room, print_informational, print_table, print_verdicts,
                     progress_log, quiesce, ratios, remove, rotated, rounds_text, scratch,
                     verdict, warmup_then_rounds)

SAVE_CONTENDERS = ("pipeline", "alone")
DRAIN_FIGURES = ("drain-t2", "drain-t3", "drain-wall")
COPY_CONTENDERS = ("copy-seq", "copy-par4")
FIGURES = SAVE_CONTENDERS + DRAIN_FIGURES + COPY_CONTENDERS
CHECKPOINT_ID = "step-1"
TIER_NAMES = ("ram", "disk2", "disk3")
PAR_THREADS = 4

# Acceptance targets.
SAVE_OVERHEAD_MAX = 1.1   # pipeline save seconds / memory-tier-alone save seconds, at most
DRAIN_VS_COPY_MIN = 0.8   # drain to tier 2 GB/s / raw sequential copy GB/s, at least


# -- stores ------------------------------------------------------------------------------------

def open_store(paths: list[tuple[str, str]], io_threads: int | None,
               plugins: tuple[object, ...] = ()) -> "tierstore.Store":
    """A store with one tier per (backend, path), every = 1, in that order."""
    config: dict = {"tier": [{"name": name, "backend": backend, "path": path, "every": 1}
                             for name, (backend, path) in zip(TIER_NAMES, paths)]}
    if io_threads is not None:
        config["store"] = {"io_threads": io_threads}
    return tierstore.open(config, plugins=plugins)


# -- raw copies ----------------------------------------------------------------------------------

def copy_durable(src: str, dst: str) -> int:
    """``shutil.copyfile`` then fsync of the copy; returns its size."""
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def prepare_copy(name: str, src_dir: str, out: str) -> Callable[[], int]:
    """The timed part of raw copy contender ``name``: returns bytes copied."""
    os.makedirs(out)
    files = checkpoint_files(src_dir)
    pairs = [(os.path.join(src_dir, f), os.path.join(out, f)) for f in files]
    if name == "copy-seq":
        return lambda: sum(copy_durable(s, d) for s, d in pairs)
    if name == "copy-par4":
        def copy() -> int:
            with ThreadPoolExecutor(PAR_THREADS, thread_name_prefix="bench-copy") as pool:
                return sum(pool.map(lambda p: copy_durable(*p), pairs))
        return copy
    raise ValueError(name)


# -- the run -----------------------------------------------------------------------------------

def run_round(rnd: int, sd: dict[str, torch.Tensor], base: str, shm_base: str,
              io_threads: int | None, res: Samples, log: Callable[[str], None]) -> None:
    """One round: both saves (rotated order; the pipeline's drain measured with it), then both
    raw copies (rotated) from the pipeline's memory-tier checkpoint."""
    nbytes = nbytes_of(sd)
    rdir, sdir = os.path.join(base, f"round{rnd}"), os.path.join(shm_base, f"round{rnd}")
    os.makedirs(rdir)
    os.makedirs(sdir)
    disk_outputs: list[str] = []   # deleted before the next timed operation
    source: str | None = None      # the pipeline's committed checkpoint in its memory tier
    stores: list[tierstore.Store] = []

    def clear_and_sync() -> None:
        # Earlier outputs deleted first, then sync: neither their deletion nor any dirty page
        # is written back while the next contender's clock runs.
        while disk_outputs:
            remove(disk_outputs.pop())
        quiesce()

    def line(op: str, name: str, secs: float, moved: int, cpu: float) -> None:
        log(f"  round {rnd + 1} {op:<5} {name:<10} {secs:7.3f} s  {moved / secs / GB:6.2f} GB/s"
            f"  cpu {cpu:6.3f} s")

    try:
        for name in rotated(SAVE_CONTENDERS, rnd):
            ram = os.path.join(sdir, f"{name}-ram")
            timer = DrainTimer()
            if name == "pipeline":
                disk2, disk3 = os.path.join(rdir, "pipeline-disk2"), os.path.join(rdir,
                                                                                 "pipeline-disk3")
                store = open_store([("memory", ram), ("local", disk2), ("local", disk3)],
                                   io_threads, (timer,))
            else:
                store = open_store([("memory", ram)], io_threads, (timer,))
            stores.append(store)
            clear_and_sync()
            with Clock() as clock:
                dcp.save(sd, storage_writer=store.writer(), checkpoint_id=CHECKPOINT_ID)
            t1, c1 = time.perf_counter(), time.process_time()
            res.add(name, clock.seconds, clock.cpu, nbytes)
            line("save", name, clock.seconds, nbytes, clock.cpu)
            if name != "pipeline":
                store.close()
                stores.remove(store)
                remove(ram)  # tmpfs: frees memory, no disk work
                continue
            store.wait()  # untimed for the save figure; rounds never overlap a drain
            wall, wall_cpu = time.perf_counter() - t1, time.process_time() - c1
            info = store.list()
            if store.pending() or not info or sorted(info[0].tiers) != sorted(TIER_NAMES):
                raise SystemExit(f"pipeline round {rnd + 1}: checkpoint not on every tier "
                                 f"({info[0].tiers if info else 'nowhere'}); "
                                 f"pending {store.pending()}")
            ckpt_bytes = 0
            for fig, tier in (("drain-t2", "disk2"), ("drain-t3", "disk3")):
                ev = timer.finished[tier]
                res.add(fig, ev.seconds, timer.cpu[tier], ev.nbytes)
                line("drain", fig, ev.seconds, ev.nbytes, timer.cpu[tier])
                ckpt_bytes = ev.nbytes
            res.add("drain-wall", wall, wall_cpu, 2 * ckpt_bytes)
            line("drain", "drain-wall", wall, 2 * ckpt_bytes, wall_cpu)
            store.close()
            stores.remove(store)
            source = os.path.join(ram, CHECKPOINT_ID)
            disk_outputs += [disk2, disk3]

        assert source is not None
        for name in rotated(COPY_CONTENDERS, rnd):
            out = os.path.join(rdir, name)
            clear_and_sync()
            copy = prepare_copy(name, source, out)
            os.sync()  # the new directory's own metadata
            with Clock() as clock:
                moved = copy()
            res.add(name, clock.seconds, clock.cpu, moved)
            line("copy", name, clock.seconds, moved, clock.cpu)
            disk_outputs.append(out)
    finally:
        for store in stores:
            store.close()
        remove(rdir)
        remove(sdir)


def summarize(res: Samples, payload: int) -> dict:
    """Medians, GB/s, ratios and verdicts as a JSON-able dict."""
    figures = {name: res.figures(name) for name in FIGURES}

    def gbps_rounds(name: str) -> list[float]:
        return ratios(res.nbytes[name], res.seconds[name])

    pipe, alone, drain = figures["pipeline"], figures["alone"], figures["drain-t2"]
    seq, par = figures["copy-seq"], figures["copy-par4"]
    verdicts = [
        verdict(f"pipeline save <= {SAVE_OVERHEAD_MAX}x memory tier alone "
                f"(seconds, pipeline/alone)",
                pipe["median_s"] / alone["median_s"], ratios(pipe["seconds"], alone["seconds"]),
                most=SAVE_OVERHEAD_MAX),
        verdict(f"drain memory -> disk (tier 2) >= {DRAIN_VS_COPY_MIN}x raw sequential copy "
                f"(copyfile + fsync, GB/s)",
                drain["gbps"] / seq["gbps"],
                ratios(gbps_rounds("drain-t2"), gbps_rounds("copy-seq")), least=DRAIN_VS_COPY_MIN),
    ]
    info = {"target": f"drain memory -> disk (tier 2) vs raw parallel copy ({PAR_THREADS} threads)",
            "ratio": drain["gbps"] / par["gbps"],
            "per_round": ratios(gbps_rounds("drain-t2"), gbps_rounds("copy-par4"))}
    return {"figures": figures, "payload_bytes": payload, "verdicts": verdicts,
            "informational": [info]}


LABELS = {
    "pipeline": ("save", "pipeline: memory -> local -> local (until dcp.save returns)"),
    "alone": ("save", "memory tier alone"),
    "drain-t2": ("drain", "tier 2, memory -> local (drain_finished seconds)"),
    "drain-t3": ("drain", "tier 3, memory -> local (drain_finished seconds)"),
    "drain-wall": ("drain", "wall, save return -> store.wait() (tiers 2 + 3, 2x bytes)"),
    "copy-seq": ("copy", "raw: copyfile + fsync, sequential"),
    "copy-par4": ("copy", f"raw: copyfile + fsync, {PAR_THREADS} threads"),
}


def print_report(summary: dict, args: argparse.Namespace, base: str, shm_base: str) -> None:
    """Markdown table and verdict lines on stdout."""
    f = summary["figures"]
    payload = summary["payload_bytes"]
    print()
    print(f"{payload / (1 << 20):.0f} MiB fp32 in {args.tensors} tensors, {args.repeat} rounds "
          f"after {args.warmup} warm-up; memory tier under {shm_base} ({fs_type(shm_base)}), "
          f"disk tiers and copies under {base} ({fs_type(base)}); {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, tierstore io_threads={args.io_threads or 'default'}")
    print("Saves timed until dcp.save returns (GB/s of tensor payload); drains and copies move "
          f"the checkpoint's {f['drain-t2']['bytes'] / 1e6:.1f} MB of files. CPU s: median "
          "process CPU time (user+system, all threads) of the operation.")
    print()
    rows = []
    for name, (op, label) in LABELS.items():
        s = f[name]
        if name == "pipeline":
            r = f"{s['median_s'] / f['alone']['median_s']:.2f}x alone (time)"
        elif name == "alone":
            r = "1.00x (baseline)"
        elif name == "copy-seq":
            r = "1.00x (baseline)"
        else:
            r = (f"{s['gbps'] / f['copy-seq']['gbps']:.2f}x copy-seq"
                 + (f", {s['gbps'] / f['copy-par4']['gbps']:.2f}x copy-par4"
                    if name != "copy-par4" else ""))
        rows.append([op, label, f"{s['median_s']:.3f}", f"{s['gbps']:.2f}", r,
                     f"{s['median_cpu_s']:.2f}", rounds_text(s["seconds"])])
    print_table(["op", "contender", "median s:", "GB/s:", "ratio", "CPU s:", "rounds (s)"], rows)
    print()
    print_verdicts(summary["verdicts"])
    print_informational(summary["informational"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, 9, "lazy imports, thread start-up, allocator and page-cache "
                         "growth", "parent of the disk temp directory (tiers 2 and 3, raw "
                         "copies; default: system temp dir); not tmpfs")
    p.add_argument("--shm-dir", default="/dev/shm",
                   help="parent of the memory tier's temp directory (default /dev/shm)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parent, kind = disk_parent(args, "the drain figures would mean nothing")
    shm_kind = memory_parent(args.shm_dir, "--shm-dir")
    need_room(args.shm_dir, int(2.2 * args.size_mib * (1 << 20)), "two checkpoints")
    log = progress_log(args.quiet)

    t_start = time.perf_counter()
    sd = make_state_dict(args.size_mib, args.tensors)
    payload = nbytes_of(sd)
    with scratch("tierstore-pipeline-", parent) as base, \
            scratch("tierstore-pipeline-", args.shm_dir) as shm_base:
        log(f"benchmark dirs {base} ({kind}), {shm_base} ({shm_kind})")
        res = warmup_then_rounds(args, log, lambda: Samples(FIGURES), lambda rnd, _warm, res, lg:
                                 run_round(rnd, sd, base, shm_base, args.io_threads, res, lg))

    summary = summarize(res, payload)
    print_report(summary, args, base, shm_base)
    config = {"size_mib": args.size_mib, "tensors": args.tensors, "repeat": args.repeat,
              "warmup": args.warmup, "bytes": payload, "dir": parent, "fs_type": kind,
              "shm_dir": args.shm_dir, "shm_fs_type": shm_kind,
              "io_threads": args.io_threads, "copy_threads": PAR_THREADS}
    return finish_report(args, config, summary, t_start)

if __name__ == "__main__":
    sys.exit(main())
