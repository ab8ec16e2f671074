"""torchrun worker (2 ranks): DDP-style replicated state on a node-local tier (a directory per
rank). Both ranks save the same plain tensors, which DCP writes once, in one rank's file; each
rank then loads the whole state, bitwise (tests/test_replicated_state.py).

argv: ROOT [MODE]. MODE "budget": the save is a lazy ``dcp.async_save`` whose staging budget is
a quarter of the state, so every rank spills every tensor in waves to its own tier and DCP's plan
then has each rank write only the replicated items it was given."""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tierstore
from worker_common import run_worker

problems: list[str] = []


def state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {"model": {"weight": torch.randn(64, 64, generator=gen),
                      "bias": torch.randn(64, generator=gen)},
            "step": step}


def main() -> int:
    root = sys.argv[1]
    dist.init_process_group("gloo")
    budget = len(sys.argv) > 2 and sys.argv[2] == "budget"
    config = {"tier": [{"name": "ram", "backend": "memory", "path": f"{root}/ram/{{rank}}"}]}
    if budget:
        config["store"] = {"staging": {"name": "cpu", "lazy": True,
                                       "max_staging_bytes": (64 * 64 + 64) * 4 // 4}}
    with tierstore.open(config) as store:
        group = store.process_group
        if budget:
            dcp.async_save(state(3), storage_writer=store.writer(), checkpoint_id="step-3",
                           process_group=group).upload_completion.result()
        else:
            dcp.save(state(3), storage_writer=store.writer(), checkpoint_id="step-3",
                     process_group=group)
        if store.latest() != "step-3":
            problems.append(f"latest() is {store.latest()!r}, not 'step-3'")
        out = {"model": {"weight": torch.zeros(64, 64), "bias": torch.zeros(64)}, "step": 0}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-3",
                 process_group=group)
        want = state(3)
        for key in ("weight", "bias"):
            if not torch.equal(out["model"][key], want["model"][key]):
                problems.append(f"MISMATCH in model.{key}")
        if out["step"] != 3:
            problems.append(f"MISMATCH step {out['step']}")
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
