"""torchrun worker for a job of 2 simulated nodes x 2 ranks (tests/test_node_local.py).

Tiers: "ram" is node-local (``{node}`` in its path), "shared" is one directory every rank sees.
argv: ROOT PHASE [EXPECTED_LATEST]. PHASE "save" saves step-1 and step-2 and waits for the
drains, printing which files each rank copied to which tier; PHASE "load" checks latest() and loads it bitwise, printing which tier each rank read
each file from.
"""

import os
import sys
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import init_device_mesh

import tierstore
from tierstore.events import Phase
from worker_common import check_node_checkpoint, node_state, run_worker

warnings.filterwarnings("ignore")
problems: list[str] = []
OWN_NUMEL = 1000  # floats of each rank's own in the state


class Reads:
    """Records (file, tier) of every file this rank reads, and of every file it copies to a
    slower tier."""

    def __init__(self):
        self.reads = []
        self.drained = []

    @tierstore.hookimpl
    def tierstore_phase(self, phase, tier, detail):
        if phase == Phase.READ_FILE:
            self.reads.append((detail["file"], tier))
        if phase == Phase.DRAIN_FILE:
            self.drained.append((detail["file"], tier))


def config(root):
    return {"tier": [
        {"name": "ram", "backend": "memory", "path": root + "/ram/{node}", "keep": 2},
        {"name": "shared", "backend": "local", "path": root + "/shared"},
    ]}


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root, phase = sys.argv[1], sys.argv[2]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reads = Reads()
    store = tierstore.open(config(root), plugins=[reads])
    node = int(os.environ["GROUP_RANK"])
    print(f"RANK {rank} NODE {node} RAM PART {store._ctx.tiers[0].layout.part} OF "
          f"{store._ctx.tiers[0].layout.parts}", flush=True)
    if phase == "save":
        for step in (1, 2):
            dcp.save(node_state(step, rank, mesh, OWN_NUMEL), storage_writer=store.writer(),
                     checkpoint_id=f"step-{step}", process_group=store.process_group)
        store.wait()
        for file, tier in sorted(set(reads.drained)):
            print(f"RANK {rank} DRAINED {file} TO {tier}", flush=True)
        dist.barrier()
        latest = store.latest()
        if latest != "step-2":
            problems.append(f"latest() is {latest!r} after saving, expected 'step-2'")
    else:
        check_node_checkpoint(store, problems, rank, mesh, sys.argv[3], OWN_NUMEL,
                              load_latest=True)
        for file, tier in sorted(set(reads.reads)):
            print(f"RANK {rank} READ {file} FROM {tier}", flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
