"""Run under ``torchrun --nproc-per-node=2`` by tests/test_multirank.py.

    torchrun ... multirank_fail_worker.py ROOT PHASE FAILING_RANK

Saves ``step-1``; then ``step-2`` fails on one rank only (a ``tierstore_phase`` hook on
FAILING_RANK raises before PHASE; PHASE ``mismatch``: FAILING_RANK saves under another id, as a
rank whose schedule parted from the others' would); every rank must get the error,
``latest()`` must stay ``step-1``; then ``step-3``
saves fine and nothing hidden may stay in the shared root (argv[1]).

Prints one line per problem and exits 1 when there is any; prints "RANK <r> OK" otherwise.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tierstore

from worker_common import check_equal, run_worker

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

problems: list[str] = []


class FailOnOneRank:
    def __init__(self, phase: str, rank: int):
        self.phase, self.rank = phase, rank

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail):
        if phase == self.phase and checkpoint_id == "step-2" and dist.get_rank() == self.rank:
            raise RuntimeError(f"injected failure on rank {self.rank} before {phase}")


def state(rank: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    return {f"r{rank}.w": torch.randn(64, 32, generator=gen),
            f"r{rank}.b": torch.randn(100, generator=gen).to(torch.bfloat16)}


def main() -> int:
    root, phase, failing = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    store = tierstore.open({"tier": [{"name": "disk", "backend": "local", "path": root}]},
                           plugins=[FailOnOneRank(phase, failing)])
    pg = store.process_group
    dcp.save(state(rank, 1), storage_writer=store.writer(), checkpoint_id="step-1",
             process_group=pg)
    mismatch = phase == "mismatch" and rank == failing
    try:
        dcp.save(state(rank, 2), storage_writer=store.writer(),
                 checkpoint_id="step-9" if mismatch else "step-2", process_group=pg)
        problems.append("saving step-2 did not raise")
    except CheckpointException as exc:
        expected = ("every rank must save the same checkpoint id" if phase == "mismatch"
                    else f"injected failure on rank {failing}")
        if expected not in str(exc):
            problems.append(f"the error does not carry rank {failing}'s message: {exc}")
    if store.latest() != "step-1":
        problems.append(f"latest() after the failed save: {store.latest()!r}")
    if os.path.exists(os.path.join(root, "step-2")):
        problems.append("step-2 exists after its save failed")

    dcp.save(state(rank, 3), storage_writer=store.writer(), checkpoint_id="step-3",
             process_group=pg)
    if store.latest() != "step-3":
        problems.append(f"latest() after step-3: {store.latest()!r}")
    for cid, seed in (("step-1", 1), ("step-3", 3)):
        expected = state(rank, seed)
        target = {k: torch.zeros_like(v) for k, v in expected.items()}
        dcp.load(target, storage_reader=store.reader(), checkpoint_id=cid, process_group=pg)
        check_equal(problems, target, expected, f"{cid} after load")
    dist.barrier()
    if rank == 0:
        left = sorted(n for n in os.listdir(root) if n.startswith(".tierstore-"))
        if left:
            problems.append(f"hidden entries left after step-3 saved: {left}")
    store.close()
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
