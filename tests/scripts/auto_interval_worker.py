"""``every = "auto"`` under torchrun: each rank asks ``store.should_save(step)`` every step and
saves when it says so. The ranks measure different step times on purpose (rank 1's steps are
slower): only the coordinator's choice counts, so they must still take the same saves.

argv: ROOT STEPS [two-tiers]. ``two-tiers``: two shared ``local`` tiers, both auto, and
``[store] overwrite = true`` (the Lightning page's setting), where a save's schedule was once
asked on some ranks only and the ranks then took different steps. Prints
``RANK <r> TAKEN <steps, comma-separated>`` and, after loading the
newest checkpoint back, ``RANK <r> OK`` (or the problems found)."""

import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from worker_common import run_worker

import tierstore

problems: list[str] = []


def main() -> int:
    root, steps = sys.argv[1], int(sys.argv[2])
    two_tiers = sys.argv[3:] == ["two-tiers"]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = {"store": {"mtbf_hours": 0.0005, "events_log": f"{root}/events.jsonl"},
              "tier": [{"name": "ram", "backend": "memory", "path": f"{root}/ram", "keep": 2,
                        "every": "auto"}]}
    if two_tiers:
        config["store"]["overwrite"] = True
        config["tier"] = [{"name": name, "backend": "local", "path": f"{root}/{name}",
                           "keep": 2, "every": "auto"} for name in ("fast", "slow")]
    state = {"w": torch.zeros(2_000_000), "step": 0}
    taken = []
    with tierstore.open(config) as store:
        for step in range(1, steps + 1):
            began = time.time()
            state["w"] += 1.0
            time.sleep(0.01 * (1 + rank))
            state["step"] = step
            store.record_step(step, time.time() - began)
            if store.should_save(step):
                dcp.save(state, storage_writer=store.writer(), checkpoint_id=f"step-{step}",
                         process_group=store.process_group)
                taken.append(step)
        print(f"RANK {rank} TAKEN {','.join(map(str, taken))}", flush=True)
        latest = store.latest()
        if latest != f"step-{taken[-1]}":
            problems.append(f"latest() is {latest}, the last save step-{taken[-1]}")
        loaded = {"w": torch.empty(2_000_000), "step": 0}
        dcp.load(loaded, storage_reader=store.reader(), checkpoint_id=latest,
                 process_group=store.process_group)
        if not torch.equal(loaded["w"], torch.full((2_000_000,), float(taken[-1]))):
            problems.append("the newest checkpoint does not hold its step's state")
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "AUTO")
