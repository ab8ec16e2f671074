"""torchrun worker for tests/test_keep_at_rest.py: 4 simulated nodes x 1 rank, what a node holds
at rest after two saves and ``store.wait()``, for three stores one after the other: a ``peer``
tier with ``erasure`` 3+1, a ``peer`` tier with ``clique`` factor 2, and a ``memory`` tier alone,
each with ``keep = 1`` and a directory per node.

argv: ROOT. Prints, for each store and rank, ``RANK <r> <store> HOLDS <bytes> OWN <bytes>
CHECKPOINTS <ids>``: the bytes under its node's directory (recycle bins apart), the size of
its own data file of the newest save, and the checkpoint ids of its own part there."""

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from worker_common import run_worker

import tierstore

warnings.filterwarnings("ignore")
problems: list[str] = []
OWN_NUMEL = 1 << 20  # 4 MiB of this rank's own per save

TIERS = {
    "erasure": {"backend": "peer",
                "replication": {"strategy": "erasure", "data": 3, "parity": 1, "jump": 1}},
    "clique": {"backend": "peer", "replication": {"strategy": "clique", "factor": 2, "jump": 1}},
    "ram": {"backend": "memory"},
}


def tree_bytes(path: str) -> int:
    """Bytes of the files under ``path``, but for the recycle bins (``.recycle``: a peer tier
    keeps the pages of the last evicted checkpoint there for the next save to write into,
    tierstore_plugins.recycle, which its docs count apart)."""
    total = 0
    for d, dirs, files in os.walk(path):
        dirs[:] = [x for x in dirs if x != ".recycle"]
        total += sum(os.path.getsize(os.path.join(d, f)) for f in files)
    return total


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = os.environ["GROUP_RANK"]
    root = sys.argv[1]
    for name, tier in TIERS.items():
        config = {"tier": [{"name": "t", "path": f"{root}/{name}/{{node}}", "keep": 1, **tier}]}
        with tierstore.open(config) as store:
            for step in (1, 2):
                state = {f"own{rank}": torch.full((OWN_NUMEL,), float(step * 10 + rank))}
                dcp.save(state, storage_writer=store.writer(), checkpoint_id=f"step-{step}",
                         process_group=store.process_group)
            store.wait()
            dist.barrier()
            mine = os.path.join(root, name, node)
            own = os.path.getsize(os.path.join(mine, "step-2", f"__{rank}_0.distcp"))
            ids = sorted(e for e in os.listdir(mine) if e.startswith("step-"))
            print(f"RANK {rank} {name} HOLDS {tree_bytes(mine)} OWN {own} "
                  f"CHECKPOINTS {','.join(ids)}", flush=True)
            dist.barrier()
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
