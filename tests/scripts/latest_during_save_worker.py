"""Run under ``torchrun --nproc-per-node=2`` (gloo, CPU) by tests/test_multirank.py.

Every rank starts ``dcp.async_save`` through the store's process group and, without waiting for
it, asks ``store.latest()``: both use the store's group, the save's collectives in DCP's thread.
``latest()`` must wait for the save in flight and answer (the checkpoint just saved), not
interleave its collective with the save's, which deadlocks both. The rank's collective timeout
(``[store] collective_timeout``) would end a deadlock in an error.
"""

from __future__ import annotations

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
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = sys.argv[1]
    config = {"store": {"collective_timeout": 20},
              "tier": [{"name": "disk", "backend": "local", "path": f"{root}/disk"}]}
    with tierstore.open(config) as store:
        state = {f"rank{rank}": torch.arange(1 << 20, dtype=torch.float32) + rank,
                 "step": 1}
        for step in (1, 2, 3):
            state["step"] = step
            dcp.async_save(state, storage_writer=store.writer(), checkpoint_id=f"step-{step}",
                           process_group=store.process_group)
            newest = store.latest()  # the save above is still in flight
            if newest != f"step-{step}":
                problems.append(f"latest() during the save of step-{step} said {newest!r}")
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "LATEST")
