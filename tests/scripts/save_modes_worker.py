"""torchrun worker (2 ranks): DCP's save modes that change who plans and commits.

- ``use_collectives=False``: each rank saving its own keys into one id would commit alone; the
  store refuses it on every rank before anything is written, and the previous checkpoint loads.
- plan caching (``DefaultSavePlanner(enable_plan_caching=True)``): ranks whose plan did not
  change get the first save's plan back; every save must still have its own token and load
  bitwise.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

import tierstore
from worker_common import run_worker

problems: list[str] = []


def state(rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return {f"rank{rank}": torch.randn(32, 32, generator=gen), "step": step}


def main() -> int:
    root = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = {"tier": [{"name": "disk", "backend": "local", "path": f"{root}/disk"}]}
    with tierstore.open(config) as store:
        group = store.process_group
        dcp.save(state(rank, 1), storage_writer=store.writer(), checkpoint_id="step-1",
                 process_group=group)
        try:
            dcp.save(state(rank, 2), storage_writer=store.writer(), checkpoint_id="step-2",
                     process_group=group, use_collectives=False)
            problems.append("use_collectives=False was accepted")
        except tierstore.CommitError as exc:
            if "use_collectives=False" not in str(exc) or "Nothing was written" not in str(exc):
                problems.append(f"unclear refusal: {exc}")
        except Exception as exc:  # noqa: BLE001 - anything else is what the test catches
            problems.append(f"use_collectives=False raised {type(exc).__name__}: {exc}")
        dist.barrier()
        left = sorted(os.listdir(f"{root}/disk"))
        if left != ["step-1"]:
            problems.append(f"after the refused save the tier holds {left}")
        if store.latest() != "step-1":
            problems.append(f"latest() is {store.latest()!r} after the refused save")

        # Plan caching: the planner class keeps its cache across saves (and instances).
        tokens = []
        for step in (3, 4, 5):
            planner = DefaultSavePlanner(enable_plan_caching=True)
            dcp.save(state(rank, step), storage_writer=store.writer(),
                     checkpoint_id=f"step-{step}", planner=planner, process_group=group)
            with open(f"{root}/disk/step-{step}/tierstore.json") as f:
                tokens.append(json.load(f)["save_token"])
        if len(set(tokens)) != 3:
            problems.append(f"saves with plan caching share tokens: {tokens}")
        for step in (1, 3, 4, 5):
            out = {f"rank{rank}": torch.zeros(32, 32), "step": 0}
            dcp.load(out, storage_reader=store.reader(), checkpoint_id=f"step-{step}",
                     process_group=group)
            want = state(rank, step)
            if not torch.equal(out[f"rank{rank}"], want[f"rank{rank}"]) or out["step"] != step:
                problems.append(f"step-{step} does not load bitwise")
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
