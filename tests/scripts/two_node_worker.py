"""torchrun worker for a job of 2 simulated nodes x 2 ranks (tests/test_node_local.py).

Tiers: "ram" is node-local (``{node}`` in its path), "shared" is one directory every rank sees.
argv: ROOT PHASE [EXPECTED_LATEST]. PHASE "save" saves step-1 and step-2 and waits for the
drains; PHASE "load" checks latest() and loads it bitwise, printing which tier each rank read
each file from.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import tierstore
from tierstore.events import Phase
from worker_exit import run_worker

warnings.filterwarnings("ignore")
problems: list[str] = []


class Reads:
    """Records (file, tier) of every file this rank reads."""

    def __init__(self):
        self.reads = []

    @tierstore.hookimpl
    def tierstore_phase(self, phase, tier, detail):
        if phase == Phase.READ_FILE:
            self.reads.append((detail["file"], tier))


def config(root):
    return {"tier": [
        {"name": "ram", "backend": "memory", "path": root + "/ram/{node}", "keep": 2},
        {"name": "shared", "backend": "local", "path": root + "/shared"},
    ]}


def state(step, rank, mesh, zero=False):
    gen = torch.Generator().manual_seed(step)
    full = torch.randn(64, 32, generator=gen)
    replicated = torch.randn(10, generator=gen)
    mine = torch.randn(1000, generator=torch.Generator().manual_seed(step * 10 + rank))
    if zero:
        full, replicated, mine = torch.zeros_like(full), torch.zeros_like(replicated), \
            torch.zeros_like(mine)
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "replicated": replicated,
            f"rank{rank}": mine, "step": 0 if zero else step}


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
            dcp.save(state(step, rank, mesh), storage_writer=store.writer(),
                     checkpoint_id=f"step-{step}", process_group=store.process_group)
        store.wait()
        dist.barrier()
        latest = store.latest()
        if latest != "step-2":
            problems.append(f"latest() is {latest!r} after saving, expected 'step-2'")
    else:
        expected = sys.argv[3]
        latest = store.latest()
        print(f"RANK {rank} LATEST {latest}", flush=True)
        if latest != expected:
            problems.append(f"latest() is {latest!r}, expected {expected!r}")
        step = int(latest.split("-")[1])
        out = state(step, rank, mesh, zero=True)
        dcp.load(out, storage_reader=store.reader(), checkpoint_id=latest,
                 process_group=store.process_group)
        want = state(step, rank, mesh)
        if not torch.equal(out["w"].to_local(), want["w"].to_local()):
            problems.append("w (local shard) differs")
        if not torch.equal(out["replicated"], want["replicated"]):
            problems.append("replicated differs")
        if not torch.equal(out[f"rank{rank}"], want[f"rank{rank}"]):
            problems.append(f"rank{rank} differs")
        if out["step"] != step:
            problems.append(f"step is {out['step']}")
        for file, tier in sorted(set(reads.reads)):
            print(f"RANK {rank} READ {file} FROM {tier}", flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
