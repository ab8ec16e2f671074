"""The control plane at scale: what a save, a ``latest()`` and a restart's restore ask of an
object store and of torch.distributed, per rank, at 2 to 16 ranks, and how that grows.

Why
---
At a thousand ranks, whatever each rank asks of a shared object store or sends through
collectives is multiplied by the rank count: S3 answers a storm of LISTs and GETs with 503
SlowDown, and a coordinator that receives O(N) bytes from each of N ranks stalls the job. The
target: per rank, requests and collective bytes do not grow with the rank count beyond what
the rank's own plan reads, and the coordinator's (rank 0's) grow at most linearly. The payload
here is tiny on purpose: every byte and request counted is control plane.

What is measured
----------------
For each rank count of ``--ranks`` (default 2,4,8,16), at each node count of ``--nodes``
that divides it (default ``auto,2``: ``auto`` is 4 ranks a node, at least 1 node, so 1, 1, 2
and 4 nodes; and 2 nodes wherever there are 2 ranks or more: 7 configurations), simulated
nodes: one ``torchrun`` per node, concurrently, on a localhost rendezvous (``--nnodes
--node-rank --master-addr=127.0.0.1``, as tests/helpers.py's ``run_torchrun``), gloo, CPU
only. Tiers, in a fresh temp dir (under /dev/shm when it is there)
and a fresh bucket per configuration (``scale-<ranks>r-<nodes>n``) on a SeaweedFS S3 server the
benchmark starts (``tierstore_simulate.servers.SeaweedS3``):

=========  ====================================================================================
``ram``    ``memory``, path ``<tmp>/ram/{node}``, keep 2: node-local
``s3``     ``fsspec``, url ``s3://scale-<r>r-<n>n/ckpt``: shared, every save drained to it
=========  ====================================================================================

The state is DDP style and tiny: per rank 3 tensors of 256 fp32 of its own (keys carry the
rank), a replicated tensor of 1,024 fp32 (the same on every rank: DCP saves it once) and an
int ``step``. Three torchrun jobs per configuration:

* **save job**: ``tierstore.open``; a first save ``step-1`` (``save-1``, warms up, not in the
  tables); then the measured **save** of ``step-2``: ``dcp.save(..., storage_writer=
  store.writer(), process_group=store.process_group)`` then ``store.wait(all_ranks=True)`` (the
  drain to S3 included); then **latest**: one ``store.latest()`` (checked: ``step-2``); then
  ``store.close()``.
* **restore job**, a restarted job: a fresh ``tierstore.open`` + ``latest()`` + ``dcp.load``
  through ``store.reader()`` into zeroed tensors, checked bit for bit (**restore**: the three
  together; the JSON has them apart as ``restore.open``, ``restore.latest``, ``restore.load``).
  The node-local RAM is intact (the job came back on the same nodes).
* **restore-s3** job (``--no-s3-restore`` skips it): the same restore after every node's RAM
  directory was deleted: the checkpoint comes from S3, as after a restart on new nodes.

Phases are separated by barriers on the default group, made with the unwrapped functions and
not counted. Per phase:

* **S3 requests, at the server**: ``SeaweedS3.request_counts(bucket)`` (the gateway's own
  Prometheus counters, by type: GET (HEAD included), PUT, LIST, DELETE), read by rank 0 before
  and after the phase (between barriers, after a 0.3 s settle) and subtracted.
* **S3 requests, per rank**: every S3 operation this rank's clients made (aiobotocore's
  ``_make_api_call``, by operation name): the server counts the total, this says who asked.
* **collectives, per rank**: ``torch.distributed``'s ``all_gather_object``,
  ``broadcast_object_list``, ``gather_object``, ``scatter_object_list``, ``all_gather``,
  ``all_gather_into_tensor``, ``all_reduce``, ``reduce``, ``broadcast``, ``barrier``,
  ``monitored_barrier``, ``gather``, ``scatter``, ``reduce_scatter(_tensor)``,
  ``all_to_all(_single)``, ``send``/``recv``, ``isend``/``irecv`` are wrapped in every worker
  before the store is opened (tierstore's ``transport/collectives.py`` and ``transfer.py`` and
  DCP's ``_DistWrapper`` call them as ``dist.<name>`` at call time, so every call goes through
  the wrappers; a call inside one of them, such as the ``all_gather`` inside
  ``all_gather_object``, is not counted again). Bytes are the payload, as the rank sees it:
  *sent* is what it contributes (a tensor's ``nbytes``, an object's pickled size: what torch
  serializes), *recv* what it gets from the other ranks (the other ranks' entries of a gather,
  a broadcast's object on a non-source rank; an ``all_reduce`` counts its tensor both ways).
  *Received, padded* is the same with torch's padding: ``all_gather_object`` (and
  ``gather_object`` on its destination) pads every rank's pickled object to the largest one,
  so a rank receives (world - 1) x the largest object. Not modelled: gloo's algorithms (ring,
  tree). Each call is also filed under its call site (``tierstore:<module>.<function>``, the
  first frame in tierstore outside ``transport/collectives.py``, or ``dcp:<function>`` of
  DCP's ``utils.py``) in the JSON, and the largest sites are printed; each S3 operation under
  the tierstore functions whose blocking s3fs call made it.
* **job key-value store operations, per rank**: tierstore leaves posts in the job's store
  (``transport/collectives.py``: ``post``/``read_post``/``drop_posts`` through
  ``dist.distributed_c10d._get_default_store()``, and its roll call after a failed
  collective); that function is wrapped so that tierstore's callers get a counting proxy
  (``set``/``get``/``check``/``wait``/``add``/``delete_key``/... with bytes) and torch's own
  callers the real store.
* seconds, the slowest rank's.

Reported per phase: the server's counts, and per rank the max and mean over the ranks other
than rank 0 (DCP's coordinator, which is also tierstore's leader) and rank 0 apart. Then every
quantity is fitted against the rank count N over two series of configurations, one per rank
count: ``4 ranks a node`` (the ``auto`` ones: nodes grow with the job, as at scale; its first
two points are one node, so what only a multi-node job does steps up between N = 4 and 8)
and ``<n> nodes``, the node count run at the most rank counts (at least 3; 2 by default: the
nodes fixed, the ranks a node growing). Least squares, for a constant, ``a + b log2 N`` and
``a + b N``; the simplest model within 5 % (relative RMS error, or within
0.5 of a count) of the best is chosen (marked a poor fit when it misses the points by more than
15 % RMS), and projected to 1,024 and 8,192 ranks.

How to run
----------
From the repository root::

    .venv/bin/python benchmarks/scale.py                     # 7 configurations (~7-9 min, 2 cores)
    .venv/bin/python benchmarks/scale.py --ranks 2,4,8,16 --json out.json --markdown
    .venv/bin/python benchmarks/scale.py --ranks 4,8 --nodes 1,2,4 --no-s3-restore
    .venv/bin/python benchmarks/scale.py --report out.json --markdown   # print again, run nothing

The tables, models and projections are printed as markdown; ``--markdown`` adds where the
figures of the largest configuration come from (collectives by call site, S3 operations by the
tierstore function that made them), as the section of docs/performance.md has them. Progress
lines go to stderr, the report to stdout. A configuration that fails (a torchrun exits
non-zero, or ``--timeout``, default 420 s a job, passes) is reported (with the end of its
ranks' output on stderr), the others still run, and the exit status is 1. 16 ranks on 2 cores
are slow (~35 s a job, most of it importing torch): the rendezvous and collective timeouts are
generous (``--rdzv-timeout``, default 600 s).
"""

from __future__ import annotations

import argparse
import contextvars
import datetime
import inspect
import json
import math
import os
import pickle
import platform
import shutil
import sys
import threading
import time
import types
from typing import Any, Callable

from harness import (counts_delta, markdown_table, parser, progress_log, run_nodes, scratch,
                     seaweed, shm_or_tmp, write_json)


PER_NODE_AUTO = 4                  # --nodes auto: ranks per node
OWN_TENSORS, OWN_NUMEL, REPLICATED_NUMEL = 3, 256, 1024
SAVE_JOB_PHASES = ("open", "save-1", "save", "latest", "close")
RESTORE_SUBPHASES = ("open", "latest", "load")
#: the phases of the tables, in order
TABLE_PHASES = ("save", "latest", "restore", "restore-s3")
PROJECT_TO = (1024, 8192)
SETTLE_S = 0.3                     # before reading the server's counters after a phase

# -------------------------------------------------------------------------------------------
# worker side: counting wrappers
# -------------------------------------------------------------------------------------------

_lock = threading.Lock()
_phase = "setup"
#: phase -> {"coll": {fn: [calls, sent, recv]}, "sites": {site: [calls, sent, recv]},
#:           "kv": {op: [calls, bytes]}, "s3": {op: calls}, "seconds": s}
_counts: dict[str, dict] = {}
_orig: dict[str, Callable] = {}

OBJECT_FNS = ("all_gather_object", "broadcast_object_list", "gather_object",
              "scatter_object_list")
TENSOR_FNS = ("all_gather", "all_gather_into_tensor", "all_reduce", "reduce", "broadcast",
              "barrier", "monitored_barrier", "gather", "scatter", "reduce_scatter",
              "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
              "isend", "irecv")
KV_OPS = ("set", "get", "check", "wait", "add", "delete_key", "compare_set", "multi_get",
          "multi_set", "append", "num_keys")


def _bucket(phase: str) -> dict:
    b = _counts.get(phase)
    if b is None:
        b = _counts[phase] = {"coll": {}, "sites": {}, "kv": {}, "s3": {}, "s3_sites": {},
                              "seconds": 0.0}
    return b


def _pickled(obj: Any) -> int:
    try:
        return len(pickle.dumps(obj))
    except Exception:  # noqa: BLE001 - an estimate; torch would have failed too
        return 0


def _nbytes(t: Any) -> int:
    if hasattr(t, "nbytes"):
        return int(t.nbytes)
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


_s3_site: contextvars.ContextVar[str] = contextvars.ContextVar("s3_site", default="?")


#: tierstore modules that only pass a call on (retries, thread pools): skipped when naming who
#: made an S3 call
_PASS_ON = ("retry", "jobs", "pool", "threads")


def _tierstore_site(f) -> str:
    """Who made an S3 call: ``<module>.<function>`` of the first two frames in tierstore/ from
    ``f`` outwards that do more than pass it on (innermost first), then ``> <function>`` of the
    first frame in plugins/ (the backend's primitive)."""
    engine: list[str] = []
    backend = None
    while f is not None and len(engine) < 2:
        fn = f.f_code.co_filename.replace(os.sep, "/")
        name = f.f_code.co_name
        if "/site-packages/" not in fn and not name.startswith("<"):
            stem = fn.rsplit("/", 1)[-1].removesuffix(".py")
            if "/tierstore/" in fn and stem not in _PASS_ON:
                engine.append(f"{stem}.{name}")
            elif "/plugins/" in fn and backend is None:
                backend = name
        f = f.f_back
    return f"{' < '.join(engine) or '?'}{' > ' + backend if backend else ''}"


def _call_site() -> str:
    """Who made the collective: ``dcp:<fn>`` (DCP's utils.py), ``tierstore:<module>.<fn>``
    (first tierstore or plugins frame outside transport/collectives.py), else ``other:...``."""
    f = sys._getframe(2)
    first = None
    while f is not None:
        fn = f.f_code.co_filename.replace(os.sep, "/")
        if fn.endswith("/torch/distributed/checkpoint/utils.py"):
            return f"dcp:{f.f_code.co_name}"
        if ("/tierstore/" in fn or "/plugins/" in fn) and not fn.endswith(
                "/tierstore/transport/collectives.py") and "/torch/" not in fn:
            stem = fn.rsplit("/", 1)[-1].removesuffix(".py")
            return f"tierstore:{stem}.{f.f_code.co_name}"
        if first is None and "/torch/distributed/" not in fn and fn != __file__ \
                and not fn.endswith("/tierstore/transport/collectives.py"):
            first = f"other:{fn.rsplit('/', 1)[-1]}:{f.f_code.co_name}"
        f = f.f_back
    return first or "other:?"


def _group_rank(dist, group) -> int:
    return dist.get_rank(group) if group is not None else dist.get_rank()


def _src_in_group(dist, group, bound: dict, src_key: str, group_key: str) -> int:
    if bound.get(group_key) is not None:
        return bound[group_key]
    src = bound.get(src_key) or 0
    if group is None:
        return src
    try:
        return dist.get_group_rank(group, src)
    except Exception:  # noqa: BLE001
        return src


def _estimate(dist, name: str, b: dict, before: bool, state: dict) -> tuple[int, int]:
    """Sent and received payload bytes of one call (``before``: the part known before it runs,
    kept in ``state``; after it: the rest)."""
    group = b.get("group")
    if before:
        if name in ("isend", "send"):
            return _nbytes(b.get("tensor")), 0
        if name in ("irecv", "recv"):
            return 0, _nbytes(b.get("tensor"))
        if name == "all_gather_object":
            return _pickled(b.get("obj")), 0
        if name == "gather_object":
            me = _group_rank(dist, group)
            dst = _src_in_group(dist, group, b, "dst", "group_dst")
            state["dst"] = me == dst
            return (0 if me == dst else _pickled(b.get("obj"))), 0
        if name == "broadcast_object_list":
            me = _group_rank(dist, group)
            src = _src_in_group(dist, group, b, "src", "group_src")
            state["src"] = me == src
            return (_pickled(b.get("object_list")[0]) if len(b.get("object_list") or ()) == 1
                    else sum(_pickled(x) for x in b.get("object_list") or ())) \
                if me == src else 0, 0
        if name == "scatter_object_list":
            me = _group_rank(dist, group)
            src = _src_in_group(dist, group, b, "src", "group_src")
            state["src"] = me == src
            if me == src:
                items = b.get("scatter_object_input_list") or []
                return sum(_pickled(x) for i, x in enumerate(items) if i != me), 0
            return 0, 0
        if name in ("all_gather", "all_gather_into_tensor"):
            return _nbytes(b.get("tensor") if name == "all_gather" else b.get("input_tensor")), 0
        if name in ("all_reduce",):
            n = _nbytes(b.get("tensor"))
            return n, n
        if name in ("broadcast", "scatter"):
            me = _group_rank(dist, group)
            src = _src_in_group(dist, group, b, "src", "group_src")
            state["src"] = me == src
            if name == "broadcast":
                n = _nbytes(b.get("tensor"))
                return (n, 0) if me == src else (0, n)
            if me == src:
                return _nbytes(b.get("scatter_list")) - _nbytes(b.get("tensor")), 0
            return 0, _nbytes(b.get("tensor"))
        if name in ("reduce", "gather"):
            me = _group_rank(dist, group)
            dst = _src_in_group(dist, group, b, "dst", "group_dst")
            n = _nbytes(b.get("tensor"))
            world = dist.get_world_size(group)
            return (0, n * (world - 1)) if me == dst else (n, 0)
        if name in ("reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                    "all_to_all_single"):
            key = {"reduce_scatter": "input_list", "reduce_scatter_tensor": "input",
                   "all_to_all": "input_tensor_list", "all_to_all_single": "input"}[name]
            sent = _nbytes(b.get(key))
            world = dist.get_world_size(group)
            return sent * (world - 1) // max(world, 1), sent * (world - 1) // max(world, 1)
        return 0, 0
    # after the call: what came in
    if name == "all_gather_object":
        me = _group_rank(dist, group)
        return 0, sum(_pickled(x) for i, x in enumerate(b.get("object_list") or []) if i != me)
    if name == "gather_object" and state.get("dst"):
        me = _group_rank(dist, group)
        return 0, sum(_pickled(x) for i, x in enumerate(b.get("object_gather_list") or [])
                      if i != me)
    if name == "broadcast_object_list" and not state.get("src"):
        return 0, sum(_pickled(x) for x in b.get("object_list") or ())
    if name == "scatter_object_list" and not state.get("src"):
        return 0, sum(_pickled(x) for x in b.get("scatter_object_output_list") or ())
    if name in ("all_gather", "all_gather_into_tensor"):
        world = dist.get_world_size(group)
        if name == "all_gather":
            me = _group_rank(dist, group)
            return 0, sum(_nbytes(x) for i, x in enumerate(b.get("tensor_list") or [])
                          if i != me)
        return 0, _nbytes(b.get("output_tensor")) * (world - 1) // max(world, 1)
    return 0, 0


def _padded(dist, name: str, b: dict, state: dict) -> int | None:
    """What an ``*_object`` gather really brings in: torch pads every rank's pickled object to
    the largest one's size (``all_gather_object``: on every rank; ``gather_object``: on the
    destination), so a rank receives (world - 1) x the largest. None: as the payload."""
    if name == "all_gather_object":
        sizes = [_pickled(x) for x in b.get("object_list") or []]
    elif name == "gather_object" and state.get("dst"):
        sizes = [_pickled(x) for x in b.get("object_gather_list") or []]
    else:
        return None
    return (len(sizes) - 1) * max(sizes, default=0)


def _wrap(dist, name: str) -> None:
    orig = getattr(dist, name, None)
    if orig is None or name in _orig:
        return
    _orig[name] = orig
    try:
        sig = inspect.signature(orig)
    except (TypeError, ValueError):
        sig = None

    def counted(*args, **kwargs):
        bound: dict = {}
        if sig is not None:
            try:
                ba = sig.bind(*args, **kwargs)
                ba.apply_defaults()
                bound = dict(ba.arguments)
            except TypeError:
                bound = {}
        state: dict = {}
        try:
            s0, r0 = _estimate(dist, name, bound, True, state)
        except Exception:  # noqa: BLE001 - counting must never break the job
            s0 = r0 = 0
        site = _call_site()
        out = orig(*args, **kwargs)
        try:
            s1, r1 = _estimate(dist, name, bound, False, state)
            padded = _padded(dist, name, bound, state)
        except Exception:  # noqa: BLE001
            s1 = r1 = 0
            padded = None
        with _lock:
            b = _bucket(_phase)
            for table, key in ((b["coll"], name), (b["sites"], f"{site} {name}")):
                c = table.setdefault(key, [0, 0, 0, 0])
                c[0] += 1
                c[1] += s0 + s1
                c[2] += r0 + r1
                c[3] += r0 + r1 if padded is None else padded
        return out

    counted.__wrapped__ = orig
    setattr(dist, name, counted)


class _CountingStore:
    """The job's key-value store as tierstore sees it: every operation counted (with the bytes
    of the values set and got) before it is passed on."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, op):
        attr = getattr(self._real, op)
        if op not in KV_OPS or not callable(attr):
            return attr

        def counted(*args, **kwargs):
            out = attr(*args, **kwargs)
            n = 0
            if op in ("set", "append") and len(args) >= 2:
                n = len(args[1])
            elif op == "compare_set" and len(args) >= 3:
                n = len(args[2])
            elif op == "multi_set" and len(args) >= 2:
                n = sum(len(v) for v in args[1])
            elif op == "get":
                n = len(out)
            elif op == "multi_get":
                n = sum(len(v) for v in out)
            with _lock:
                c = _bucket(_phase)["kv"].setdefault(op, [0, 0])
                c[0] += 1
                c[1] += n
            return out

        return counted


def install_counters() -> None:
    """Wrap torch.distributed's collectives, tierstore's way to the job's key-value store and
    aiobotocore's one entry for S3 operations. Before the store is opened."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for name in (*OBJECT_FNS, *TENSOR_FNS):
        _wrap(dist, name)

    real_store = c10d._get_default_store

    def default_store():
        caller = sys._getframe(1).f_code.co_filename.replace(os.sep, "/")
        store = real_store()
        if "/torch/" in caller:
            return store
        return _CountingStore(store)

    c10d._get_default_store = default_store

    # S3: every operation of this process's clients, filed under the tierstore function whose
    # blocking s3fs call made it (fsspec.asyn.sync runs the coroutine on fsspec's loop thread
    # in a copy of the caller's context, so a context variable set around it reaches it)
    import fsspec.asyn
    from aiobotocore.client import AioBaseClient
    made = AioBaseClient._make_api_call
    synced = fsspec.asyn.sync

    def sync(loop, func, *args, **kwargs):
        token = _s3_site.set(_tierstore_site(sys._getframe(1)) + " "
                             + getattr(func, "__name__", "?").lstrip("_"))
        try:
            return synced(loop, func, *args, **kwargs)
        finally:
            _s3_site.reset(token)

    async def counted(self, operation_name, api_params):
        with _lock:
            b = _bucket(_phase)
            b["s3"][operation_name] = b["s3"].get(operation_name, 0) + 1
            key = f"{_s3_site.get()} {operation_name}"
            b["s3_sites"][key] = b["s3_sites"].get(key, 0) + 1
        return await made(self, operation_name, api_params)

    fsspec.asyn.sync = sync
    AioBaseClient._make_api_call = counted


# -------------------------------------------------------------------------------------------
# worker side: the jobs
# -------------------------------------------------------------------------------------------

def state_dict(rank: int, step: int, zero: bool = False) -> dict:
    """DDP style and tiny: this rank's own tensors (keys carry the rank), a replicated tensor
    (the same on every rank) and the step."""
    import torch

    gen = torch.Generator().manual_seed(1000 * step + rank)
    sd: dict[str, Any] = {f"rank{rank}.t{i}": torch.randn(OWN_NUMEL, generator=gen)
                          for i in range(OWN_TENSORS)}
    sd["replicated"] = torch.randn(REPLICATED_NUMEL, generator=torch.Generator().manual_seed(step))
    sd["step"] = step
    if zero:
        sd = {k: (torch.zeros_like(v) if hasattr(v, "shape") else 0) for k, v in sd.items()}
    return sd


def store_config(w: argparse.Namespace) -> dict:
    with open(os.path.join(w.root, "s3-options.json")) as f:
        options = json.load(f)
    return {"store": {"collective_timeout": w.timeout},
            "tier": [{"name": "ram", "backend": "memory", "path": w.root + "/ram/{node}",
                      "keep": 2},
                     {"name": "s3", "backend": "fsspec", "url": f"s3://{w.bucket}/ckpt",
                      "options": options}]}


def worker(w: argparse.Namespace) -> int:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=w.timeout))
    rank = dist.get_rank()
    install_counters()
    import tierstore
    from tierstore_simulate.servers import SeaweedS3

    raw_barrier = _orig["barrier"]
    metrics = types.SimpleNamespace(metrics_port=w.metrics_port)
    server: dict[str, dict[str, int]] = {}
    problems: list[str] = []

    def phase(name: str, run: Callable[[], Any]) -> Any:
        global _phase
        raw_barrier()
        if rank == 0:
            time.sleep(SETTLE_S)
            before = SeaweedS3.request_counts(metrics, w.bucket)
        raw_barrier()
        _phase = name
        _bucket(name)
        t0 = time.perf_counter()
        try:
            return run()
        finally:
            _counts[name]["seconds"] = time.perf_counter() - t0
            # _phase stays: what the phase started in the background and finishes during the
            # barrier below is the phase's, as the server's counts read after it say
            raw_barrier()
            if rank == 0:
                time.sleep(SETTLE_S)
                server[name] = counts_delta(before, SeaweedS3.request_counts(metrics, w.bucket))

    def check(out: dict, step: int, what: str) -> None:
        ref = state_dict(rank, step)
        for k, v in ref.items():
            got = out[k]
            same = torch.equal(got, v) if hasattr(v, "shape") else got == v
            if not same:
                problems.append(f"{what}: {k} differs")

    store: list = [None]
    cfg = store_config(w)
    if w.job == "save":
        store[0] = phase("open", lambda: tierstore.open(cfg))
        for step, name in ((1, "save-1"), (2, "save")):
            def save(step=step):
                dcp.save(state_dict(rank, step), storage_writer=store[0].writer(),
                         checkpoint_id=f"step-{step}", process_group=store[0].process_group)
                store[0].wait(all_ranks=True)
            phase(name, save)
        latest = phase("latest", lambda: store[0].latest())
        if latest != "step-2":
            problems.append(f"latest() is {latest!r}, not 'step-2'")
        phase("close", lambda: store[0].close())
    else:
        prefix = w.job
        store[0] = phase(f"{prefix}.open", lambda: tierstore.open(cfg))
        latest = phase(f"{prefix}.latest", lambda: store[0].latest())
        if latest != "step-2":
            problems.append(f"{prefix}: latest() is {latest!r}, not 'step-2'")
        else:
            out = state_dict(rank, 2, zero=True)
            phase(f"{prefix}.load",
                  lambda: dcp.load(out, storage_reader=store[0].reader(), checkpoint_id=latest,
                                   process_group=store[0].process_group))
            check(out, 2, prefix)
        phase(f"{prefix}.close", lambda: store[0].close())

    doc = {"rank": rank, "node": int(os.environ.get("GROUP_RANK", 0)),
           "world": dist.get_world_size(), "job": w.job, "phases": _counts,
           "server": server if rank == 0 else None, "problems": problems}
    os.makedirs(os.path.join(w.root, "out"), exist_ok=True)
    path = os.path.join(w.root, "out", f"{w.job}-rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)
    raw_barrier()
    dist.destroy_process_group()
    for p in problems:
        print(f"PROBLEM rank {rank}: {p}", file=sys.stderr, flush=True)
    return 1 if problems else 0


# -------------------------------------------------------------------------------------------
# driver side: launching
# -------------------------------------------------------------------------------------------

def run_job(args: argparse.Namespace, job: str, ranks: int, nodes: int, root: str,
            bucket: str, metrics_port: int) -> tuple[list[dict] | None, str]:
    """One torchrun per node running this script's worker for ``job``; every rank's JSON, or
    None and why."""
    run = run_nodes([os.path.abspath(__file__), "--worker", job, "--root", root, "--bucket",
                     bucket, "--metrics-port", str(metrics_port), "--timeout",
                     str(args.rdzv_timeout)], nodes, ranks // nodes, timeout=args.timeout,
                    log_dir=root, label=job,
                    torchrun_args=(f"--rdzv-conf=timeout={args.rdzv_timeout}",))
    why = run.why
    docs = []
    for r in range(ranks):
        path = os.path.join(root, "out", f"{job}-rank{r}.json")
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except (OSError, ValueError):
            why = why or f"rank {r} left no figures"
    if why:
        return None, why + "\n" + run.tail()
    return docs, ""


# -------------------------------------------------------------------------------------------
# driver side: figures
# -------------------------------------------------------------------------------------------

S3_GET = {"GetObject", "HeadObject", "HeadBucket", "GetObjectAttributes"}
S3_LIST = {"ListObjectsV2", "ListObjects", "ListBuckets", "ListMultipartUploads", "ListParts"}
S3_PUT = {"PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload",
          "CopyObject", "UploadPartCopy"}
S3_DELETE = {"DeleteObject", "DeleteObjects", "AbortMultipartUpload"}


def s3_kind(op: str) -> str:
    for kind, ops in (("GET", S3_GET), ("LIST", S3_LIST), ("PUT", S3_PUT),
                      ("DELETE", S3_DELETE)):
        if op in ops:
            return kind
    return op


def merge_phases(doc: dict, names: list[str]) -> dict:
    """One rank's counts of several phases added up (a restore's open + latest + load)."""
    out = {"coll": {}, "sites": {}, "kv": {}, "s3": {}, "s3_sites": {}, "seconds": 0.0}
    for name in names:
        p = doc["phases"].get(name)
        if p is None:
            continue
        for k, v in p.get("s3_sites", {}).items():
            out["s3_sites"][k] = out["s3_sites"].get(k, 0) + v
        for table in ("coll", "sites", "kv"):
            for k, v in p[table].items():
                acc = out[table].setdefault(k, [0] * len(v))
                for i, x in enumerate(v):
                    acc[i] += x
        for k, v in p["s3"].items():
            out["s3"][k] = out["s3"].get(k, 0) + v
        out["seconds"] += p["seconds"]
    return out


def rank_figures(p: dict) -> dict:
    """The figures of one rank's phase: collective calls, bytes sent and received, key-value
    store operations and bytes, S3 requests by kind (client side) and in all."""
    calls = sum(v[0] for v in p["coll"].values())
    sent = sum(v[1] for v in p["coll"].values())
    recv = sum(v[2] for v in p["coll"].values())
    padded = sum(v[3] if len(v) > 3 else v[2] for v in p["coll"].values())
    kv_ops = sum(v[0] for v in p["kv"].values())
    kv_bytes = sum(v[1] for v in p["kv"].values())
    s3: dict[str, int] = {}
    for op, n in p["s3"].items():
        s3[s3_kind(op)] = s3.get(s3_kind(op), 0) + n
    return {"coll_calls": calls, "coll_sent": sent, "coll_recv": recv,
            "coll_recv_padded": padded, "kv_ops": kv_ops,
            "kv_bytes": kv_bytes, "s3_requests": sum(s3.values()), "s3": s3,
            "seconds": p["seconds"]}


QUANTITIES = ("coll_calls", "coll_sent", "coll_recv", "coll_recv_padded", "kv_ops", "kv_bytes",
              "s3_requests")
LABELS = {"coll_calls": "collective calls", "coll_sent": "collective bytes sent",
          "coll_recv": "collective bytes received",
          "coll_recv_padded": "collective bytes received, padded", "kv_ops": "key-value store ops",
          "kv_bytes": "key-value store bytes", "s3_requests": "S3 requests (client)",
          "s3_server": "S3 requests (server, all ranks)"}


def phase_summary(docs: list[dict], names: list[str], server: dict) -> dict:
    """A phase across ranks: per quantity max and mean over ranks 1.., and rank 0's; the
    server's counts; the slowest rank's seconds; the largest call sites."""
    per_rank = {d["rank"]: merge_phases(d, names) for d in docs}
    figs = {r: rank_figures(p) for r, p in per_rank.items()}
    others = [f for r, f in figs.items() if r != 0] or [figs[0]]
    out: dict[str, Any] = {}
    for q in QUANTITIES:
        vals = [f[q] for f in others]
        out[q] = {"max": max(vals), "mean": sum(vals) / len(vals), "rank0": figs[0][q]}
    srv: dict[str, int] = {}
    for name in names:
        for k, v in (server.get(name) or {}).items():
            srv[k] = srv.get(k, 0) + v
    out["server"] = srv
    out["s3_server"] = sum(srv.values())
    out["seconds"] = max(f["seconds"] for f in figs.values())
    # call sites: rank 0 and the busiest other rank
    sites: dict[str, dict] = {}
    for r, p in per_rank.items():
        who = "rank0" if r == 0 else "others_max"
        for site, v in p["sites"].items():
            v = list(v) + [v[2]] * (4 - len(v))
            e = sites.setdefault(site, {"rank0": [0, 0, 0, 0], "others_max": [0, 0, 0, 0]})
            if who == "rank0":
                e["rank0"] = v
            else:
                e["others_max"] = [max(a, b) for a, b in zip(e["others_max"], v)]
    out["sites"] = sites
    out["s3_ops"] = _split_by_rank(per_rank, lambda p: p["s3"].items())
    out["kv_by_op"] = _split_by_rank(
        per_rank, lambda p: ((op, n) for op, (n, _) in p["kv"].items()), total=False)
    out["s3_sites"] = _split_by_rank(per_rank, lambda p: p["s3_sites"].items())
    out["per_rank"] = {r: {k: v for k, v in f.items()} for r, f in sorted(figs.items())}
    return out


def _split_by_rank(per_rank: dict, counts: Callable[[dict], Any], total: bool = True
                   ) -> dict[str, dict]:
    """``{key: {"rank0": n, "others_max": n[, "total": n]}}`` of the counts each rank's
    figures give (``counts(figures)``: (key, n) pairs)."""
    out: dict[str, dict] = {}
    for r, p in per_rank.items():
        for key, n in counts(p):
            e = out.setdefault(key, {"rank0": 0, "others_max": 0,
                                     **({"total": 0} if total else {})})
            if total:
                e["total"] += n
            if r == 0:
                e["rank0"] = n
            else:
                e["others_max"] = max(e["others_max"], n)
    return out


def configuration_figures(save_docs, restore_docs, s3_docs) -> dict:
    phases: dict[str, dict] = {}
    server0 = next(d for d in save_docs if d["rank"] == 0)["server"]
    for name in SAVE_JOB_PHASES:
        phases[name] = phase_summary(save_docs, [name], server0)
    for job, docs in (("restore", restore_docs), ("restore-s3", s3_docs)):
        if docs is None:
            continue
        srv = next(d for d in docs if d["rank"] == 0)["server"]
        for sub in RESTORE_SUBPHASES:
            phases[f"{job}.{sub}"] = phase_summary(docs, [f"{job}.{sub}"], srv)
        phases[job] = phase_summary(docs, [f"{job}.{s}" for s in RESTORE_SUBPHASES], srv)
        phases[f"{job}.close"] = phase_summary(docs, [f"{job}.close"], srv)
    return phases


# -- fitting --------------------------------------------------------------------------------

MODELS: dict[str, Callable[[float], float]] = {
    "constant": lambda n: 0.0,
    "log": lambda n: math.log2(n),
    "linear": lambda n: float(n),
}
#: a chosen model whose RMS error is above this fraction of the mean is marked a poor fit
POOR_FIT = 0.15


def fit(ns: list[int], ys: list[float]) -> dict:
    """Least squares of ``ys`` against each model of ``MODELS`` (``a`` or ``a + b g(N)``); the
    simplest model whose RMS error is within 5 % of the mean (or 0.5 in absolute terms) of the
    best one's, or the best one; with its projections, and ``poor`` when even that one misses
    the points by more than ``POOR_FIT`` of their mean (RMS)."""
    fits = {}
    for name, g in MODELS.items():
        if name == "constant":
            a = sum(ys) / len(ys)
            b = 0.0
        else:
            xs = [g(n) for n in ns]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            sxx = sum((x - mx) ** 2 for x in xs)
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
            a = my - b * mx
        rms = math.sqrt(sum((a + b * g(n) - y) ** 2 for n, y in zip(ns, ys)) / len(ys))
        fits[name] = {"a": a, "b": b, "rms": rms}
    best = min(f["rms"] for f in fits.values())
    scale = max(abs(sum(ys) / len(ys)), 1e-9)
    tol = max(0.05 * scale, 0.5)
    chosen = next(name for name in MODELS if fits[name]["rms"] <= best + tol)
    f = fits[chosen]
    return {"model": chosen, "a": f["a"], "b": f["b"], "rms": f["rms"], "all": fits,
            "poor": f["rms"] > max(POOR_FIT * scale, 0.5), "values": list(ys),
            "projection": {str(n): f["a"] + f["b"] * MODELS[chosen](n) for n in PROJECT_TO}}


def model_text(fitted: dict) -> str:
    a, b, m = fitted["a"], fitted["b"], fitted["model"]
    if m == "constant":
        return f"{num(a)}"
    term = {"log": "log2 N", "linear": "N"}[m]
    sign = "+" if b >= 0 else "−"
    return f"{num(a)} {sign} {num(abs(b))}·{term}"


def num(x: float) -> str:
    if abs(x) >= 1e6:
        return f"{x / 1e6:.2f}M"
    if abs(x) >= 1e4:
        return f"{x / 1e3:.1f}k"
    if abs(x - round(x)) < 0.05:
        return f"{round(x):d}"
    return f"{x:.1f}"


# -- report ---------------------------------------------------------------------------------

def cell(e: dict) -> str:
    return f"{num(e['max'])} / {num(e['mean'])} / {num(e['rank0'])}"


def server_cell(srv: dict) -> str:
    parts = [f"{srv[k]} {k}" for k in ("GET", "PUT", "LIST", "DELETE") if srv.get(k)]
    parts += [f"{v} {k}" for k, v in sorted(srv.items()) if k not in ("GET", "PUT", "LIST",
                                                                      "DELETE") and v]
    return ", ".join(parts) or "0"


def tables(results: list[dict]) -> list[str]:
    """One markdown table per phase of ``TABLE_PHASES``, a row per configuration."""
    out = []
    phases = [p for p in TABLE_PHASES if any(p in r.get("phases", {}) for r in results)]
    for phase in phases:
        rows = [[r["ranks"], r["nodes"], server_cell(f["server"]), cell(f["s3_requests"]),
                 cell(f["coll_calls"]), cell(f["coll_sent"]), cell(f["coll_recv"]),
                 cell(f["coll_recv_padded"]), cell(f["kv_ops"]), f"{f['seconds']:.1f}"]
                for r in results if (f := r.get("phases", {}).get(phase)) is not None]
        out += [f"**{phase}**", "",
                *markdown_table(["ranks:", "nodes:", "S3 at the server", "S3 requests / rank",
                                 "collective calls", "bytes sent", "bytes received",
                                 "received, padded", "KV store ops", "seconds:"], rows), ""]
    return out


def auto_nodes(ranks: int) -> int:
    """``--nodes auto``: ``PER_NODE_AUTO`` ranks a node, at least one node."""
    n = max(1, ranks // PER_NODE_AUTO)
    return n if ranks % n == 0 else 1


def series(results: list[dict]) -> dict[str, list[dict]]:
    """The configurations each fit runs over, one per rank count: ``PER_NODE_AUTO`` ranks a node
    (the nodes grow with the job, as they do at scale: the projections), and, when a list of
    node counts was run, the node count with the most rank counts (at least 3; the larger one
    on a tie): the nodes fixed, the ranks a node growing."""
    ok = [r for r in results if r.get("phases")]
    out: dict[str, list[dict]] = {}
    per_node = sorted((r for r in ok if r["nodes"] == auto_nodes(r["ranks"])),
                      key=lambda r: r["ranks"])
    if len(per_node) >= 2:
        out[f"{PER_NODE_AUTO} ranks a node"] = per_node
    if any(not r["auto"] for r in ok):
        by_nodes: dict[int, list[dict]] = {}
        for r in ok:
            by_nodes.setdefault(r["nodes"], []).append(r)
        best = max(by_nodes.items(), key=lambda kv: (len(kv[1]), kv[0]), default=None)
        if best and len(best[1]) >= 3:
            out[f"{best[0]} nodes"] = sorted(best[1], key=lambda r: r["ranks"])
    return out


def fits_for(chosen: list[dict]) -> dict:
    """Every quantity of every table phase fitted over ``chosen``: per rank (the max over
    ranks 1..), rank 0, and the server's count (all ranks)."""
    ns = [r["ranks"] for r in chosen]
    out: dict[str, dict] = {}
    for phase in TABLE_PHASES:
        if not all(phase in r["phases"] for r in chosen):
            continue
        for q in QUANTITIES:
            for who in ("max", "rank0"):
                ys = [r["phases"][phase][q][who] for r in chosen]
                out[f"{phase}|{q}|{who}"] = fit(ns, ys)
        ys = [r["phases"][phase]["s3_server"] for r in chosen]
        out[f"{phase}|s3_server|total"] = fit(ns, ys)
    return out


def model_table(all_fits: dict[str, dict]) -> list[str]:
    """One row per quantity: for each series, the model and its projections to 1,024 and
    8,192 ranks. Quantities that are 0 in every configuration are left out."""
    names = list(all_fits)
    columns = ["phase", "quantity", "who"]
    for name in names:
        columns += [f"{name}: model (N ranks)", "N = 1,024:", "N = 8,192:"]
    rows = []
    keys = list(dict.fromkeys(k for name in names for k in all_fits[name]))
    for key in keys:
        fs = [all_fits[n].get(key) for n in names]
        if all(g is None or (g["model"] == "constant" and abs(g["a"]) < 1e-9) for g in fs):
            continue
        phase, q, who = key.split("|")
        whom = {"max": "per rank (max)", "rank0": "rank 0", "total": "all ranks"}[who]
        row = [phase, LABELS[q], whom]
        for g in fs:
            row += ([mark(g), num(g["projection"]["1024"]), num(g["projection"]["8192"])]
                    if g else ["", "", ""])
        rows.append(row)
    return markdown_table(columns, rows)


def mark(f: dict) -> str:
    """A model as a table cell; a growing one in bold."""
    text = f"{f['model']}: {model_text(f)}"
    text = text if f["model"] == "constant" else f"**{text}**"
    return text + (f" (poor fit: {', '.join(num(y) for y in f['values'])})" if f["poor"] else "")


def growing(fits: dict, name: str) -> list[str]:
    """Lines naming what grows with N per rank (ranks other than 0), and what grows faster
    than a linear model says on rank 0."""
    lines = []
    for key, f in fits.items():
        phase, q, who = key.split("|")
        if who == "max" and f["model"] != "constant":
            lines.append(f"- {phase}: {LABELS[q]} per rank, {f['model']} ({model_text(f)}; "
                         f"{num(f['projection']['8192'])} at 8,192 ranks) [{name}]")
        if who == "rank0" and f["model"] == "linear" and f["poor"]:
            lines.append(f"- {phase}: rank 0's {LABELS[q]}: even a linear model is a poor fit "
                         f"({', '.join(num(y) for y in f['values'])}) [{name}]")
    return lines


def site_lines(results: list[dict]) -> list[str]:
    """The call sites behind the largest configuration's figures, per table phase."""
    ok = [r for r in results if r.get("phases")]
    if not ok:
        return []
    big = max(ok, key=lambda r: (r["ranks"], r["nodes"]))
    out = [f"Where it comes from, at {big['ranks']} ranks x {big['nodes']} nodes (collectives: "
           f"calls, bytes sent/received, max over ranks 1.. | rank 0; S3 operations by the "
           f"tierstore code that made them, and key-value store operations: rank 0 / max over "
           f"ranks 1.. / all ranks):", ""]
    for phase in TABLE_PHASES:
        f = big["phases"].get(phase)
        if f is None:
            continue
        rows = sorted(f["sites"].items(), key=lambda kv: -(kv[1]["others_max"][2]
                                                           + kv[1]["others_max"][1]
                                                           + kv[1]["rank0"][2]))
        def fig(e: list) -> str:
            pad = f" (padded {num(e[3])})" if len(e) > 3 and e[3] != e[2] else ""
            return f"{e[0]}×, {num(e[1])}/{num(e[2])} B{pad}"

        out.append(f"- {phase}: " + "; ".join(
            f"`{site}` {fig(v['others_max'])} | {fig(v['rank0'])}" for site, v in rows))
        if f["s3_sites"]:
            out.append("  - S3: " + "; ".join(
                f"`{site}` {e['rank0']}/{e['others_max']}/{e['total']}"
                for site, e in sorted(f["s3_sites"].items(), key=lambda kv: -kv[1]["total"])))
        if f["kv_by_op"]:
            out.append("  - key-value store: " + ", ".join(
                f"{op} {e['rank0']}/{e['others_max']}" for op, e in sorted(f["kv_by_op"].items())))
    return out


def report(results: list[dict], all_fits: dict[str, dict], markdown: bool,
           elapsed: float) -> None:
    print(f"### Figures ({os.cpu_count()} CPUs, {platform.machine()}; every rank and node "
          f"simulated on this machine)\n")
    print("Cells: max over ranks 1.. / mean over ranks 1.. / rank 0 (DCP's coordinator). Bytes: "
          "payload through torch.distributed collectives; padded: with torch's padding of every "
          "object of an all_gather_object (gather_object) to the largest one. S3 at the "
          "server: every rank's requests, counted by SeaweedFS; S3 requests / rank: counted "
          "in each rank's clients.\n")
    for line in tables(results):
        print(line)
    for r in results:
        if not r.get("phases"):
            print(f"FAILED: {r['ranks']} ranks x {r['nodes']} nodes: "
                  f"{r.get('error', '?').splitlines()[0]}")
    if all_fits:
        over = "; ".join(f"{name}: N = {', '.join(str(r['ranks']) for r in rs)}"
                         for name, rs in series(results).items())
        print(f"\n### Models\n\nLeast squares over the rank count N ({over}); a growing model "
              f"in bold:\n")
        for line in model_table(all_fits):
            print(line)
        g = [line for name, fits in all_fits.items() for line in growing(fits, name)]
        print("\nGrows with the rank count, per rank:" if g else
              "\nNothing grows with the rank count per rank.")
        for line in g:
            print(line)
    if markdown:
        print()
        for line in site_lines(results):
            print(line)
    print(f"\n(total run time {elapsed:.0f} s)")


# -------------------------------------------------------------------------------------------
# driver
# -------------------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--ranks", default="2,4,8,16", help="rank counts (default 2,4,8,16)")
    p.add_argument("--nodes", default="auto,2",
                   help="simulated node counts, comma-separated; each one that divides a rank "
                        "count (and is at most that count) is run at that rank count; 'auto' is "
                        f"{PER_NODE_AUTO} ranks a node, at least 1 node (default auto,2: "
                        "2r1n 2r2n 4r1n 4r2n 8r2n 16r2n 16r4n)")
    p.add_argument("--s3-restore", action=argparse.BooleanOptionalAction, default=True,
                   help="also restore once more with every node's RAM tier deleted: restore-s3 "
                        "(default on)")
    p.add_argument("--dir", default=None,
                   help="parent of the temp dirs (default /dev/shm when there, else the system "
                        "temp dir)")
    p.add_argument("--timeout", type=float, default=420, help="seconds a job may take (420)")
    p.add_argument("--rdzv-timeout", type=int, default=600,
                   help="rendezvous, init_process_group and [store] collective_timeout seconds "
                        "(600)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    p.add_argument("--markdown", action="store_true",
                   help="also print where the largest configuration's figures come from "
                        "(collectives by call site, S3 operations by the tierstore code that made "
                        "them), as docs/performance.md quotes them")
    p.add_argument("--keep", action="store_true", help="keep the temp dirs (their paths printed)")
    p.add_argument("--report", metavar="PATH",
                   help="run nothing: print the report (fits included) of a run's --json file")
    # worker side (set by the driver)
    p.add_argument("--worker", choices=("save", "restore", "restore-s3"), help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--bucket", help=argparse.SUPPRESS)
    p.add_argument("--metrics-port", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def configurations(args: argparse.Namespace) -> list[tuple[int, int, bool]]:
    """(ranks, nodes, whether that is the ``auto`` node count) for every configuration to run,
    in order of rank count, each once."""
    ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    wanted = [x.strip() for x in args.nodes.split(",") if x.strip()]
    out = []
    for r in ranks:
        counts = set()
        for w in wanted:
            n = auto_nodes(r) if w == "auto" else int(w)
            if n <= r and r % n == 0:
                counts.add(n)
        out += [(r, n, n == auto_nodes(r)) for n in sorted(counts)]
    return out


def launch(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    parent = args.dir or shm_or_tmp()
    log = progress_log(False)
    results = []
    status = 0
    with seaweed(log=log) as s3:
        for ranks, nodes, auto in configurations(args):
            name = f"scale-{ranks}r-{nodes}n"
            entry: dict[str, Any] = {"ranks": ranks, "nodes": nodes, "auto": auto,
                                     "bucket": name}
            results.append(entry)
            with scratch(f"tierstore-{name}-", parent, keep=args.keep) as root:
                status |= run_configuration(args, s3, entry, root, log)
                if args.keep:
                    log(f"kept {root}")
    all_fits = {name: fits_for(rs) for name, rs in series(results).items()}
    elapsed = time.perf_counter() - t_start
    report(results, all_fits, args.markdown, elapsed)
    if args.json:
        config = {"ranks": args.ranks, "nodes": args.nodes, "s3_restore": args.s3_restore,
                  "own_tensors": OWN_TENSORS, "own_numel": OWN_NUMEL,
                  "replicated_numel": REPLICATED_NUMEL}
        write_json(args.json, config, elapsed, {
            "results": results,
            "fits": {name: {"configurations": [[r["ranks"], r["nodes"]] for r in rs],
                            "models": all_fits[name]}
                     for name, rs in series(results).items()}}, indent=1)
    return status


def run_configuration(args: argparse.Namespace, s3, entry: dict, root: str, log) -> int:
    """The jobs of one configuration (``entry``: ranks, nodes, bucket) in ``root``; its
    figures (or the error) go into ``entry``. Returns 1 when it failed."""
    ranks, nodes, name = entry["ranks"], entry["nodes"], entry["bucket"]
    t0 = time.perf_counter()
    try:
        s3.make_bucket(name)
        with open(os.path.join(root, "s3-options.json"), "w") as f:
            json.dump(s3.storage_options(), f)
        jobs = ["save", "restore"] + (["restore-s3"] if args.s3_restore else [])
        docs: dict[str, list[dict] | None] = {}
        for job in jobs:
            if job == "restore-s3":
                shutil.rmtree(os.path.join(root, "ram"), ignore_errors=True)
            tj = time.perf_counter()
            docs[job], why = run_job(args, job, ranks, nodes, root, name, s3.metrics_port)
            log(f"{ranks} ranks x {nodes} nodes: {job} job "
                f"{'done' if docs[job] else 'FAILED'} in {time.perf_counter() - tj:.0f} s")
            if docs[job] is None:
                raise RuntimeError(f"{job} job: {why}")
        entry["phases"] = configuration_figures(docs["save"], docs["restore"],
                                                docs.get("restore-s3"))
        return 0
    except Exception as exc:  # noqa: BLE001 - report it, run the others
        entry["error"] = str(exc)
        log(f"{ranks} ranks x {nodes} nodes FAILED: {exc}")
        return 1
    finally:
        entry["seconds"] = time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        args.job = args.worker
        return worker(args)
    if args.report:
        with open(args.report) as f:
            doc = json.load(f)
        results = doc["results"]
        report(results, {name: fits_for(rs) for name, rs in series(results).items()},
               args.markdown, doc.get("elapsed_s", 0.0))
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
