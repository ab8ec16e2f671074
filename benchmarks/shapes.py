"""Shape sweep: tierstore's per-tensor costs against stock DCP, per state-dict shape, in one run.

What is measured
----------------
The same operations as save_load.py and staging.py, on state dicts of one size but different
shapes, so what a tensor costs (planning, metadata, one write and one read per item) shows apart
from what a byte costs. Shapes (``--shapes`` picks some, by name; fp32 random data):

===============  ================================================================================
``16384x4k``     16,384 tensors of 4 KiB (64 MiB), flat keys ``layer<i>.weight``
``2048x32k``     2,048 x 32 KiB (64 MiB)
``256x256k``     256 x 256 KiB (64 MiB)
``64x16m``       64 x 16 MiB (1 GiB; ``--skip-large`` leaves it out)
``transformer``  ``get_state_dict(model, optim)`` -> ``{"model": ..., "optim": ...}`` of a small
                 language model (embedding of 8,192 x 224, tied to the output; 32 blocks of
                 LayerNorm, q/k/v/o ``Linear`` with bias, LayerNorm, MLP up 224 -> 896 / down
                 with bias; a final LayerNorm) after one ``torch.optim.Adam`` step: 2,060 tensors
                 (515 weights, ``exp_avg``, ``exp_avg_sq``, ``step``), 243 MiB, plus the
                 12 ``param_groups`` values DCP saves as bytes (2,072 items)
``fsdp2``        the same model with 16 blocks under FSDP2 (``fully_shard`` per block and the
                 root) on 2 ranks, gloo, CPU: each rank's local shards (1,036 tensors, 66 MiB
                 per rank). Run as a separate ``torchrun --standalone --nproc-per-node=2`` of this
                 script, started by it; its row is folded into the same report
===============  ================================================================================

Per shape, every round runs these operations (round-robin, the first one rotating per round),
each timed alone: ``gc.collect()`` and ``os.sync()`` first, earlier outputs deleted untimed:

* ``copy``: ``for k: dst[k].copy_(src[k])`` over the state dict's tensors (nested dicts flattened,
  DTensors as their local shard) into destinations allocated and touched beforehand.
  A shape whose copy takes under 50 ms (the quickest of three before the warm-up, slowest
  rank) runs the copy and both async saves 5 times per round and records their medians: one
  sample of a few milliseconds is at the mercy of the scheduler on a shared machine.
* async saves, ``dcp.async_save``: ``tierstore`` through ``store.writer()`` of one store used for
  the whole run (one ``local`` tier, ``keep = 2``, default ``cpu`` staging: buffers allocated once
  per layout, in the warm-up), and ``stock``: ``FileSystemWriter`` into a fresh directory with
  DCP's default stager. The **stall** is from the call until it returns (plus
  ``staging_completion.result()`` when it returns an ``AsyncSaveResponse``); then the upload is
  waited for, untimed. **stage** is the ``seconds`` of tierstore's ``staged`` event (its staging
  plugin's copy), and *DCP's pre-stage work* is tierstore's stall minus stage.
* sync saves, ``dcp.save``: ``tierstore`` (a fresh store with one ``local`` tier, default options,
  fsync on), stock ``FileSystemWriter`` with ``thread_count`` 1 and 4, each into a fresh
  directory; and ``raw-write``: the tensors' bytes written with ``os.write`` into one file +
  ``fsync``. Per-item overhead = (sync save s - raw write s) / items, in microseconds, for
  tierstore and the best stock writer; *items* are the entries DCP saves (tensors plus non-tensor
  values). The raw write is one thread, tierstore writes with several: where tierstore's save
  beats the raw write the overhead comes out negative (the disk was not the limit).

Then the loads of what this round saved: ``tierstore`` (``store.reader()``, which verifies
checksums) against stock ``FileSystemReader`` on the ``thread_count=4`` checkpoint, both from the
page cache (each checkpoint's files read once, untimed, just before), into preallocated
destinations zeroed first and compared afterwards (``torch.equal`` per tensor, ``==`` for the
other values): a wrong load ends the run.

Everything is on a disk filesystem under ``--dir`` (default: the system temp dir; tmpfs is
refused, fsync would be free). For ``fsdp2`` every operation runs on both ranks from a barrier and
its figure is the slower rank's (``all_reduce`` MAX); its sizes and items are per rank.

The report has one row per shape (medians), a row of secondary figures per shape, and the
verdicts, ratios of medians with the per-round ratios beside them (same round, same machine
state: the noise indicator on this shared 2-core machine):

* sync save >= 1.0x the best stock FileSystemWriter (>= 1.5x for ``16384x4k``)
* load >= 1.5x stock FileSystemReader
* stage <= 1.5x copy
* tierstore async stall <= stock stall

How to run
----------
From the repository root::

    .venv/bin/python benchmarks/shapes.py --dir /var/tmp   # every shape, 1 warm-up + 5 rounds
    .venv/bin/python benchmarks/shapes.py --skip-large --shapes 16384x4k,transformer
    .venv/bin/python benchmarks/shapes.py --repeat 9 --json /tmp/shapes.json

Progress lines go to stderr, the report to stdout. ``--strict`` makes the exit status 1 when a
target is missed; a crash of the ``fsdp2`` part makes it 1 whatever the targets. Temp directories
are removed at the end, also after an error.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

import tierstore

from harness import (GB, Clock, StagedEvents, barrier, benchmark_parser, blank_like, disk_parent,
                     finish_rank, finish_report, flat_tensors, fs_type, leaves, make_state_dict,
                     max_over_ranks, mismatched_keys, parse_rounds, print_table, print_verdicts,
                     progress_log, quiesce, ratios, remove, rotated, run_torchrun, scratch,
                     shared_temp_dir, temp_file, torchrun_main, verdict, warm_page_cache,
                     warmup_then_rounds, worker_env, write_raw)

#: the timed operations of a round, in the order the first round runs them
OPS = ("copy", "async-tierstore", "async-stock", "save-tierstore", "save-stock-t1",
       "save-stock-t4", "raw-write")
LOADS = ("load-tierstore", "load-stock")
STOCK_SAVES = ("save-stock-t1", "save-stock-t4")
STOCK_LOAD_SOURCE = "save-stock-t4"
#: what a round records, per round: seconds of each operation; stage: the staged event's seconds;
#: stage-fresh: 1 when that save allocated its staging buffers (on any rank), else 0
SERIES = ("copy", "stage", "stage-fresh", "stall-tierstore", "stall-stock", "save-tierstore",
          "save-stock-t1", "save-stock-t4", "raw-write", "load-tierstore", "load-stock")
CID = "step-1"
KEEP = 2
FSDP2_RANKS = 2
DIR_ENV = "TIERSTORE_BENCH_SHAPES_DIR"        # set by the launcher: the fsdp2 part's temp dir
RESULT_ENV = "TIERSTORE_BENCH_SHAPES_RESULT"  # set by the launcher: where rank 0 leaves its rows

# Acceptance targets.
SAVE_TARGET = 1.0        # tierstore sync save over the best stock writer (speed), at least
SAVE_TARGET_MANY = 1.5   # the same for the 16,384-tensor shape
LOAD_TARGET = 1.5        # tierstore load over stock FileSystemReader (speed), at least
STAGE_VS_COPY_MAX = 1.5  # stage seconds over copy seconds, at most
STALL_VS_STOCK_MAX = 1.0  # tierstore async stall over stock's, at most

#: a shape whose copy loop takes less than this is timed ``SHORT_SAMPLES`` times per round for
#: the copy and the async saves (each round records their medians): one sample of a few ms is
#: at the mercy of the scheduler on a shared machine (a rank preempted mid-copy doubles it)
SHORT_OP_S = 0.05
SHORT_SAMPLES = 5


# -- shapes --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """One state-dict shape: ``flat`` (``tensors`` tensors totalling ``size_mib``), or a model's
    ``transformer`` state (``layers`` blocks), or that model under ``fsdp2``."""

    name: str
    label: str
    kind: str
    tensors: int = 0
    size_mib: int = 0
    layers: int = 0
    save_target: float = SAVE_TARGET
    large: bool = False


HIDDEN, HEADS, VOCAB = 224, 7, 8192
SHAPES = (
    Shape("16384x4k", "16,384 x 4 KiB", "flat", tensors=16384, size_mib=64,
          save_target=SAVE_TARGET_MANY),
    Shape("2048x32k", "2,048 x 32 KiB", "flat", tensors=2048, size_mib=64),
    Shape("256x256k", "256 x 256 KiB", "flat", tensors=256, size_mib=64),
    Shape("64x16m", "64 x 16 MiB", "flat", tensors=64, size_mib=1024, large=True),
    Shape("transformer", "transformer + Adam", "transformer", layers=32),
    Shape("fsdp2", f"FSDP2, {FSDP2_RANKS} ranks (per rank)", "fsdp2", layers=16),
)
BY_NAME = {s.name: s for s in SHAPES}


class Block(nn.Module):
    """A transformer block: LayerNorm, attention with q/k/v/o Linear (bias), LayerNorm, MLP."""

    def __init__(self, hidden: int, heads: int) -> None:
        """Layers of width ``hidden``, ``heads`` attention heads, an MLP of 4x ``hidden``."""
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-norm causal self-attention, then the MLP, each with a residual."""
        b, s, h = x.shape
        y = self.ln1(x)
        q, k, v = (p(y).view(b, s, self.heads, -1).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    """Embedding (tied to the output), ``layers`` blocks, a final LayerNorm."""

    def __init__(self, layers: int) -> None:
        """``layers`` blocks of width ``HIDDEN`` over a ``VOCAB``-token embedding."""
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(HIDDEN, HEADS) for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits over the vocabulary."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x) @ self.embed.weight.T


def trained_state(layers: int, mesh: Any = None) -> dict:
    """``{"model": ..., "optim": ...}`` from ``get_state_dict`` of a ``TinyLM`` after one Adam step
    (a forward and backward on random tokens); sharded with ``fully_shard`` on ``mesh`` (each
    block, then the root) when one is given."""
    torch.manual_seed(0)  # same on every rank: one logical model
    model = TinyLM(layers)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens = torch.randint(VOCAB, (2, 33), generator=torch.Generator().manual_seed(1 + rank))
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def build_state(shape: Shape, mesh: Any = None) -> Any:
    """The state dict of ``shape`` (the ``fsdp2`` one needs the ranks' ``mesh``)."""
    if shape.kind == "flat":
        return make_state_dict(shape.size_mib, shape.tensors)
    return trained_state(shape.layers, mesh if shape.kind == "fsdp2" else None)


# -- the run -------------------------------------------------------------------------------------

@dataclass
class Env:
    """What every shape's rounds share: options, the temp dir, the async store (one for the
    run) and its observer, this rank, and a counter for fresh names."""

    args: argparse.Namespace
    base: str
    store: "tierstore.Store"
    staged: StagedEvents
    rank: int = 0
    n: int = 0

    def fresh(self, what: str) -> str:
        """A path under the temp dir that nothing has used (the same on every rank)."""
        self.n += 1
        return os.path.join(self.base, f"{self.n:05d}-{what}")

    def on_rank0(self, fn: Callable[[], Any]) -> None:
        """``fn()`` on rank 0 only, then a barrier (for the filesystem's shared paths)."""
        if self.rank == 0:
            fn()
        barrier()

    def settle(self) -> None:
        """Untimed, before each timed operation: collect garbage, write back dirty pages, then
        every rank starts together."""
        quiesce()
        barrier()


def sync_store(root: str, args: argparse.Namespace, plugins: tuple = (),
               keep: int | None = None) -> "tierstore.Store":
    """A store with one ``local`` tier at ``root`` (fsync on, the default; ``keep`` when given;
    ``[store] io_threads`` from ``--io-threads``)."""
    tier: dict = {"name": "disk", "backend": "local", "path": root}
    if keep is not None:
        tier["keep"] = keep
    config: dict = {"tier": [tier]}
    if args.io_threads is not None:
        config["store"] = {"io_threads": args.io_threads}
    return tierstore.open(config, plugins=plugins)


def time_async_samples(env: Env, sd: Any, method: str, samples: int) -> list[float]:
    """``samples`` async saves by ``method`` (see :func:`time_async`), each sample's figures
    the slowest rank's; returns their medians (and 1.0 for fresh buffers when any sample
    allocated them)."""
    runs = [max_over_ranks(time_async(env, sd, method)) for _ in range(samples)]
    out = [statistics.median(col) for col in zip(*runs)]
    if method == "tierstore":
        out[2] = max(r[2] for r in runs)
    return out


def time_async(env: Env, sd: Any, method: str) -> list[float]:
    """One ``dcp.async_save`` by ``method`` ("tierstore" or "stock"); returns [stall seconds]
    and for tierstore also the staged event's seconds and 1.0 when it allocated fresh staging
    buffers (0.0 when it reused them). Waits for the upload (untimed) and deletes a stock
    checkpoint before returning."""
    if method == "tierstore":
        env.n += 1
        kwargs = dict(storage_writer=env.store.writer(), checkpoint_id=f"step-{env.n}",
                      process_group=env.store.process_group)
        path = None
    else:
        path = env.fresh("async-stock")
        kwargs = dict(storage_writer=FileSystemWriter(path), checkpoint_id=path)
    env.staged.take()  # forget anything older
    env.settle()
    t0 = time.perf_counter()
    resp = dcp.async_save(sd, **kwargs)
    staging_completion = getattr(resp, "staging_completion", None)
    if staging_completion is not None:  # an AsyncSaveResponse
        staging_completion.result()
    stall = time.perf_counter() - t0
    getattr(resp, "upload_completion", resp).result()
    staged = env.staged.take()
    stage, reused = ((staged.seconds, bool(staged.detail.get("reused"))) if staged is not None
                     else (float("nan"), False))
    barrier()
    if path is not None:
        env.on_rank0(lambda: remove(path))
        return [stall]
    return [stall, stage, 0.0 if reused else 1.0]


def run_round(rnd: int, env: Env, sd: Any, dest: Any, res: dict[str, list[float]],
              log: Callable[[str], None], shape: Shape, samples: int = 1) -> None:
    """One round of ``shape``: every operation of ``OPS`` (rotated order), then both loads;
    the copy and the async saves take the median of ``samples`` runs (see ``SHORT_OP_S``)."""
    src, dst = flat_tensors(sd), flat_tensors(dest)
    pairs = [(dst[k], t) for k, t in src.items()]
    raw = list(src.values())
    outputs: dict[str, str] = {}
    stores: dict[str, tierstore.Store] = {}
    keep = {"save-tierstore", STOCK_LOAD_SOURCE}  # the loads' sources stay until the loads

    def record(op: str, secs: list[float], note: str = "") -> None:
        keys = {"async-tierstore": ("stall-tierstore", "stage", "stage-fresh"),
                "async-stock": ("stall-stock",)}.get(op, (op,))
        secs = max_over_ranks(secs)
        for key, s in zip(keys, secs):
            res[key].append(s)
        extra = (f"  stage {secs[1]:.3f} s{' (fresh buffers)' if secs[2] else ''}"
                 if op == "async-tierstore" else "")
        if samples > 1 and (op == "copy" or op.startswith("async-")):
            extra += f"  (median of {samples})"
        log(f"  {shape.name} round {rnd + 1} {op:<16} {secs[0]:8.3f} s{extra}{note}")

    try:
        for op in rotated(OPS, rnd):
            for other, path in list(outputs.items()):
                if other not in keep:
                    env.on_rank0(lambda p=path: remove(p))
                    del outputs[other]
            if op == "copy":
                runs = [time_copy(env, pairs) for _ in range(samples)]
                secs = statistics.median(max_over_ranks([r[0]])[0] for r in runs)
                record(op, [secs], f"  cpu {max(r[1] for r in runs):.3f} s  "
                                   f"faults {max(r[2] for r in runs)}")
            elif op.startswith("async-"):
                record(op, time_async_samples(env, sd, op[len("async-"):], samples))
            else:
                out = outputs[op] = env.fresh(op)
                if op == "save-tierstore":
                    store = stores[op] = sync_store(out, env.args)  # untimed
                    save = lambda: dcp.save(sd, storage_writer=store.writer(),  # noqa: E731
                                            checkpoint_id=CID, process_group=store.process_group)
                elif op == "raw-write":
                    env.on_rank0(lambda: os.makedirs(out))
                    save = lambda: write_raw(  # noqa: E731
                        os.path.join(out, f"raw-{env.rank}.bin"), raw)
                else:
                    threads = int(op[-1])
                    save = lambda: dcp.save(  # noqa: E731
                        sd, storage_writer=FileSystemWriter(out, thread_count=threads))
                env.settle()
                t0 = time.perf_counter()
                save()
                record(op, [time.perf_counter() - t0])

        for op in rotated(LOADS, rnd):
            for t in dst.values():
                t.zero_()  # a load that writes nothing must fail the check
            source = outputs["save-tierstore" if op == "load-tierstore" else STOCK_LOAD_SOURCE]
            env.on_rank0(lambda s=source: warm_page_cache(s))
            env.settle()
            t0 = time.perf_counter()
            if op == "load-tierstore":
                store = stores["save-tierstore"]
                dcp.load(dest, storage_reader=store.reader(), checkpoint_id=CID,
                         process_group=store.process_group)
            else:
                dcp.load(dest, storage_reader=FileSystemReader(source))
            secs = time.perf_counter() - t0
            bad = mismatched_keys(dest, sd)
            if max_over_ranks([float(len(bad))])[0] > 0:
                raise SystemExit(f"{op} of shape {shape.name} returned wrong data (rank "
                                 f"{env.rank}: {len(bad)} entries differ, first "
                                 f"{bad[:3]})")
            record(op, [secs])
    finally:
        for store in stores.values():
            store.close()
        barrier()
        for path in outputs.values():
            env.on_rank0(lambda p=path: remove(p))


def time_copy(env: Env, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float,
                                                                                  int]:
    """One copy loop over ``pairs`` (destination, source), after ``env.settle()``: its wall
    seconds, CPU seconds and minor page faults."""
    env.settle()
    with Clock() as clock:
        for d, s in pairs:
            d.copy_(s)
    return clock.seconds, clock.cpu, clock.faults


def describe(sd: Any) -> dict:
    """This rank's tensor count, items (entries DCP saves: tensors + other values) and tensor
    bytes of a state dict."""
    flat = flat_tensors(sd)
    return {"tensors": len(flat), "items": sum(1 for _ in leaves(sd)),
            "bytes": sum(t.nbytes for t in flat.values())}


def run_shape(env: Env, shape: Shape, log: Callable[[str], None], mesh: Any = None) -> dict:
    """Build ``shape``'s state dict and load destination, run the warm-up and timed rounds;
    returns ``{"meta": describe(...), "rounds": {series: per-round seconds}}``."""
    sd = build_state(shape, mesh)
    dest = blank_like(sd)  # zeroed: every page touched outside the timed region
    meta = describe(sd)
    dst = flat_tensors(dest)
    pairs = [(dst[k], t) for k, t in flat_tensors(sd).items()]
    # Every rank decides alike (the slowest rank's quickest of three), so that all ranks run
    # the same number of collectives.
    quick = max_over_ranks([min(time_copy(env, pairs)[0] for _ in range(3))])[0]
    samples = SHORT_SAMPLES if quick < SHORT_OP_S else 1
    log(f"{shape.name}: {meta['tensors']} tensors, {meta['items']} items, "
        f"{meta['bytes'] / (1 << 20):.1f} MiB; copy {quick:.3f} s: "
        f"{samples} sample(s) of the copy and the async saves per round")
    res = warmup_then_rounds(env.args, log, lambda: {s: [] for s in SERIES},
                             lambda rnd, _warm, r, lg: run_round(rnd, env, sd, dest, r, lg,
                                                                 shape, samples))
    return {"meta": meta, "rounds": res}


# -- figures and the report ----------------------------------------------------------------------

def summarize_shape(shape: Shape, found: dict) -> tuple[dict, list[dict]]:
    """Medians, ratios, per-item overheads and the verdicts of one shape's rounds."""
    r, meta = found["rounds"], found["meta"]
    med = {k: statistics.median(v) for k, v in r.items()}
    best = min(STOCK_SAVES, key=lambda c: med[c])
    items = meta["items"]

    def per_round(a: str, b: str) -> list[float]:
        return ratios(r[a], r[b])

    fig = {
        "label": shape.label, **meta, "medians_s": med, "rounds_s": r,
        "best_stock_writer": best,
        "stage_over_copy": med["stage"] / med["copy"],
        "stall_ratio": med["stall-tierstore"] / med["stall-stock"],
        "dcp_pre_stage_s": med["stall-tierstore"] - med["stage"],
        "save_ratio": med[best] / med["save-tierstore"],
        "load_ratio": med["load-stock"] / med["load-tierstore"],
        "per_item_us": {
            "tierstore": (med["save-tierstore"] - med["raw-write"]) / items * 1e6,
            "stock": (med[best] - med["raw-write"]) / items * 1e6},
    }
    n = shape.name
    verdicts = [
        verdict(f"{n}: tierstore sync save >= {shape.save_target}x best stock FileSystemWriter "
                f"({best[len('save-'):]})", fig["save_ratio"], per_round(best, "save-tierstore"),
                least=shape.save_target),
        verdict(f"{n}: tierstore load >= {LOAD_TARGET}x stock FileSystemReader",
                fig["load_ratio"], per_round("load-stock", "load-tierstore"), least=LOAD_TARGET),
        verdict(f"{n}: stage <= {STAGE_VS_COPY_MAX}x copy", fig["stage_over_copy"],
                per_round("stage", "copy"), most=STAGE_VS_COPY_MAX),
        verdict(f"{n}: tierstore async stall <= {STALL_VS_STOCK_MAX}x stock stall",
                fig["stall_ratio"], per_round("stall-tierstore", "stall-stock"),
                most=STALL_VS_STOCK_MAX),
    ]
    return fig, verdicts


def summarize(found: dict[str, dict], failed: dict[str, str]) -> dict:
    """Every shape's figures and verdicts as a JSON-able dict (shapes that crashed: in
    ``failed``, with a failing verdict so ``--strict`` sees them)."""
    shapes, verdicts = {}, []
    for name, f in found.items():
        shapes[name], v = summarize_shape(BY_NAME[name], f)
        verdicts += v
    for name, why in failed.items():
        verdicts.append({"target": f"{name}: ran to the end ({why})", "ratio": 0.0,
                         "min": 1.0, "per_round": [], "pass": False})
    return {"shapes": shapes, "failed": failed, "verdicts": verdicts}


def print_report(summary: dict, args: argparse.Namespace, base: str) -> None:
    """The two tables, notes and verdict lines on stdout."""
    print()
    print(f"Shape sweep, {args.repeat} rounds after {args.warmup} warm-up; dir {base} "
          f"({fs_type(os.path.dirname(base))}); {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, tierstore {tierstore.__version__}, io_threads="
          f"{args.io_threads or 'default'}")
    print("Medians. stage: tierstore's staged event (its staging copy); stall: dcp.async_save "
          "until it returns; pre-stage: tierstore stall - stage. Sync saves into fresh dirs, "
          "fsync on; best stock: the faster FileSystemWriter (t1/t4) by median; save and load "
          "ratios: stock s / tierstore s (above 1: tierstore faster). Loads from the page cache, "
          "checked. Per-item: (sync save - raw write) / items. fsdp2: per rank, slowest rank's "
          "time.")
    print()
    rows = []
    for name, f in summary["shapes"].items():
        m = f["medians_s"]
        best = f["best_stock_writer"]
        rows.append([f["label"], f"{f['items']:,}", f"{f['bytes'] / (1 << 20):.0f}",
                     f"{m['copy']:.3f}", f"{f['stage_over_copy']:.2f}x",
                     f"{m['stall-tierstore']:.3f} / {m['stall-stock']:.3f}",
                     f"{f['dcp_pre_stage_s']:.3f}",
                     f"{m['save-tierstore']:.3f} / {m[best]:.3f} {best[len('save-stock-'):]} "
                     f"({f['save_ratio']:.2f}x)",
                     f"{m['load-tierstore']:.3f} / {m['load-stock']:.3f} "
                     f"({f['load_ratio']:.2f}x)",
                     f"{f['per_item_us']['tierstore']:.0f} / {f['per_item_us']['stock']:.0f}"])
    print_table(["shape", "items:", "MiB:", "copy s:", "stage/copy:",
                 "stall s tierstore / stock:", "pre-stage s:",
                 "sync save s tierstore / best stock:", "load s tierstore / stock:",
                 "per-item us tierstore / stock:"], rows)
    print()
    rows = []
    for name, f in summary["shapes"].items():
        m, r = f["medians_s"], f["rounds_s"]
        stalls = " ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(r["stall-tierstore"],
                                                                r["stall-stock"]))
        rows.append([name, f"{f['tensors']:,}", f"{m['stage']:.3f}",
                     f"{sum(x > 0 for x in r['stage-fresh'])} of {len(r['stage-fresh'])}",
                     f"{m['raw-write']:.3f} ({f['bytes'] / m['raw-write'] / GB:.2f})",
                     f"{m['save-stock-t1']:.3f}", f"{m['save-stock-t4']:.3f}",
                     f"{f['bytes'] / m['save-tierstore'] / GB:.2f}", stalls])
    print_table(["shape", "tensors:", "stage s:", "stages with fresh buffers:",
                 "raw write s (GB/s):", "stock t1 s:", "stock t4 s:", "tierstore save GB/s:",
                 "stalls per round tierstore / stock (s)"], rows)
    for name, why in summary["failed"].items():
        print(f"\n{name}: no figures: {why}")
    print()
    print_verdicts(summary["verdicts"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The shared options (``--size-mib`` and ``--tensors`` hidden: the shapes fix them) plus
    ``--shapes`` and ``--skip-large``."""
    p = benchmark_parser(__doc__, 5, "lazy imports, staging buffers, allocator and page-cache "
                         "growth", "parent of the temp directory (default: system temp dir); "
                         "not tmpfs")
    for action in p._actions:
        if action.dest in ("size_mib", "tensors"):
            action.help = argparse.SUPPRESS
    p.add_argument("--shapes", default=",".join(s.name for s in SHAPES),
                   help=f"comma-separated shapes to run, of {', '.join(BY_NAME)} (default: all)")
    p.add_argument("--skip-large", action="store_true",
                   help="leave out the 1 GiB shape (64x16m) even when --shapes names it")
    args = parse_rounds(p, argv)
    names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        p.error(f"--shapes: unknown {unknown}; choose from {', '.join(BY_NAME)}")
    args.selected = [s for s in SHAPES
                     if s.name in names and not (args.skip_large and s.large)]
    if not args.selected:
        p.error("no shape left to run")
    return args


def run_in_process(args: argparse.Namespace, base: str, log: Callable[[str], None],
                   shapes: list[Shape], rank: int = 0, mesh: Any = None) -> dict[str, dict]:
    """Run ``shapes`` here (on every rank under torchrun), with one async store for all of
    them; returns each shape's ``run_shape`` result."""
    os.makedirs(base, exist_ok=True)
    staged = StagedEvents()
    store = sync_store(os.path.join(base, "async-store"), args, plugins=(staged,), keep=KEEP)
    env = Env(args, base, store, staged, rank)
    found = {}
    try:
        for shape in shapes:
            found[shape.name] = run_shape(env, shape, log, mesh)
            gc.collect()
    finally:
        store.close()
    return found


def launch_fsdp2(args: argparse.Namespace, argv: list[str], base: str) -> dict:
    """The ``fsdp2`` shape: this script under ``torchrun --standalone --nproc-per-node=2`` with
    the same arguments; returns rank 0's result (raises RuntimeError when torchrun failed or
    left none)."""
    with temp_file("tierstore-shapes-fsdp2-") as result:
        rc = run_torchrun([os.path.abspath(__file__), *argv], FSDP2_RANKS,
                          env=worker_env(**{DIR_ENV: base, RESULT_ENV: result}))
        with open(result) as f:
            text = f.read()
    if rc != 0 or not text:
        raise RuntimeError(f"torchrun exit status {rc}" + ("" if text else ", no result"))
    return json.loads(text)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Not under torchrun: run the selected one-process shapes here, then ``fsdp2`` under
    torchrun; one report."""
    parent, kind = disk_parent(args, "the save figures would mean nothing")
    log = progress_log(args.quiet)
    t_start = time.perf_counter()
    found: dict[str, dict] = {}
    failed: dict[str, str] = {}
    with scratch("tierstore-shapes-", parent) as base:
        log(f"benchmark dir {base} ({kind})")
        here = [s for s in args.selected if s.kind != "fsdp2"]
        if here:
            found.update(run_in_process(args, os.path.join(base, "local"), log, here))
        if any(s.kind == "fsdp2" for s in args.selected):
            log(f"fsdp2: starting torchrun --nproc-per-node={FSDP2_RANKS}")
            fsdp2_dir = os.path.join(base, "fsdp2")
            os.makedirs(fsdp2_dir)
            try:
                found["fsdp2"] = launch_fsdp2(args, argv, fsdp2_dir)
            except RuntimeError as e:
                failed["fsdp2"] = str(e)

    summary = summarize(found, failed)
    print_report(summary, args, base)
    config = {"shapes": [s.name for s in args.selected], "repeat": args.repeat,
              "warmup": args.warmup, "dir": parent, "fs_type": kind,
              "io_threads": args.io_threads, "load_from": "page cache (warmed untimed)",
              "stock_load_source": STOCK_LOAD_SOURCE, "fsdp2_ranks": FSDP2_RANKS}
    status = finish_report(args, config, summary, t_start)
    return 1 if failed else status


def worker(args: argparse.Namespace) -> int:
    """One rank of the ``fsdp2`` shape. Started by ``launch``: rank 0 leaves its result in the
    file ``RESULT_ENV`` names. Started by hand under torchrun: rank 0 prints its own report."""
    from torch.distributed.device_mesh import init_device_mesh

    t_start = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = progress_log(args.quiet or rank != 0)
    mesh = init_device_mesh("cpu", (world,))
    base = os.environ.get(DIR_ENV)
    own_base = base is None
    status = 0
    try:
        if own_base:
            parent, _kind = disk_parent(args, "the save figures would mean nothing")
            base = shared_temp_dir("tierstore-shapes-", parent)
        found = run_in_process(args, base, log, [BY_NAME["fsdp2"]], rank, mesh)
        if rank == 0:
            if not own_base:
                with open(os.environ[RESULT_ENV], "w") as f:
                    json.dump(dict(found["fsdp2"], ranks=world), f)
            else:
                summary = summarize(found, {})
                print_report(summary, args, base)
                config = {"shapes": ["fsdp2"], "repeat": args.repeat, "warmup": args.warmup,
                          "dir": os.path.dirname(base), "io_threads": args.io_threads,
                          "fsdp2_ranks": world}
                status = finish_report(args, config, summary, t_start)
        dist.barrier()
    finally:
        if own_base and rank == 0 and base is not None:
            shutil.rmtree(base, ignore_errors=True)
    return finish_rank(rank, status)


def main(argv: list[str] | None = None) -> int:
    """Under torchrun: one rank of the ``fsdp2`` shape. Otherwise: the whole sweep."""
    return torchrun_main(argv, parse_args, worker, launch)


if __name__ == "__main__":
    sys.exit(main())
