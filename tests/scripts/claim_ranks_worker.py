"""Run under ``torchrun --nproc-per-node=2`` by tests/test_tier_claims.py.

    torchrun ... claim_ranks_worker.py ROOT

Each rank's RAM tier is ``ROOT/ram/<rank>`` (a node-local tier of two parts); the test holds
``ROOT/ram/1`` for another job. The save of ``step-1`` must fail on both ranks alike with a
``TierInUseError`` naming rank 1's directory, before anything is written (no rank may go on
into DCP's collectives and wait there). Prints "RANK <r> OK" when it does.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tierstore

from worker_common import run_worker

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

problems: list[str] = []


def main() -> int:
    root = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with tierstore.open({"tier": [{"name": "ram", "backend": "memory",
                                   "path": f"{root}/ram/{{rank}}"}]}) as store:
        try:
            dcp.save({"w": torch.full((8,), float(rank))}, storage_writer=store.writer(),
                     checkpoint_id="step-1", process_group=store.process_group)
            problems.append("the save into another job's directory went through")
        except tierstore.TierInUseError as exc:
            if f"{root}/ram/1" not in str(exc) or "in use by another job" not in str(exc):
                problems.append(f"the error does not name the held directory: {exc}")
        for r in (0, 1):
            if os.path.exists(f"{root}/ram/{r}/step-1"):
                problems.append(f"step-1 was written on rank {r}'s directory")
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "MISMATCH")
