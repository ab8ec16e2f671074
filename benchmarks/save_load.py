"""Save/load throughput of tierstore against stock PyTorch baselines, in one process and one run.

What is measured
----------------
A state dict of ``--size-mib`` MiB of random fp32 data in ``--tensors`` tensors (default 1 GiB in
64 tensors) is saved by each of these contenders into a fresh directory on the same filesystem
(a temp dir under ``--dir``, default the system temp dir; tmpfs such as /dev/shm is refused,
because it has no disk behind it and fsync would be free):

=====================  ===========================================================================
``tierstore``          ``dcp.save`` through ``store.writer()`` of a store with one ``local`` tier
                       (fsync on, the default; ``[store] io_threads`` from ``--io-threads``, else
                       tierstore's default). Includes tierstore's commit: manifest, directory
                       fsyncs and the atomic rename.
``tierstore-signed``   the same store with ``[store] signing_key``: keyed BLAKE3 digests of every
                       file and a MAC over the manifest instead of XXH3
``dcp-fs-t1``          ``dcp.save`` through stock ``FileSystemWriter(thread_count=1)`` (fsyncs)
``dcp-fs-t4``          the same with ``thread_count=4``
``torch.save``         ``torch.save(sd)`` into one file, then ``fsync``
``raw-write``          the tensors' bytes written straight from their memory (no copy) into one file
                       with ``os.write``, then ``fsync``: what the disk and the kernel allow
=====================  ===========================================================================

Each save is timed from its start until its data is durable (every contender's own fsync is
inside the timed region). The store and the tensors are built outside the timed region. Before
each timed save the earlier outputs of this round are deleted (except the two checkpoints kept for
the load phase, which are clean, already fsynced data) and ``os.sync()`` is called, so dirty pages
or pending deletes of one contender are never flushed on the next one's clock.

Then three load contenders read what they just wrote into preallocated tensors of the same shapes:
``tierstore`` and ``tierstore-signed`` (``store.reader()``, which verifies every file's checksum,
keyed for the signed one) load their own checkpoints, and stock ``FileSystemReader`` loads the ``dcp-fs-t4`` checkpoint. Both are read **from
the page cache**: every file of the checkpoint is read once, untimed, right before the timed load.
The destination tensors are zeroed before each load and compared with ``torch.equal`` afterwards,
so a fast but wrong load fails the run instead of being reported.

The whole set is repeated ``--repeat`` times (default 3), after ``--warmup`` untimed rounds
(default 1) that take first-call costs off round 1; within a round the contenders run in
round-robin order and the first contender rotates from round to round, so a noisy neighbour on the
shared machine hits every contender alike. The report gives the median seconds per contender,
GB/s (10^9 bytes of tensor payload per second) and each contender's ratio to its baseline, then
the acceptance verdicts:

* tierstore save >= 1.0x the best stock FileSystemWriter (of thread_count 1 and 4)
* tierstore save >= 0.85x raw write + fsync
* tierstore load >= 1.5x stock FileSystemReader
* signed save and load >= 0.8x unsigned (tierstore-signed against tierstore)

Ratios are of medians; the per-round ratios (same round, same machine state) are printed beside
them as a noise indicator. The table also gives each operation's median process CPU time (user +
system, all threads): on a shared 2-core machine a contender that needs more CPU per byte loses
more when the neighbours are busy, and CPU time is far less noisy than wall time.

How to run
----------
From the repository root::

    .venv/bin/python benchmarks/save_load.py              # 1 GiB, 64 tensors, 3 rounds
    .venv/bin/python benchmarks/save_load.py --repeat 5 --json /tmp/bench.json
    .venv/bin/python benchmarks/save_load.py --size-mib 256 --tensors 16 --dir /local_nvme/tmp
    .venv/bin/python benchmarks/save_load.py --cuda    # loads land in tensors on the GPU

Progress lines go to stderr, the report to stdout. ``--strict`` makes the exit status 1 when a target is missed (for CI). Temp directories are
removed at the end, also after an error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import tierstore

from harness import (GB, Clock, Samples, benchmark_parser, check_equal, disk_parent,
                     finish_report, fs_type, make_state_dict, nbytes_of, parse_with_cuda,
                     print_table, print_verdicts, progress_log, quiesce, ratios, remove, rotated,
                     rounds_text, scratch, verdict, warm_page_cache, warmup_then_rounds,
                     write_raw)

SAVE_CONTENDERS = ("tierstore", "tierstore-signed", "dcp-fs-t1", "dcp-fs-t4", "torch.save",
                   "raw-write")
LOAD_CONTENDERS = ("tierstore", "tierstore-signed", "dcp-fs-reader")
STORES = ("tierstore", "tierstore-signed")
#: the environment variable the signed store reads its key from (a fresh random key per run)
KEY_VARIABLE = "TIERSTORE_BENCH_KEY"
# The stock checkpoint that FileSystemReader loads: the multi-file stock layout, like tierstore's.
STOCK_LOAD_SOURCE = "dcp-fs-t4"
CHECKPOINT_ID = "step-1"

# Acceptance targets: (name, tierstore contender, baseline description, minimum ratio).
SAVE_VS_FS_TARGET = 1.0
SAVE_VS_RAW_TARGET = 0.85
LOAD_VS_FS_TARGET = 1.5
SIGNED_TARGET = 0.8


# -- save contenders ---------------------------------------------------------------------------
# Each takes (state dict, output path) and returns a zero-argument callable that performs the
# timed save; anything built before that (the store, directories) is setup and not timed.

def open_store(root: str, io_threads: int | None, signed: bool = False) -> "tierstore.Store":
    """A store with one ``local`` tier (fsync on, the default) at ``root``; ``signed``: with
    a signing key (read from :data:`KEY_VARIABLE`)."""
    config: dict = {"store": {},
                    "tier": [{"name": "nvme", "backend": "local", "path": root}]}
    if io_threads is not None:
        config["store"]["io_threads"] = io_threads
    if signed:
        os.environ.setdefault(KEY_VARIABLE, os.urandom(32).hex())
        config["store"]["signing_key"] = {"env": KEY_VARIABLE}
    return tierstore.open(config)


def prepare_save(name: str, sd: dict[str, torch.Tensor], out: str,
                 io_threads: int | None) -> tuple[Callable[[], None], Callable[[], None]]:
    """Return (timed save, untimed teardown) for save contender ``name`` writing to ``out``."""
    if name in STORES:
        store = open_store(out, io_threads, signed=name == "tierstore-signed")

        def save() -> None:
            dcp.save(sd, storage_writer=store.writer(), checkpoint_id=CHECKPOINT_ID)
        return save, store.close

    if name in ("dcp-fs-t1", "dcp-fs-t4"):
        threads = int(name[-1])

        def save() -> None:
            # Built inside the timed region, as a user would per save; sync_files=True (default).
            dcp.save(sd, storage_writer=FileSystemWriter(out, thread_count=threads))
        return save, lambda: None

    if name == "torch.save":
        os.makedirs(out)

        def save() -> None:
            with open(os.path.join(out, "model.pt"), "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
        return save, lambda: None

    if name == "raw-write":
        os.makedirs(out)

        def save() -> None:
            write_raw(os.path.join(out, "raw.bin"), list(sd.values()))
        return save, lambda: None

    raise ValueError(name)


# -- load contenders ---------------------------------------------------------------------------

def load_into(name: str, dest: dict[str, torch.Tensor], sources: dict[str, str],
              stores: dict[str, "tierstore.Store"]) -> None:
    """Timed part of a load: ``dcp.load`` into ``dest`` with the contender's reader."""
    if name in STORES:
        dcp.load(dest, storage_reader=stores[name].reader(), checkpoint_id=CHECKPOINT_ID)
    elif name == "dcp-fs-reader":
        dcp.load(dest, storage_reader=FileSystemReader(sources[STOCK_LOAD_SOURCE]))
    else:
        raise ValueError(name)
    if any(t.is_cuda for t in dest.values()):
        torch.cuda.synchronize()  # the host-to-device copies are part of the load


# -- the run -----------------------------------------------------------------------------------

def run_round(rnd: int, sd: dict[str, torch.Tensor], dest: dict[str, torch.Tensor], base: str,
              io_threads: int | None, res: Samples, log: Callable[[str], None]) -> None:
    """One round: every save contender (rotated order), then every load contender; into
    ``res`` as ``save:<name>`` and ``load:<name>``."""
    nbytes = nbytes_of(sd)
    rdir = os.path.join(base, f"round{rnd}")
    os.makedirs(rdir)
    outputs: dict[str, str] = {}
    stores: dict[str, tierstore.Store] = {}
    keep = {*STORES, STOCK_LOAD_SOURCE}  # load sources stay until the load phase

    def line(op: str, name: str, clock: Clock) -> None:
        log(f"  round {rnd + 1} {op} {name:<13} {clock.seconds:7.3f} s  "
            f"{nbytes / clock.seconds / GB:6.2f} GB/s  cpu {clock.cpu:6.3f} s")

    try:
        for name in rotated(SAVE_CONTENDERS, rnd):
            # Delete earlier outputs first, then sync, so neither their deletion nor any dirty
            # page is written back while this contender's clock runs.
            for other, path in list(outputs.items()):
                if other not in keep:
                    remove(path)
                    del outputs[other]
            out = os.path.join(rdir, name)
            save, teardown = prepare_save(name, sd, out, io_threads)
            quiesce()
            with Clock() as clock:
                save()
            outputs[name] = out
            if name in STORES:  # for the load phase
                stores[name] = open_store(out, io_threads, signed=name == "tierstore-signed")
            teardown()
            res.add(f"save:{name}", clock.seconds, clock.cpu)
            line("save", name, clock)

        sources = {k: v for k, v in outputs.items() if k in keep}
        for name in rotated(LOAD_CONTENDERS, rnd):
            for t in dest.values():
                t.zero_()  # a load that writes nothing must fail check_equal
            # Same conditions for both readers: their files come from the page cache.
            warm_page_cache(sources[name if name in STORES else STOCK_LOAD_SOURCE])
            quiesce()
            with Clock() as clock:
                load_into(name, dest, sources, stores)
            check_equal(f"load contender '{name}'", dest, sd)
            res.add(f"load:{name}", clock.seconds, clock.cpu)
            line("load", name, clock)
    finally:
        for store in stores.values():
            store.close()
        remove(rdir)


def summarize(res: Samples, nbytes: int) -> dict:
    """Medians, GB/s, ratios and verdicts as a JSON-able dict."""
    save = {c: res.figures(f"save:{c}", nbytes) for c in SAVE_CONTENDERS}
    load = {c: res.figures(f"load:{c}", nbytes) for c in LOAD_CONTENDERS}
    best_fs = max(("dcp-fs-t1", "dcp-fs-t4"), key=lambda c: save[c]["gbps"])

    def faster(a: dict, b: dict, least: float, target: str) -> dict:
        """The verdict on ``a``'s speed over ``b``'s (b's seconds over a's)."""
        return verdict(target, b["median_s"] / a["median_s"],
                       ratios(b["seconds"], a["seconds"]), least=least)

    ts, tl = save["tierstore"], load["tierstore"]
    ss, sl = save["tierstore-signed"], load["tierstore-signed"]
    verdicts = [
        faster(ts, save[best_fs], SAVE_VS_FS_TARGET,
               f"tierstore save >= {SAVE_VS_FS_TARGET}x best stock FileSystemWriter ({best_fs})"),
        faster(ts, save["raw-write"], SAVE_VS_RAW_TARGET,
               f"tierstore save >= {SAVE_VS_RAW_TARGET}x raw write+fsync"),
        faster(tl, load["dcp-fs-reader"], LOAD_VS_FS_TARGET,
               f"tierstore load >= {LOAD_VS_FS_TARGET}x stock FileSystemReader"),
        faster(ss, ts, SIGNED_TARGET, f"signed save >= {SIGNED_TARGET}x unsigned"),
        faster(sl, tl, SIGNED_TARGET, f"signed load >= {SIGNED_TARGET}x unsigned"),
    ]
    return {"save": save, "load": load, "best_stock_writer": best_fs, "verdicts": verdicts}


def print_report(summary: dict, args: argparse.Namespace, nbytes: int, base: str) -> None:
    """Markdown table and verdict lines on stdout."""
    print()
    print(f"{nbytes / (1 << 20):.0f} MiB fp32 in {args.tensors} tensors, {args.repeat} rounds "
          f"after {args.warmup} warm-up, "
          f"dir {base} ({fs_type(base)}), {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"tierstore io_threads={args.io_threads or 'default'}")
    print("CPU s: median process CPU time (user+system, all threads) of the operation.")
    if args.cuda:
        print(f"Loads land in tensors on {torch.cuda.get_device_name()} (timed until "
              "torch.cuda.synchronize() returns).")
    print("Loads read from the page cache (each checkpoint's files read once, untimed, just "
          "before its load); destination tensors preallocated, results checked with torch.equal.")
    print()
    best_fs = summary["best_stock_writer"]
    save, load = summary["save"], summary["load"]
    rows = []
    for c in SAVE_CONTENDERS:
        s = save[c]
        if c in STORES:
            r = (f"{s['gbps'] / save[best_fs]['gbps']:.2f}x {best_fs}, "
                 f"{s['gbps'] / save['raw-write']['gbps']:.2f}x raw-write")
            if c == "tierstore-signed":
                r += f", {s['gbps'] / save['tierstore']['gbps']:.2f}x unsigned"
        else:
            r = f"{s['gbps'] / save['raw-write']['gbps']:.2f}x raw-write"
        rows.append(("save", c, s, r))
    for c in LOAD_CONTENDERS:
        s = load[c]
        r = (f"{s['gbps'] / load['dcp-fs-reader']['gbps']:.2f}x dcp-fs-reader"
             if c != "dcp-fs-reader" else "1.00x (baseline)")
        if c == "tierstore-signed":
            r += f", {s['gbps'] / load['tierstore']['gbps']:.2f}x unsigned"
        rows.append(("load", c, s, r))
    print_table(["op", "contender", "median s:", "GB/s:", "ratio", "CPU s:", "rounds (s)"],
                [[op, c, f"{s['median_s']:.3f}", f"{s['gbps']:.2f}", r,
                  f"{s['median_cpu_s']:.2f}", rounds_text(s["seconds"])]
                 for op, c, s, r in rows])
    print()
    print_verdicts(summary["verdicts"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, 3, "lazy imports, allocator and page-cache growth",
                         "parent of the temp directory (default: system temp dir); not tmpfs")
    return parse_with_cuda(p, argv, "load into destination tensors on the GPU (saves stay from "
                                    "host tensors); needs CUDA")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parent, kind = disk_parent(args, "the save figures would mean nothing")
    log = progress_log(args.quiet)

    t_start = time.perf_counter()
    sd = make_state_dict(args.size_mib, args.tensors)
    dest = {k: torch.empty_like(v, device="cuda" if args.cuda else "cpu")
            for k, v in sd.items()}
    nbytes = nbytes_of(sd)
    with scratch("tierstore-bench-", parent) as base:
        log(f"benchmark dir {base} ({kind})")
        res = warmup_then_rounds(args, log, Samples, lambda rnd, _warm, res, lg: run_round(
            rnd, sd, dest, base, args.io_threads, res, lg))

    summary = summarize(res, nbytes)
    print_report(summary, args, nbytes, base)
    config = {"size_mib": args.size_mib, "tensors": args.tensors, "repeat": args.repeat,
              "warmup": args.warmup, "bytes": nbytes, "dir": parent, "fs_type": kind,
              "io_threads": args.io_threads, "load_from": "page cache (warmed untimed)",
              "stock_load_source": STOCK_LOAD_SOURCE,
              "load_into": "cuda" if args.cuda else "cpu"}
    return finish_report(args, config, summary, t_start)


if __name__ == "__main__":
    sys.exit(main())
