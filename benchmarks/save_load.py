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

Then two load contenders read what they just wrote into preallocated tensors of the same shapes:
``tierstore`` (``store.reader()``, which verifies every file's checksum) loads the tierstore
checkpoint, and stock ``FileSystemReader`` loads the ``dcp-fs-t4`` checkpoint. Both are read **from
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

Progress lines go to stderr, the report to stdout. ``--strict`` makes the exit status 1 when a target is missed (for CI). Temp directories are
removed at the end, also after an error.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

# Run from a checkout without installing: make the repository root importable.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter  # noqa: E402

import tierstore  # noqa: E402

GB = 1e9
SAVE_CONTENDERS = ("tierstore", "dcp-fs-t1", "dcp-fs-t4", "torch.save", "raw-write")
LOAD_CONTENDERS = ("tierstore", "dcp-fs-reader")
# The stock checkpoint that FileSystemReader loads: the multi-file stock layout, like tierstore's.
STOCK_LOAD_SOURCE = "dcp-fs-t4"
CHECKPOINT_ID = "step-1"

# Acceptance targets: (name, tierstore contender, baseline description, minimum ratio).
SAVE_VS_FS_TARGET = 1.0
SAVE_VS_RAW_TARGET = 0.85
LOAD_VS_FS_TARGET = 1.5


# -- state dict ------------------------------------------------------------------------------

def make_state_dict(size_mib: int, tensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``tensors`` fp32 tensors of random data totalling ``size_mib`` MiB (the last one takes
    the remainder). 2-D where the size allows, like real weights."""
    total = size_mib * (1 << 20) // 4
    if tensors < 1 or total < tensors:
        raise SystemExit(f"--tensors must be between 1 and the number of floats ({total})")
    gen = torch.Generator().manual_seed(seed)
    per = total // tensors
    sd = {}
    for i in range(tensors):
        numel = per if i < tensors - 1 else total - per * (tensors - 1)
        shape = (numel // 1024, 1024) if numel % 1024 == 0 else (numel,)
        sd[f"layer{i:03d}.weight"] = torch.randn(shape, generator=gen, dtype=torch.float32)
    return sd


def nbytes_of(sd: dict[str, torch.Tensor]) -> int:
    """Tensor payload in bytes: the figure every contender's GB/s is computed from."""
    return sum(t.nbytes for t in sd.values())


def tensor_view(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's memory, without a copy (numpy may be absent)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


# -- filesystem helpers ------------------------------------------------------------------------

def fs_type(path: str) -> str:
    """Filesystem type of ``path`` (longest mount-point prefix in /proc/mounts), or '?'."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def remove(path: str) -> None:
    """Delete a file or directory tree if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def warm_page_cache(path: str) -> int:
    """Read every file under ``path`` once (untimed) so a following load is served from the page
    cache for both load contenders alike. Returns bytes read."""
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb", buffering=0) as f:
                while n := f.readinto(view):
                    total += n
    return total


# -- save contenders ---------------------------------------------------------------------------
# Each takes (state dict, output path) and returns a zero-argument callable that performs the
# timed save; anything built before that (the store, directories) is setup and not timed.

def open_store(root: str, io_threads: int | None) -> "tierstore.Store":
    """A store with one ``local`` tier (fsync on, the default) at ``root``."""
    config: dict = {"tier": [{"name": "nvme", "backend": "local", "path": root}]}
    if io_threads is not None:
        config["store"] = {"io_threads": io_threads}
    return tierstore.open(config)


def prepare_save(name: str, sd: dict[str, torch.Tensor], out: str,
                 io_threads: int | None) -> tuple[Callable[[], None], Callable[[], None]]:
    """Return (timed save, untimed teardown) for save contender ``name`` writing to ``out``."""
    if name == "tierstore":
        store = open_store(out, io_threads)

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
            fd = os.open(os.path.join(out, "raw.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for t in sd.values():
                    view = tensor_view(t)
                    done = 0
                    while done < len(view):  # os.write may write less than asked
                        done += os.write(fd, view[done:])
                os.fsync(fd)
            finally:
                os.close(fd)
        return save, lambda: None

    raise ValueError(name)


# -- load contenders ---------------------------------------------------------------------------

def load_into(name: str, dest: dict[str, torch.Tensor], sources: dict[str, str],
              stores: dict[str, "tierstore.Store"]) -> None:
    """Timed part of a load: ``dcp.load`` into ``dest`` with the contender's reader."""
    if name == "tierstore":
        dcp.load(dest, storage_reader=stores["tierstore"].reader(), checkpoint_id=CHECKPOINT_ID)
    elif name == "dcp-fs-reader":
        dcp.load(dest, storage_reader=FileSystemReader(sources[STOCK_LOAD_SOURCE]))
    else:
        raise ValueError(name)


def check_equal(name: str, dest: dict[str, torch.Tensor], sd: dict[str, torch.Tensor]) -> None:
    """Fail loudly when a load did not reproduce the saved bytes."""
    for key, ref in sd.items():
        if not torch.equal(dest[key], ref):
            raise SystemExit(f"load contender '{name}' returned wrong data for '{key}'")


# -- the run -----------------------------------------------------------------------------------

@dataclass
class Results:
    """Wall seconds and process CPU seconds (all threads, user + system) per round per
    contender. CPU time shows how much of the machine a contender needs, which on a shared
    2-core machine decides how much it suffers when neighbours are busy."""
    save: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in SAVE_CONTENDERS})
    load: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in LOAD_CONTENDERS})
    save_cpu: dict[str, list[float]] = field(
        default_factory=lambda: {c: [] for c in SAVE_CONTENDERS})
    load_cpu: dict[str, list[float]] = field(
        default_factory=lambda: {c: [] for c in LOAD_CONTENDERS})


def rotated(items: tuple[str, ...], k: int) -> list[str]:
    """``items`` in round-robin order starting at index ``k`` (mod len)."""
    k %= len(items)
    return list(items[k:]) + list(items[:k])


def run_round(rnd: int, sd: dict[str, torch.Tensor], dest: dict[str, torch.Tensor], base: str,
              io_threads: int | None, res: Results, log: Callable[[str], None]) -> None:
    """One round: every save contender (rotated order), then every load contender."""
    nbytes = nbytes_of(sd)
    rdir = os.path.join(base, f"round{rnd}")
    os.makedirs(rdir)
    outputs: dict[str, str] = {}
    stores: dict[str, tierstore.Store] = {}
    keep = {"tierstore", STOCK_LOAD_SOURCE}  # load sources stay until the load phase
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
            gc.collect()
            os.sync()
            c0, t0 = time.process_time(), time.perf_counter()
            save()
            secs, cpu = time.perf_counter() - t0, time.process_time() - c0
            outputs[name] = out
            if name == "tierstore":
                stores["tierstore"] = open_store(out, io_threads)  # for the load phase
            teardown()
            res.save[name].append(secs)
            res.save_cpu[name].append(cpu)
            log(f"  round {rnd + 1} save {name:<13} {secs:7.3f} s  {nbytes / secs / GB:6.2f} GB/s"
                f"  cpu {cpu:6.3f} s")

        sources = {k: v for k, v in outputs.items() if k in keep}
        for name in rotated(LOAD_CONTENDERS, rnd):
            for t in dest.values():
                t.zero_()  # a load that writes nothing must fail check_equal
            # Same conditions for both readers: their files come from the page cache.
            warm_page_cache(sources["tierstore" if name == "tierstore" else STOCK_LOAD_SOURCE])
            gc.collect()
            os.sync()
            c0, t0 = time.process_time(), time.perf_counter()
            load_into(name, dest, sources, stores)
            secs, cpu = time.perf_counter() - t0, time.process_time() - c0
            check_equal(name, dest, sd)
            res.load[name].append(secs)
            res.load_cpu[name].append(cpu)
            log(f"  round {rnd + 1} load {name:<13} {secs:7.3f} s  {nbytes / secs / GB:6.2f} GB/s"
                f"  cpu {cpu:6.3f} s")
    finally:
        for store in stores.values():
            store.close()
        remove(rdir)


def summarize(res: Results, nbytes: int) -> dict:
    """Medians, GB/s, ratios and verdicts as a JSON-able dict."""
    def stats(times: list[float], cpu: list[float]) -> dict:
        med = statistics.median(times)
        return {"seconds": times, "median_s": med, "gbps": nbytes / med / GB,
                "cpu_seconds": cpu, "median_cpu_s": statistics.median(cpu)}

    save = {c: stats(t, res.save_cpu[c]) for c, t in res.save.items()}
    load = {c: stats(t, res.load_cpu[c]) for c, t in res.load.items()}
    best_fs = max(("dcp-fs-t1", "dcp-fs-t4"), key=lambda c: save[c]["gbps"])

    def ratio(a: dict, b: dict) -> float:
        return b["median_s"] / a["median_s"]  # throughput of a over throughput of b

    def per_round(a: list[float], b: list[float]) -> list[float]:
        return [tb / ta for ta, tb in zip(a, b)]

    ts, tl = save["tierstore"], load["tierstore"]
    verdicts = [
        {"target": f"tierstore save >= {SAVE_VS_FS_TARGET}x best stock FileSystemWriter "
                   f"({best_fs})",
         "ratio": ratio(ts, save[best_fs]), "min": SAVE_VS_FS_TARGET,
         "per_round": per_round(ts["seconds"], save[best_fs]["seconds"])},
        {"target": f"tierstore save >= {SAVE_VS_RAW_TARGET}x raw write+fsync",
         "ratio": ratio(ts, save["raw-write"]), "min": SAVE_VS_RAW_TARGET,
         "per_round": per_round(ts["seconds"], save["raw-write"]["seconds"])},
        {"target": f"tierstore load >= {LOAD_VS_FS_TARGET}x stock FileSystemReader",
         "ratio": ratio(tl, load["dcp-fs-reader"]), "min": LOAD_VS_FS_TARGET,
         "per_round": per_round(tl["seconds"], load["dcp-fs-reader"]["seconds"])},
    ]
    for v in verdicts:
        v["pass"] = v["ratio"] >= v["min"]
    return {"save": save, "load": load, "best_stock_writer": best_fs, "verdicts": verdicts}


def print_report(summary: dict, args: argparse.Namespace, nbytes: int, base: str) -> None:
    """Markdown table and verdict lines on stdout."""
    print()
    print(f"{nbytes / (1 << 20):.0f} MiB fp32 in {args.tensors} tensors, {args.repeat} rounds "
          f"after {args.warmup} warm-up, "
          f"dir {base} ({fs_type(base)}), {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"tierstore io_threads={args.io_threads or 'default'}")
    print("CPU s: median process CPU time (user+system, all threads) of the operation.")
    print("Loads read from the page cache (each checkpoint's files read once, untimed, just "
          "before its load); destination tensors preallocated, results checked with torch.equal.")
    print()
    print("| op | contender | median s | GB/s | ratio | CPU s | rounds (s) |")
    print("| --- | --- | ---: | ---: | --- | ---: | --- |")
    best_fs = summary["best_stock_writer"]
    save, load = summary["save"], summary["load"]
    for c in SAVE_CONTENDERS:
        s = save[c]
        if c == "tierstore":
            r = (f"{s['gbps'] / save[best_fs]['gbps']:.2f}x {best_fs}, "
                 f"{s['gbps'] / save['raw-write']['gbps']:.2f}x raw-write")
        else:
            r = f"{s['gbps'] / save['raw-write']['gbps']:.2f}x raw-write"
        rounds = " ".join(f"{t:.3f}" for t in s["seconds"])
        print(f"| save | {c} | {s['median_s']:.3f} | {s['gbps']:.2f} | {r} | "
              f"{s['median_cpu_s']:.2f} | {rounds} |")
    for c in LOAD_CONTENDERS:
        s = load[c]
        r = (f"{s['gbps'] / load['dcp-fs-reader']['gbps']:.2f}x dcp-fs-reader"
             if c != "dcp-fs-reader" else "1.00x (baseline)")
        rounds = " ".join(f"{t:.3f}" for t in s["seconds"])
        print(f"| load | {c} | {s['median_s']:.3f} | {s['gbps']:.2f} | {r} | "
              f"{s['median_cpu_s']:.2f} | {rounds} |")
    print()
    for v in summary["verdicts"]:
        rounds = ", ".join(f"{x:.2f}" for x in v["per_round"])
        print(f"{'PASS' if v['pass'] else 'FAIL'}: {v['target']}: {v['ratio']:.2f}x "
              f"(per round: {rounds})")


def benchmark_parser(doc: str, repeat: int, warmup_costs: str,
                     dir_help: str) -> argparse.ArgumentParser:
    """The options every benchmark in this folder takes; each adds its own after."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024, help="state dict size (default 1024)")
    p.add_argument("--tensors", type=int, default=64, help="number of tensors (default 64)")
    p.add_argument("--repeat", type=int, default=repeat, help=f"timed rounds (default {repeat})")
    p.add_argument("--warmup", type=int, default=1,
                   help=f"untimed rounds first (default 1): first-call costs ({warmup_costs}) "
                        f"would otherwise land on round 1")
    p.add_argument("--dir", default=None, help=dir_help)
    p.add_argument("--io-threads", type=int, default=None,
                   help="tierstore [store] io_threads (default: tierstore's own default)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    return p


def disk_parent(args: argparse.Namespace, why: str) -> tuple[str, str]:
    """``--dir`` (default: the system temp dir) and its filesystem type; exits when it is tmpfs,
    where fsync costs nothing and ``why`` would mean nothing."""
    parent = args.dir or tempfile.gettempdir()
    kind = fs_type(parent)
    if kind in ("tmpfs", "ramfs"):
        raise SystemExit(f"{parent} is on {kind} ({why}); point --dir at a disk-backed "
                         f"filesystem")
    return parent, kind


def progress_log(quiet: bool) -> Callable[[str], None]:
    """Per-round progress lines on stderr (none with ``--quiet``); also silences the warning DCP
    gives on every call without a process group (these benchmarks mean to do that)."""
    warnings.filterwarnings("ignore", module=r"torch\.distributed\..*")
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")
    return (lambda _m: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, 3, "lazy imports, allocator and page-cache growth",
                         "parent of the temp directory (default: system temp dir); not tmpfs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parent, kind = disk_parent(args, "the save figures would mean nothing")
    log = progress_log(args.quiet)

    t_start = time.perf_counter()
    sd = make_state_dict(args.size_mib, args.tensors)
    dest = {k: torch.empty_like(v) for k, v in sd.items()}
    nbytes = nbytes_of(sd)
    base = tempfile.mkdtemp(prefix="tierstore-bench-", dir=parent)
    res = Results()
    try:
        log(f"benchmark dir {base} ({kind})")
        for w in range(args.warmup):
            log(f"warm-up round {w + 1} (not counted)")
            run_round(w, sd, dest, base, args.io_threads, Results(), lambda _m: None)
        for rnd in range(args.repeat):
            run_round(rnd, sd, dest, base, args.io_threads, res, log)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    summary = summarize(res, nbytes)
    print_report(summary, args, nbytes, base)
    elapsed = time.perf_counter() - t_start
    print(f"\n(total run time {elapsed:.0f} s)")
    config = {"size_mib": args.size_mib, "tensors": args.tensors, "repeat": args.repeat,
              "warmup": args.warmup, "bytes": nbytes, "dir": parent, "fs_type": kind,
              "io_threads": args.io_threads, "load_from": "page cache (warmed untimed)",
              "stock_load_source": STOCK_LOAD_SOURCE}
    return finish_report(args, config, summary, elapsed)


def finish_report(args: argparse.Namespace, config: dict, summary: dict, elapsed: float) -> int:
    """Write ``--json`` (config, machine, figures) and return the exit status (``--strict``:
    1 when a target was missed). Shared by the benchmarks in this folder."""
    if args.json:
        doc = {
            "config": config,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "torch": torch.__version__,
                        "tierstore": tierstore.__version__},
            "elapsed_s": elapsed,
            **summary,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 1 if args.strict and not all(v["pass"] for v in summary["verdicts"]) else 0


# -- benchmarks run under torchrun (replication.py, restore.py) -----------------------------------

#: set by a launcher that runs a benchmark under torchrun: where rank 0 leaves its exit status
STATUS_ENV = "TIERSTORE_BENCH_STATUS_FILE"


def under_torchrun() -> bool:
    """True inside a torchrun worker (torchrun sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_exit_status(rank: int, status: int) -> int:
    """A torchrun rank's exit code. Under a launcher (``STATUS_ENV`` set) rank 0 leaves
    ``status`` in its file and every rank exits 0: a failed acceptance target is the report's
    verdict, not a crash for torchrun to bury under its own failure report."""
    if not os.environ.get(STATUS_ENV):
        return status
    if rank == 0:
        with open(os.environ[STATUS_ENV], "w") as f:
            f.write(str(status))
    return 0


def torchrun_main(argv: list[str] | None, parse_args: Callable[[list[str]], argparse.Namespace],
                  worker: Callable[[argparse.Namespace], int],
                  launch: Callable[[argparse.Namespace, list[str]], int]) -> int:
    """A torchrun benchmark's entry point: inside torchrun be one rank (``worker``), else start
    the torchrun invocations (``launch``) with these arguments."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return worker(args) if under_torchrun() else launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
