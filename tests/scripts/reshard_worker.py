"""torchrun worker: a checkpoint saved by 2 simulated nodes x 2 ranks, restored by jobs of other
shapes from node-local RAM and peer replicas (tests/test_reshard.py).

Tiers: "ram" (node-local RAM, ``{node}``) and "peer" (node-local, clique factor 2 jump 2: at
2 x 2 every rank's files have a replica on the other node); with SHARED "objects" too (a
``file://`` object-store tier every rank sees, every save drained there).

argv: ROOT PHASE [SHARED]. PHASE "save" (2 x 2): an FSDP2 model and its Adam state after two
steps, a DDP-style replicated tensor (equal on every rank: DCP writes it once, in one rank's
file), a DTensor of 10 rows sharded unevenly and non-tensor values, saved as "step-2" and
replicated; rank 0 writes every tensor's full value to ROOT/reference.pt. "load" (any shape):
``latest()`` must be "step-2"; a fresh model and optimizer (another seed, a step of their own)
and zeroed values load it, and every tensor's full value must equal the reference bit for bit.
Each rank prints ``RANK <r> BYTES <tier>=<n> ...`` (where its bytes came from, as the
``loaded`` event says), ``RANK <r> FETCHED <file> FROM RANK <s> BYTES <n> OF <size>`` per
file peers sent it (or the blocks of it it reads), and ``RANK <r> PLANNED <tier>=<n> ... SLOW
<n>`` (its ``restore_planned`` event: where the load said, before reading, its bytes would come
from, and how many from slower tiers).
"load-then-kill": the same load (each rank then prints its problems, or OK), then a second one
in which rank KILLED dies as the peers begin sending (see load_and_die).
"""

import logging
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh
from worker_common import run_worker

import tierstore
from tierstore import EventKind, Phase

warnings.filterwarnings("ignore")
problems: list[str] = []
CID = "step-2"
#: "load-then-kill": the rank that dies in the second load's peer fetch, and the store's
#: collective timeout
KILLED = 1
KILL_TIMEOUT_S = 6


class Observer:
    """Records the ``loaded`` event's sources and the files peers sent; with ``die``, this rank
    ends at once when its peer fetch begins (a node lost in the middle of a restore)."""

    def __init__(self, die=False):
        self.bytes_from, self.fetched, self.die, self.planned = {}, [], die, None

    @tierstore.hookimpl
    def tierstore_phase(self, phase, tier, detail):
        if self.die and phase == Phase.PEER_FETCH:
            os._exit(0)

    @tierstore.hookimpl
    def tierstore_event(self, event):
        if event.kind == EventKind.LOADED:
            self.bytes_from = dict(event.detail["bytes_from"])
        elif event.kind == EventKind.RESTORE_PLANNED:
            self.planned = event.detail
        elif event.kind == EventKind.PEER_FETCHED:
            self.fetched.append((event.detail["file"], event.detail["from"], event.nbytes,
                                 event.detail["size"]))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(24, 40)
        self.net2 = nn.Linear(40, 12)

    def forward(self, x):
        return self.net2(torch.relu(self.net1(x)))


class App(Stateful):
    """Model and optimizer as DCP sees them (what torchtitan and the DCP recipe do)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def build(seed, mesh, steps):
    torch.manual_seed(seed)  # one logical model on every rank, then sharded
    model = Model()
    fully_shard(model.net1, mesh=mesh)
    fully_shard(model.net2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(seed + 100)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.rand(6, 24, generator=gen)).sum().backward()
        optimizer.step()
    return model, optimizer


def config(root, shared, timeout=None):
    tiers = [{"name": "ram", "backend": "memory", "path": root + "/ram/{node}"},
             {"name": "peer", "backend": "peer", "path": root + "/peer/{node}",
              "replication": {"strategy": "clique", "factor": 2, "jump": 2}}]
    if shared:
        tiers.append({"name": "objects", "backend": "fsspec", "url": f"file://{root}/objects"})
    # One data file per rank (io_threads = 1): a lost rank's bytes are one file, and the wide
    # tensor's rows share it with the small items.
    return {"store": {"io_threads": 1, **({"collective_timeout": timeout} if timeout else {})},
            "tier": tiers}


def make_state(app, mesh, fill):
    """The whole state: ``fill`` None for the saved values, else every value emptied."""
    uneven = torch.arange(10 * 6, dtype=torch.float64).reshape(10, 6) if fill is None \
        else torch.zeros(10, 6, dtype=torch.float64)
    replicated = torch.linspace(-3, 3, 333) if fill is None else torch.zeros(333)
    # 8 MiB sharded by rows: 2 MiB per saved rank, several blocks of its file; a rank of a
    # job of another size needs some of them only (and fetches only those from a peer).
    wide = torch.arange(2048 * 1024, dtype=torch.float32).reshape(2048, 1024) if fill is None \
        else torch.zeros(2048, 1024)
    return {"app": app, "uneven": distribute_tensor(uneven, mesh, [Shard(0)]),
            "wide": distribute_tensor(wide, mesh, [Shard(0)]),
            "replicated": replicated,
            "step": 2 if fill is None else 0,
            "meta": ({"name": "run-a", "lrs": [0.01, 0.001]} if fill is None
                     else {"name": "", "lrs": [0.0, 0.0]})}


def full_values(obj, prefix=""):
    """Every tensor of ``obj`` (nested dicts, lists) by path, DTensors gathered whole
    (a collective: every rank walks the same paths in the same order)."""
    if isinstance(obj, Stateful):
        obj = obj.state_dict()
    out = {}
    if isinstance(obj, dict):
        for key in sorted(obj, key=str):
            out.update(full_values(obj[key], f"{prefix}/{key}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(full_values(v, f"{prefix}/{i}"))
    elif isinstance(obj, DTensor):
        out[prefix] = obj.full_tensor()
    elif isinstance(obj, torch.Tensor):
        out[prefix] = obj.clone()
    else:
        out[prefix] = obj
    return out


def load_and_die(store, mesh, rank) -> int:
    """The second load of "load-then-kill": rank KILLED ends when its peer fetch begins; every
    other rank must not wait for it for ever: its load raises, and it prints ``RANK <r> RAISED
    <type>: <message>``, ``RANK <r> AFTER <seconds>`` and ``RANK <r> LOGGED <message>`` per
    error tierstore logged, then ends without a teardown (the groups are unusable)."""
    model, optimizer = build(1, mesh, steps=1)
    state = make_state(App(model, optimizer), mesh, 0)
    errors: list[str] = []  # what tierstore logged as errors: which rank was lost

    class Errors(logging.Handler):
        def emit(self, record):
            errors.append(" ".join(record.getMessage().split())[:300])

    logging.getLogger("tierstore").addHandler(Errors(logging.ERROR))
    started = time.monotonic()
    try:
        dcp.load(state, storage_reader=store.reader(), checkpoint_id=CID,
                 process_group=store.process_group)
        outcome = "LOADED"
    except Exception as exc:  # noqa: BLE001 - the test reads which error, and how soon
        outcome = f"RAISED {type(exc).__name__}: {' '.join(str(exc).split())[:1500]}"
    lines = [outcome, f"AFTER {time.monotonic() - started:.1f}"] + [f"LOGGED {e}" for e in errors]
    sys.stdout.write("".join(f"RANK {rank} {line}\n" for line in lines))
    sys.stdout.flush()
    os._exit(0)


def bitwise_equal(a, b) -> bool:
    """Same dtype, shape and bytes."""
    return (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def main() -> int:
    root, phase = sys.argv[1], sys.argv[2]
    shared = len(sys.argv) > 3 and sys.argv[3] == "shared"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    dying = phase == "load-then-kill"
    seen = Observer()
    store = tierstore.open(config(root, shared, KILL_TIMEOUT_S if dying else None),
                           plugins=[seen])
    try:
        code = load_and_check(store, mesh, rank, root, phase, seen)
        if dying:  # the same job loads again, and rank KILLED dies in that load's peer fetch
            seen.die = rank == KILLED
            load_and_die(store, mesh, rank)  # ends the process
        return code
    finally:
        store.close()


def load_and_check(store, mesh, rank, root, phase, seen) -> int:
    """"save", or a load compared with the reference (see the module docstring)."""
    if phase == "save":
        model, optimizer = build(0, mesh, steps=2)
        state = make_state(App(model, optimizer), mesh, None)
        dcp.save(state, storage_writer=store.writer(), checkpoint_id=CID,
                 process_group=store.process_group)
        store.wait()
        reference = full_values(state)
        if rank == 0:
            torch.save(reference, os.path.join(root, "reference.pt"))
        return 0
    latest = store.latest()
    if latest != CID:
        problems.append(f"latest() is {latest!r}, expected {CID!r}")
        return 1
    model, optimizer = build(1, mesh, steps=1)
    state = make_state(App(model, optimizer), mesh, 0)
    dcp.load(state, storage_reader=store.reader(), checkpoint_id=latest,
             process_group=store.process_group)
    got = full_values(state)
    expected = torch.load(os.path.join(root, "reference.pt"), weights_only=True)
    if sorted(got) != sorted(expected):
        problems.append(f"loaded paths {sorted(got)} differ from the saved {sorted(expected)}")
    for path in sorted(set(got) & set(expected)):
        a, b = got[path], expected[path]
        same = bitwise_equal(a, b) if isinstance(b, torch.Tensor) else a == b
        if not same:
            problems.append(f"{path}: loaded {a!r} differs from the saved {b!r}")
    lines = ["BYTES " + " ".join(f"{k}={v}" for k, v in sorted(seen.bytes_from.items()))]
    lines += [f"FETCHED {rel} FROM RANK {src} BYTES {n} OF {size}"
              for rel, src, n, size in seen.fetched]
    if seen.planned is not None:
        lines.append("PLANNED " + " ".join(f"{s['tier']}={s['bytes']}" for s in sorted(
            seen.planned["sources"], key=lambda s: s["tier"]))
            + f" SLOW {seen.planned['from_slow_tiers_bytes']}")
    # One write per line: print() writes the newline apart, and the ranks of a node share
    # torchrun's unbuffered stdout.
    if phase == "load-then-kill":  # this process ends in the next load: say it now
        lines += [f"RESHARD: {p}" for p in problems] or ["OK"]
    for line in lines:
        sys.stdout.write(f"RANK {rank} {line}\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "RESHARD")
