"""Async-save staging: how long ``dcp.async_save`` stalls training, tierstore against stock DCP and
one plain memory copy, in one process and one run.

Why
---
``dcp.async_save`` returns once the state dict has been copied off the training tensors (staged);
the write runs on in the background. That copy is the part training waits for: the *stall*.
Stock DCP's stager (``FileSystemWriter``'s ``BlockingAsyncStager``) allocates fresh host buffers on
every save, so each stall is an allocation, the page faults of touching fresh memory, and the
copy. tierstore's staging plugins (``cpu``, ``pinned``, ``shm``) allocate their buffers once, on
the first save, and reuse them while the state dict's layout stays the same, so from the second
save on its stall should be one memory copy. This benchmark checks that, against both the stock
stall and the copy itself.

What is measured
----------------
A state dict of ``--size-mib`` MiB of random fp32 data in ``--tensors`` tensors (default 1 GiB in
64 CPU tensors) is saved or copied by three methods:

=============  ===============================================================================
``tierstore``  ``dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-<i>")``;
               the store has one tier, ``{"name": "ram", "backend": "local", "path": ...,
               "keep": 2}``, and the default staging plugin (``cpu``; ``shm`` with
               ``--executor process``, ``pinned`` with ``--cuda``). One store for the whole run,
               so its staging buffers are allocated by the first save and reused after.
``stock``      ``dcp.async_save(sd, storage_writer=FileSystemWriter(path), checkpoint_id=path)``
               into a fresh directory each time, with DCP's default staging (no
               ``async_stager``): fresh buffers on every save.
``copy``       ``for k, t in sd.items(): dst[k].copy_(t)`` into destination tensors allocated
               once, outside the timed region: the one-memory-copy limit. With ``--cuda``,
               ``copy_(non_blocking=True)`` into pinned host tensors, then
               ``torch.cuda.synchronize()``.
=============  ===============================================================================

The **stall** of a save is the time from calling ``dcp.async_save`` until it returns (plus, when
it returns an ``AsyncSaveResponse``, the wait on its ``staging_completion``). Then the benchmark
waits for the save to be committed (``future.result()`` or ``upload_completion.result()``),
outside the stall but inside the save's **total** time, before anything else runs. For ``copy``
both figures are the copy's time.

Checkpoints go to a temp directory under ``--dir`` (default: ``/dev/shm`` when it has room for
the checkpoints the run keeps at once, else the system temp dir; the report says which). Each
stock checkpoint is deleted (untimed) once its total time is taken; tierstore keeps two.

Order and fairness
------------------
1. The **first save** of each method, before anything else: tierstore's first ``async_save`` (its
   buffers are allocated here), then stock's. Each is the very first call of that method in the
   process; tierstore's, being the first ``async_save`` of all, also carries DCP's one-time costs
   (with ``--executor process``: the broadcast that sets up DCP's checkpoint process in the
   stall, and that process's start-up in the total).
2. ``--warmup`` untimed rounds (default 1), then ``--repeat`` timed rounds (default 5, at least
   5). A round runs the three methods in round-robin order, the first one rotating from round to
   round, so a noisy neighbour on the shared machine hits every method alike. Before each timed
   operation: ``gc.collect()``, ``os.sync()`` (and ``torch.cuda.synchronize()`` with ``--cuda``).
3. Every round (warm-up rounds included) starts by changing one tensor of the state dict in place
   (``add_(1)``, a different tensor each round), so each tierstore save really copies new data
   into the reused buffers.

The report gives each method's median stall, GB/s (10^9 bytes of tensor payload per second of
stall), the median process CPU seconds (all threads) and minor page faults during the stall
(touching fresh memory costs a fault per page, so this tells fresh buffers from reused ones
without timing noise), the median total time and the per-round stalls; tierstore's own
``staged`` events (copy seconds inside the staging plugin, seconds waited for the previous save)
for information; then the verdicts, ratios of medians with the per-round ratios beside them
(same round, same machine state: the noise indicator):

* tierstore stall <= 1.3x one plain copy
* tierstore stall <= 0.7x stock DCP's stall

**Correctness** is checked once, after the last round: the last tierstore checkpoint is loaded
with ``dcp.load(dest, storage_reader=store.reader(), checkpoint_id=...)`` into preallocated
tensors (zeroed first) and must equal the state dict bit for bit (it was saved after the last
change); the tierstore checkpoint before it (kept, ``keep = 2``) must equal the state before that
change, so a save that left stale or later data in the reused buffers fails the run.

Modes
-----
``--executor process`` runs both async saves with ``AsyncCheckpointerType.PROCESS`` (default
``thread``): DCP's checkpoint process needs torch.distributed, so the benchmark starts a 1-rank
gloo group (127.0.0.1, a free port) first, and tierstore stages into shared memory (``[store]
staging = "shm"``) so the buffers reach that process without another copy.

``--cuda`` (needs CUDA) puts the state dict on the GPU (default ``--size-mib`` 4096 there);
tierstore stages into pinned buffers (``[store] staging = "pinned"``, non-blocking copies on a side
stream), stock DCP into fresh pageable buffers, and the copy baseline is a non-blocking copy into
pinned host tensors. The correctness check then compares with the GPU tensors copied back.

How to run
----------
From the repository root::

    .venv/bin/python benchmarks/staging.py              # 1 GiB, 64 tensors, 1 warm-up + 5 rounds
    .venv/bin/python benchmarks/staging.py --repeat 9 --json /tmp/staging.json
    .venv/bin/python benchmarks/staging.py --executor process --size-mib 256
    .venv/bin/python benchmarks/staging.py --cuda       # GPU machine: 4 GiB on the GPU

Progress lines go to stderr, the report to stdout. ``--strict`` makes the exit status 1 when a
target is missed (for CI). The temp directory is removed at the end, also after an error.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import tierstore

from harness import (GB, Clock, StagedEvents, benchmark_parser, finish_report, free_bytes,
                     free_port, fs_type, make_state_dict, nbytes_of, need_room, parse_with_cuda,
                     print_table, print_verdicts, progress_log, quiesce, ratios, remove, rotated,
                     rounds_text, scratch, warmup_then_rounds)

METHODS = ("tierstore", "stock", "copy")
SAVES = ("tierstore", "stock")
KEEP = 2                 # the tierstore tier's keep
DEFAULT_MIB = 1024
DEFAULT_CUDA_MIB = 4096
MIN_REPEAT = 5

# Acceptance targets: tierstore's median stall over the baseline's, at most.
VS_COPY_MAX = 1.3
VS_STOCK_MAX = 0.7


# -- set-up ----------------------------------------------------------------------------------------

def init_single_rank_group() -> None:
    """A 1-rank gloo group on 127.0.0.1: DCP's process executor needs torch.distributed."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    os.environ["RANK"] = "0"
    os.environ["WORLD_SIZE"] = "1"
    dist.init_process_group(backend="gloo", rank=0, world_size=1)


def staging_plugin(args: argparse.Namespace) -> str | None:
    """The ``[store] staging`` this mode uses (None: tierstore's default, ``cpu``)."""
    if args.executor == "process":
        return "shm"
    if args.cuda:
        return "pinned"
    return None


def open_store(root: str, args: argparse.Namespace, timer: StagedEvents) -> "tierstore.Store":
    """The store under test: one ``local`` tier at ``root`` keeping two checkpoints."""
    store_table: dict = {}
    if (staging := staging_plugin(args)) is not None:
        store_table["staging"] = staging
    if args.io_threads is not None:
        store_table["io_threads"] = args.io_threads
    config: dict = {"tier": [{"name": "ram", "backend": "local", "path": root, "keep": KEEP}]}
    if store_table:
        config["store"] = store_table
    return tierstore.open(config, plugins=[timer])


def pick_dir(args: argparse.Namespace, payload: int) -> tuple[str, str]:
    """Parent of the temp directory and why: ``--dir``, else /dev/shm when it has room for what
    the run holds at once (``KEEP`` + 1 tierstore checkpoints and one stock checkpoint, +10%),
    else the system temp dir (which must have that room too)."""
    need = int((KEEP + 2) * payload * 1.1) + (64 << 20)
    if args.dir:
        need_room(args.dir, need)
        return args.dir, "--dir"
    if os.path.isdir("/dev/shm") and free_bytes("/dev/shm") >= need:
        return "/dev/shm", "default: /dev/shm has room"
    tmp = tempfile.gettempdir()
    if free_bytes(tmp) < need:
        raise SystemExit(f"neither /dev/shm nor {tmp} has the {need / GB:.1f} GB the run needs; "
                         f"use --dir")
    return tmp, f"default: /dev/shm has less than {need / GB:.1f} GB free"


def build_state(args: argparse.Namespace) -> tuple[dict[str, torch.Tensor],
                                                   dict[str, torch.Tensor]]:
    """The state dict (on the GPU with ``--cuda``) and the copy baseline's destination tensors,
    allocated once here (pinned host memory with ``--cuda``), also the load destination of the
    correctness check."""
    sd = make_state_dict(args.size_mib, args.tensors)
    if args.cuda:
        for k in list(sd):
            sd[k] = sd[k].to("cuda")  # one tensor at a time: the host copies go as we move
        torch.cuda.synchronize()
    dst = {k: torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=args.cuda)
           for k, t in sd.items()}
    for t in dst.values():
        t.zero_()  # touch every page now, outside any timed region
    return sd, dst


# -- the timed operations --------------------------------------------------------------------------

@dataclass
class Env:
    """Everything a round needs: options, state dict, copy destination, store, directories, the
    executor type, counters, the mutation record and the tierstore saves made so far."""

    args: argparse.Namespace
    sd: dict[str, torch.Tensor]
    dst: dict[str, torch.Tensor]
    store: "tierstore.Store"
    timer: StagedEvents
    stock_dir: str
    executor: AsyncCheckpointerType
    payload: int
    saves: int = 0
    mutations: int = 0
    # the last change: (mutation number, key, the tensor's data before it)
    last_change: tuple[int, str, torch.Tensor] | None = None
    # tierstore saves: (checkpoint id, number of mutations before it)
    tierstore_saves: list[tuple[str, int]] = field(default_factory=list)


@dataclass(frozen=True)
class Timing:
    """One timed operation: stall seconds, total seconds until committed, process CPU seconds
    (all threads) and minor page faults during the stall."""

    stall: float
    total: float
    cpu: float
    faults: int


def mutate(env: Env) -> None:
    """Change one tensor in place (a different one each call), keeping its previous data for the
    correctness check, so every tierstore save copies new data into its reused buffers."""
    keys = list(env.sd)
    key = keys[env.mutations % len(keys)]
    before = env.sd[key].clone()
    env.sd[key].add_(1)
    if env.args.cuda:
        torch.cuda.synchronize()
    env.mutations += 1
    env.last_change = (env.mutations, key, before)


def async_save(env: Env, method: str) -> Timing:
    """One ``dcp.async_save`` by ``method`` ("tierstore" or "stock"), waited for until
    committed."""
    env.saves += 1
    if method == "tierstore":
        cid = f"step-{env.saves}"
        kwargs = dict(storage_writer=env.store.writer(), checkpoint_id=cid,
                      process_group=env.store.process_group)
    else:
        path = os.path.join(env.stock_dir, f"stock-{env.saves}")
        kwargs = dict(storage_writer=FileSystemWriter(path), checkpoint_id=path)
    with Clock() as stall:
        resp = dcp.async_save(env.sd, async_checkpointer_type=env.executor, **kwargs)
        staging_completion = getattr(resp, "staging_completion", None)
        if staging_completion is not None:  # an AsyncSaveResponse
            staging_completion.result()
    upload = getattr(resp, "upload_completion", resp)
    upload.result()
    total = time.perf_counter() - stall.started
    if method == "tierstore":
        env.tierstore_saves.append((cid, env.mutations))
    else:
        remove(path)  # untimed; tmpfs memory back before the next operation
    return Timing(stall.seconds, total, stall.cpu, stall.faults)


def plain_copy(env: Env) -> Timing:
    """The one-memory-copy baseline into the preallocated destination (stall and total alike:
    a copy has no background part)."""
    sd, dst = env.sd, env.dst
    with Clock() as c:
        if env.args.cuda:
            for k, t in sd.items():
                dst[k].copy_(t, non_blocking=True)
            torch.cuda.synchronize()
        else:
            for k, t in sd.items():
                dst[k].copy_(t)
    return Timing(c.seconds, c.seconds, c.cpu, c.faults)


def run_method(env: Env, method: str) -> Timing:
    """Settle, then the timed operation of ``method``."""
    quiesce(cuda=env.args.cuda)
    if method == "copy":
        return plain_copy(env)
    return async_save(env, method)


# -- the run ---------------------------------------------------------------------------------------

def _lists() -> dict[str, list[float]]:
    """An empty list per method."""
    return {m: [] for m in METHODS}


@dataclass
class Results:
    """Per method and round: stall, total and stall CPU seconds and stall page faults; the
    first saves; tierstore's staged events (copy seconds, seconds waited for the previous save,
    buffers reused)."""

    stall: dict[str, list[float]] = field(default_factory=_lists)
    total: dict[str, list[float]] = field(default_factory=_lists)
    cpu: dict[str, list[float]] = field(default_factory=_lists)
    faults: dict[str, list[float]] = field(default_factory=_lists)
    first: dict[str, dict[str, float]] = field(default_factory=dict)
    staged_copy: list[float] = field(default_factory=list)
    staged_wait: list[float] = field(default_factory=list)
    staged_reused: list[bool] = field(default_factory=list)


def line(log: Callable[[str], None], label: str, method: str, t: Timing, payload: int) -> None:
    """One progress line on stderr."""
    log(f"  {label} {method:<9} stall {t.stall:7.3f} s  {payload / t.stall / GB:6.2f} GB/s"
        f"  cpu {t.cpu:6.3f} s  faults {t.faults:7d}  total {t.total:7.3f} s")


def first_saves(env: Env, res: Results, log: Callable[[str], None]) -> None:
    """The first ``async_save`` of each method (tierstore, then stock): buffers allocated."""
    for method in SAVES:
        t = run_method(env, method)
        ev = env.timer.take()
        res.first[method] = {"stall_s": t.stall, "total_s": t.total, "cpu_s": t.cpu,
                             "faults": t.faults}
        if method == "tierstore" and ev is not None:
            res.first[method]["staged_copy_s"] = ev.seconds
            res.first[method]["reused"] = bool(ev.detail.get("reused"))
        line(log, "first save", method, t, env.payload)


def run_round(rnd: int, env: Env, res: Results, log: Callable[[str], None]) -> None:
    """One round: change one tensor, then the three methods in rotated order."""
    mutate(env)
    for method in rotated(METHODS, rnd):
        t = run_method(env, method)
        res.stall[method].append(t.stall)
        res.total[method].append(t.total)
        res.cpu[method].append(t.cpu)
        res.faults[method].append(t.faults)
        if method == "tierstore":
            ev = env.timer.take()
            if ev is not None:
                res.staged_copy.append(ev.seconds)
                res.staged_wait.append(float(ev.detail.get("waited_s") or 0.0))
                res.staged_reused.append(bool(ev.detail.get("reused")))
        line(log, f"round {rnd + 1}", method, t, env.payload)


def load_and_compare(env: Env, cid: str, expected: Callable[[str], torch.Tensor]) -> list[str]:
    """Load tierstore checkpoint ``cid`` into the (zeroed) destination tensors; return the keys
    whose loaded data differs from ``expected(key)`` bit for bit."""
    dest = env.dst
    for t in dest.values():
        t.zero_()
    dcp.load(dest, storage_reader=env.store.reader(), checkpoint_id=cid,
             process_group=env.store.process_group)
    bad = []
    for key in dest:
        ref = expected(key)
        ref = ref.cpu() if ref.is_cuda else ref
        if not torch.equal(dest[key], ref):
            bad.append(key)
    return bad


def verify(env: Env) -> dict:
    """The correctness check (see the module docstring); raises SystemExit on a mismatch."""
    assert env.last_change is not None and len(env.tierstore_saves) >= 2
    n, key, before = env.last_change
    (prev_cid, prev_n), (last_cid, last_n) = env.tierstore_saves[-2:]
    if last_n != n or prev_n != n - 1:
        raise SystemExit("internal error: the last two tierstore saves do not straddle the last "
                         "change of the state dict")
    bad = load_and_compare(env, last_cid, lambda k: env.sd[k])
    if bad:
        raise SystemExit(f"tierstore checkpoint {last_cid} differs from the state dict it saved "
                         f"in {len(bad)} tensors (first: {bad[0]})")
    bad = load_and_compare(env, prev_cid, lambda k: before if k == key else env.sd[k])
    if bad:
        raise SystemExit(f"tierstore checkpoint {prev_cid} differs from the state dict it saved "
                         f"in {len(bad)} tensors (first: {bad[0]})")
    if torch.equal(before, env.sd[key]):
        raise SystemExit(f"internal error: changing {key} left it equal")
    return {"checked": [prev_cid, last_cid], "changed_tensor": key, "ok": True}


# -- report ----------------------------------------------------------------------------------------

def summarize(res: Results, payload: int, check: dict) -> dict:
    """Medians, GB/s, ratios and verdicts as a JSON-able dict."""
    figures = {}
    for m in METHODS:
        med = statistics.median(res.stall[m])
        figures[m] = {"stall_s": res.stall[m], "median_stall_s": med, "gbps": payload / med / GB,
                      "total_s": res.total[m], "median_total_s": statistics.median(res.total[m]),
                      "cpu_s": res.cpu[m], "median_cpu_s": statistics.median(res.cpu[m]),
                      "faults": res.faults[m], "median_faults": statistics.median(res.faults[m])}
        if m in res.first:
            figures[m]["first"] = dict(res.first[m],
                                       gbps=payload / res.first[m]["stall_s"] / GB)
    ts = figures["tierstore"]

    def verdict(base: str, limit: float, what: str) -> dict:
        ratio = ts["median_stall_s"] / figures[base]["median_stall_s"]
        return {"target": f"tierstore stall <= {limit}x {what} (median seconds, "
                          f"tierstore/{base})",
                "ratio": ratio, "max": limit, "pass": ratio <= limit,
                "per_round": ratios(res.stall["tierstore"], res.stall[base])}

    verdicts = [verdict("copy", VS_COPY_MAX, "one plain copy"),
                verdict("stock", VS_STOCK_MAX, "stock DCP")]
    staged = {}
    if res.staged_copy:
        staged = {"copy_s": res.staged_copy, "median_copy_s": statistics.median(res.staged_copy),
                  "waited_s": res.staged_wait,
                  "median_waited_s": statistics.median(res.staged_wait),
                  "reused": res.staged_reused}
    return {"figures": figures, "payload_bytes": payload, "tierstore_staged": staged,
            "verify": check, "verdicts": verdicts}


LABELS = {
    "tierstore": "tierstore: async_save, store.writer() (reused buffers)",
    "stock": "stock DCP: async_save, FileSystemWriter (fresh buffers)",
    "copy": "one plain copy_ into preallocated tensors",
}


def print_report(summary: dict, args: argparse.Namespace, base: str, why: str,
                 staging: str) -> None:
    """Markdown table, notes and verdict lines on stdout."""
    f = summary["figures"]
    payload = summary["payload_bytes"]
    device = torch.cuda.get_device_name() if args.cuda else "CPU"
    print()
    print(f"{payload / (1 << 20):.0f} MiB fp32 in {args.tensors} tensors on {device}, "
          f"{args.repeat} rounds after {args.warmup} warm-up; executor {args.executor}, tierstore "
          f"staging '{staging}'; checkpoints under {base} ({fs_type(base)}; {why}); "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}")
    print("Stall: dcp.async_save's call until it returns (+ staging_completion when it returns "
          "an AsyncSaveResponse); total: until the save is committed. For copy both are the "
          "copy. GB/s of tensor payload per second of stall; CPU s and faults: median process "
          "CPU time (user+system, all threads) and minor page faults during the stall (fresh "
          f"memory costs a fault per page: {payload // resource.getpagesize()} pages of "
          f"{resource.getpagesize() >> 10} KiB here, fewer with huge pages).")
    print()
    rows = []
    for m in METHODS:
        s = f[m]
        first = f"{s['first']['stall_s']:.3f}" if "first" in s else "-"
        if m == "tierstore":
            r = (f"{s['median_stall_s'] / f['copy']['median_stall_s']:.2f}x copy, "
                 f"{s['median_stall_s'] / f['stock']['median_stall_s']:.2f}x stock")
        elif m == "stock":
            r = f"{s['median_stall_s'] / f['copy']['median_stall_s']:.2f}x copy"
        else:
            r = "1.00x (baseline)"
        rows.append([LABELS[m], first, f"{s['median_stall_s']:.3f}", f"{s['gbps']:.2f}", r,
                     f"{s['median_cpu_s']:.2f}", f"{s['median_faults']:.0f}",
                     f"{s['median_total_s']:.3f}", rounds_text(s["stall_s"])])
    print_table(["method", "first save stall s:", "median stall s:", "GB/s:", "ratio", "CPU s:",
                 "faults:", "median total s:", "stalls per round (s)"], rows)
    print()
    for m in SAVES:
        fs = f[m]["first"]
        extra = ""
        if "staged_copy_s" in fs:
            extra = (f"; stage() {fs['staged_copy_s']:.3f} s, buffers "
                     f"{'reused' if fs['reused'] else 'allocated'}")
        print(f"First save, {m}: stall {fs['stall_s']:.3f} s ({fs['gbps']:.2f} GB/s, "
              f"{fs['faults']} faults), total {fs['total_s']:.3f} s{extra}.")
    st = summary["tierstore_staged"]
    if st:
        reused = sum(st["reused"])
        print(f"tierstore staged events (timed rounds): stage() copy median "
              f"{st['median_copy_s']:.3f} s, waited for the previous save median "
              f"{st['median_waited_s'] * 1e3:.1f} ms, buffers reused in {reused} of "
              f"{len(st['reused'])} saves; the rest of the stall is spent outside the staging "
              f"plugin's copy (the writer's stage() bookkeeping, dcp.async_save's own work).")
    pages = payload // resource.getpagesize()
    for m in SAVES:
        faults = " ".join(str(x) for x in f[m]["faults"])
        print(f"{m} page faults per round: {faults} (of {pages} pages of payload).")
    v = summary["verify"]
    print(f"Correctness: tierstore checkpoints {v['checked'][0]} (before the last change of "
          f"{v['changed_tensor']}) and {v['checked'][1]} (after it) loaded with dcp.load and "
          f"equal to the state dict at their save, bit for bit.")
    print()
    print_verdicts(summary["verdicts"], missed="MISS")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The shared options plus ``--executor`` and ``--cuda``; resolves ``--size-mib``'s
    default (1024, or 4096 with ``--cuda``) and checks ``--repeat``."""
    p = benchmark_parser(__doc__, MIN_REPEAT, "DCP's lazy imports, thread start-up, allocator "
                         "growth", "parent of the temp directory (default: /dev/shm when it has "
                         "room, else the system temp dir)")
    for action in p._actions:
        if action.dest == "size_mib":
            action.default = None
            action.help = (f"state dict size (default {DEFAULT_MIB}; {DEFAULT_CUDA_MIB} with "
                           f"--cuda)")
    p.add_argument("--executor", choices=("thread", "process"), default="thread",
                   help="DCP's AsyncCheckpointerType for both async saves (default thread); "
                        "process starts a 1-rank gloo group and stages tierstore into shm")
    args = parse_with_cuda(p, argv, "state dict on the GPU, tierstore staging 'pinned', copy "
                                    "baseline into pinned host memory (needs CUDA)")
    if args.size_mib is None:
        args.size_mib = DEFAULT_CUDA_MIB if args.cuda else DEFAULT_MIB
    if args.repeat < MIN_REPEAT:
        p.error(f"--repeat must be at least {MIN_REPEAT}")
    if args.warmup < 0:
        p.error("--warmup must be 0 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    """Set up, run the first saves, warm-up and timed rounds, verify, report."""
    args = parse_args(argv)
    log = progress_log(args.quiet)

    t_start = time.perf_counter()
    executor = (AsyncCheckpointerType.PROCESS if args.executor == "process"
                else AsyncCheckpointerType.THREAD)
    if args.executor == "process":
        init_single_rank_group()
    sd, dst = build_state(args)
    payload = nbytes_of(sd)
    parent, why = pick_dir(args, payload)
    staging = staging_plugin(args) or "cpu"
    res = Results()
    try:
        with scratch("tierstore-staging-", parent) as base:
            log(f"benchmark dir {base} ({fs_type(base)}; {why}), executor {args.executor}, "
                f"tierstore staging '{staging}'")
            timer = StagedEvents()
            with open_store(os.path.join(base, "tierstore"), args, timer) as store:
                stock_dir = os.path.join(base, "stock")
                os.makedirs(stock_dir)
                env = Env(args, sd, dst, store, timer, stock_dir, executor, payload)
                first_saves(env, res, log)
                warmup_then_rounds(args, log, Results,
                                   lambda rnd, _warm, r, lg: run_round(rnd, env, r, lg), res)
                check = verify(env)
            log(f"correctness: {check['checked'][0]} and {check['checked'][1]} load back equal")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

    summary = summarize(res, payload, check)
    print_report(summary, args, base, why, staging)
    config = {"size_mib": args.size_mib, "tensors": args.tensors, "repeat": args.repeat,
              "warmup": args.warmup, "bytes": payload, "dir": parent, "dir_reason": why,
              "fs_type": fs_type(parent), "executor": args.executor, "cuda": args.cuda,
              "tierstore_staging": staging, "keep": KEEP, "io_threads": args.io_threads}
    return finish_report(args, config, summary, t_start)


if __name__ == "__main__":
    sys.exit(main())
