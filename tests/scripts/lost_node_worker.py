"""torchrun worker for 2 simulated nodes x 2 ranks: node-local RAM and a peer tier (clique,
factor 2, jump 2), no shared tier. Each rank saves a tensor of its own and the replicated
``{"step": n}`` that DCP writes once, in one rank's file (tests/test_replicated_state.py).
argv: ROOT PHASE. "save" saves step-1 and step-2 and waits for replication; "load" (after a
node is lost) checks latest() and loads step-2 bitwise on every rank."""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tierstore
from worker_common import run_worker

problems: list[str] = []


def config(root: str) -> dict:
    return {"tier": [
        {"name": "ram", "backend": "memory", "path": root + "/ram/{node}"},
        {"name": "peer", "backend": "peer", "path": root + "/peer/{node}",
         "replication": {"strategy": "clique", "factor": 2, "jump": 2}},
    ]}


def state(step: int, rank: int) -> dict:
    gen = torch.Generator().manual_seed(step * 10 + rank)
    return {f"rank{rank}": torch.randn(1000, generator=gen), "step": step}


def main() -> int:
    root, phase = sys.argv[1:3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with tierstore.open(config(root)) as store:
        group = store.process_group
        if phase == "save":
            for step in (1, 2):
                dcp.save(state(step, rank), storage_writer=store.writer(),
                         checkpoint_id=f"step-{step}", process_group=group)
                store.wait()
        else:
            latest = store.latest()
            if latest != "step-2":
                problems.append(f"latest() is {latest!r}, not 'step-2'")
            out = {f"rank{rank}": torch.zeros(1000), "step": 0}
            dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-2",
                     process_group=group)
            want = state(2, rank)
            if not torch.equal(out[f"rank{rank}"], want[f"rank{rank}"]):
                problems.append(f"MISMATCH in rank{rank}")
            if out["step"] != 2:
                problems.append(f"MISMATCH step {out['step']}")
        dist.barrier(group)
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
