"""What the scripts under tests/scripts share (they import it as ``worker_common``: a script's own
folder is first on its ``sys.path``), and what tests need of it too (tests/helpers.py imports it
as ``scripts.worker_common``): how every torchrun worker ends, state dicts and their bitwise
comparison (from the conformance kit, ``tierstore_conformance``), checks that record problems
instead of raising, and the state dicts that both a script and a test build.
"""

import atexit
import faulthandler
import io
import os
import signal
import sys
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import tierstore
from tierstore_conformance import assert_state_dicts_equal, make_state_dict
# The kit's comparison also through lists, tuples and io.BytesIO, and its load target.
from tierstore_conformance._helpers import assert_trees_equal
from tierstore_conformance.roundtrip import _empty_like as empty_like

# Whole lines in one write: the ranks of a node share one pipe, and under PYTHONUNBUFFERED (which
# the tests set, so that a killed rank's last lines are seen) print() writes a line and its end
# apart, so that two ranks' lines interleave ("RANK 1 ... FAILED xRANK 0 ... FAILED y").
sys.stdout.reconfigure(line_buffering=True, write_through=False)
# A test that times out asks every rank for its stacks (tests/helpers.py: SIGUSR1), into a file
# of its own (the ranks of a node share stderr, where two dumps would interleave), in the
# directory the test's process names (removed when it ends, with the files of killed ranks).
_STACKS = open(os.path.join(os.environ.get("TIERSTORE_TEST_STACKS") or tempfile.gettempdir(),
                            f"tierstore-test-stacks-{os.getpid()}.txt"), "w")
faulthandler.register(signal.SIGUSR1, file=_STACKS, all_threads=True)
# (removed at a normal end; a dump is read and removed by the test that asked for it)
atexit.register(lambda: _STACKS.tell() == 0 and os.unlink(_STACKS.name))

__all__ = ["assert_state_dicts_equal", "assert_trees_equal", "check_equal",
           "check_node_checkpoint", "empty_like", "load_like", "local_shards", "make_async_state",
           "make_state_dict", "mutate_everything", "node_state", "run_worker"]


# --------------------------------------------------------------------------- ending a worker

def run_worker(main: Callable[[], int], problems: list[str], label: str) -> None:
    """Run ``main`` and report for the test, which reads every rank's lines from stdout: each
    rank prints its problems (``RANK <r> <label>: ...``) and ``RANK <r> OK`` when it has none,
    tears the process group down and exits non-zero on failure."""
    code = 0
    try:
        code = main()
    except Exception:
        traceback.print_exc()
        code = 2
    rank = os.environ.get("RANK", "?")
    for p in problems:
        print(f"RANK {rank} {label}: {p}", flush=True)
    if code == 0 and not problems:
        print(f"RANK {rank} OK", flush=True)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    # Exit without the interpreter's finalization, once the exit handlers have run: a rank
    # whose report is out must not fail the test at teardown. Tearing the interpreter down
    # beside torch's C++ threads (gloo's, pybind11's GIL release in a daemon thread) now and
    # then aborts a process with "terminate called without an active exception" (a known
    # torch.distributed exit problem), and its node's agent then holds the other nodes until
    # the test's timeout.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or (1 if problems else 0))


# --------------------------------------------------------------------------- checks

def say(line: str) -> None:
    """``line`` on stdout in one write (print() does the same once this module is imported)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def ram_and_s3(root: str, url: str, options: dict) -> dict:
    """A node-local RAM tier (``keep = 2``) in front of an S3 tier every rank shares: the
    store of the restart-path workers."""
    return {"tier": [
        {"name": "ram", "backend": "memory", "path": root + "/ram/{node}", "keep": 2},
        {"name": "s3", "backend": "fsspec", "url": url, "options": options},
    ]}


def load_like(store, checkpoint_id: str, like: Any, **load_kwargs: Any) -> Any:
    """``checkpoint_id`` loaded through ``store.reader()`` into ``empty_like(like)`` (zero
    tensors in fresh memory, other values emptied); ``load_kwargs`` go to ``dcp.load``."""
    dest = empty_like(like)
    dcp.load(dest, storage_reader=store.reader(), checkpoint_id=checkpoint_id, **load_kwargs)
    return dest


def check_equal(problems: list[str], got: Any, want: Any, where: str) -> None:
    """Add a problem to ``problems`` unless ``got`` equals ``want`` as
    ``tierstore_conformance.assert_state_dicts_equal`` compares them (tensors: dtype, shape and
    every byte; dicts: the same keys; anything else: ``==``)."""
    try:
        assert_state_dicts_equal(got, want, where)
    except AssertionError as exc:
        problems.append(str(exc))


def local_shards(sd: dict) -> dict:
    """``sd`` with every DTensor replaced by this rank's local shard."""
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in sd.items()}


# --------------------------------------------------------------------------- state dicts

def node_state(step: int, rank: int, mesh, own_numel: int, zero: bool = False) -> dict:
    """The state of the two-node jobs (two_node_worker.py, peer_worker.py) at ``step``: ``w``
    sharded over ``mesh``, a replicated tensor, ``own_numel`` floats of this rank's own and the
    step. ``zero``: a load target of the same layout."""
    gen = torch.Generator().manual_seed(step)
    full = torch.randn(64, 32, generator=gen)
    replicated = torch.randn(10, generator=gen)
    mine = torch.randn(own_numel, generator=torch.Generator().manual_seed(step * 10 + rank))
    if zero:
        full, replicated, mine = (torch.zeros_like(full), torch.zeros_like(replicated),
                                  torch.zeros_like(mine))
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "replicated": replicated,
            f"rank{rank}": mine, "step": 0 if zero else step}


def check_node_checkpoint(store, problems: list[str], rank: int, mesh, expected: str,
                          own_numel: int, *, load_latest: bool = False) -> None:
    """The load phase of the two-node jobs: print ``RANK <r> LATEST <id>``, check that
    ``store.latest()`` is ``expected``, load ``expected`` (with ``load_latest``: what latest()
    said) into a zeroed ``node_state`` and compare it bit for bit with that step's state."""
    latest = store.latest()
    print(f"RANK {rank} LATEST {latest}", flush=True)
    if latest != expected:
        problems.append(f"latest() is {latest!r}, expected {expected!r}")
    cid = latest if load_latest else expected
    step = int(cid.split("-")[1])
    out = node_state(step, rank, mesh, own_numel, zero=True)
    dcp.load(out, storage_reader=store.reader(), checkpoint_id=cid,
             process_group=store.process_group)
    check_equal(problems, local_shards(out), local_shards(node_state(step, rank, mesh, own_numel)),
                cid)


def check_node_steps(store, problems: list[str], rank: int, mesh, steps, own_numel: int,
                     where: str) -> None:
    """Load ``step-<s>`` for each of ``steps`` into a zeroed ``node_state`` and compare it bit
    for bit with that step's state; a load that fails is a problem (``where``: what the store
    reads from, for its message), and every rank goes on to the next step."""
    for step in steps:
        cid = f"step-{step}"
        out = node_state(step, rank, mesh, own_numel, zero=True)
        try:
            dcp.load(out, storage_reader=store.reader(), checkpoint_id=cid,
                     process_group=store.process_group)
        except Exception as exc:  # noqa: BLE001 - every rank reports, then the test fails
            problems.append(f"{cid} does not load from {where}: {type(exc).__name__}: {exc}")
            continue
        check_equal(problems, local_shards(out),
                    local_shards(node_state(step, rank, mesh, own_numel)), cid)


def load_expecting_not_found(store, problems: list[str], rank: int, out: dict,
                             checkpoint_id: str) -> None:
    """Load ``checkpoint_id`` into ``out``, expecting ``CheckpointNotFound``: print ``RANK <r>
    NOTFOUND <message>``, or note the problem when the load succeeds."""
    try:
        dcp.load(out, storage_reader=store.reader(), checkpoint_id=checkpoint_id,
                 process_group=store.process_group)
        problems.append("the load succeeded")
    except tierstore.CheckpointNotFound as exc:
        print(f"RANK {rank} NOTFOUND {exc}", flush=True)


def make_async_state(seed: int = 0) -> dict:
    """The state test_async.py and async_process_worker.py save while training changes it: an
    optimizer-like nested dict with an int key, a non-contiguous view, a 0-d tensor, several
    dtypes and an ``io.BytesIO``."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 32, generator=g),
                  "half": torch.randn(128, generator=g).to(torch.bfloat16),
                  "ints": torch.randint(0, 1000, (50,), generator=g),
                  "flags": torch.rand(33, generator=g) > 0.5,
                  "scalar": torch.tensor(3.5),
                  "view": torch.randn(10, 10, generator=g)[:, 2]},
        "optim": {"state": {0: {"exp_avg": torch.randn(64, 32, generator=g)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "blob": io.BytesIO(b"opaque bytes"),
        "epoch": 7,
    }


class StagedEvents:
    """An observer of the ``staged`` events of this process's saves (``.events``)."""

    def __init__(self):
        self.events = []

    @tierstore.hookimpl
    def tierstore_event(self, event):
        if event.kind == tierstore.EventKind.STAGED:
            self.events.append(event)


def mutate_everything(sd) -> None:
    """Change every tensor in place (and overwrite every BytesIO), as a training step would."""
    for v in (sd.values() if isinstance(sd, dict) else sd):
        if isinstance(v, torch.Tensor):
            if v.dtype == torch.bool:
                v.logical_not_()
            else:
                v.add_(1)
        elif isinstance(v, (dict, list)):
            mutate_everything(v)
        elif isinstance(v, io.BytesIO):
            v.seek(0)
            v.write(b"CHANGED")


def snapshot(obj):
    """A deep copy of a (model, optimizer) state dict: DTensors become clones of their local
    shard, tensors are cloned, containers are copied, everything else kept as is."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj
