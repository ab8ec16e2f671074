"""torchrun worker for tests/test_node_local.py's drain to a node-local tier with other codecs:
2 simulated nodes x 1 rank, a node-local ``memory`` tier (no codecs) and behind it a node-local
``local`` tier with ``codecs = ["zstd"]``: each node drains (re-encodes) its own part.

argv: ROOT. Saves step-1 and step-2, then ``store.wait()`` (``RANK <r> WAITED``, or a problem
naming what it raised); closes the store, removes its node's memory tier, and opens the zstd
tier alone: ``latest()`` and a bitwise load of both checkpoints from it. Prints ``RANK <r> PART
<id> CODECS <codecs> METADATA <yes|no>`` for its node's part of each id on the zstd tier.
"""

import json
import os
import shutil
import sys
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import init_device_mesh

import tierstore
from worker_common import check_node_steps, node_state, run_worker

warnings.filterwarnings("ignore")
problems: list[str] = []
OWN_NUMEL = 4096  # zeros and a pattern: what zstd makes smaller


def config(root: str, *, fast: bool) -> dict:
    tiers = [{"name": "disk", "backend": "local", "path": root + "/disk/{node}",
              "codecs": ["zstd"]}]
    if fast:
        tiers.insert(0, {"name": "ram", "backend": "memory", "path": root + "/ram/{node}"})
    return {"store": {"part_timeout": 60, "collective_timeout": 60}, "tier": tiers}


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = sys.argv[1]
    node = os.environ.get("GROUP_RANK", "0")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    store = tierstore.open(config(root, fast=True))
    for step in (1, 2):
        dcp.save(node_state(step, rank, mesh, OWN_NUMEL), storage_writer=store.writer(),
                 checkpoint_id=f"step-{step}", process_group=store.process_group)
    try:
        store.wait()
        print(f"RANK {rank} WAITED", flush=True)
    except Exception as exc:  # noqa: BLE001 - every rank reports, then the test fails
        problems.append(f"store.wait() raised {type(exc).__name__}: {exc}")
    store.close()
    dist.barrier()
    for step in (1, 2):
        path = os.path.join(root, "disk", node, f"step-{step}", "tierstore.json")
        if os.path.exists(path):
            with open(path) as f:
                part = json.load(f)
            print(f"RANK {rank} PART step-{step} CODECS {','.join(part['codecs'])} METADATA "
                  f"{'yes' if '.metadata' in part['files'] else 'no'}", flush=True)
    # This node's memory is lost (a restart): only the zstd tier is left to load from.
    shutil.rmtree(os.path.join(root, "ram", node), ignore_errors=True)
    dist.barrier()
    store = tierstore.open(config(root, fast=False))
    latest = store.latest()
    if latest != "step-2":
        problems.append(f"latest() on the zstd tier alone is {latest!r}, expected 'step-2'")
    check_node_steps(store, problems, rank, mesh, (1, 2), OWN_NUMEL, "the zstd tier")
    dist.barrier()
    store.close()
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
