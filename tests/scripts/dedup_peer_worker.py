"""torchrun worker for 2 simulated nodes x 1 rank: a RAM tier and a peer tier (clique, factor
2), both with ``dedup = true`` (tests/test_dedup_multirank.py).

Each rank's state is a frozen part (4 MiB, its own) and an adapter (64 KiB) that changes every
step. PHASE ``save`` saves step-1..3, each followed by ``store.wait(all_ranks=True)``, and prints
what each replication moved, from the ``replicated`` events::

    RANK <r> REPLICATED <id> SENT <bytes> RECEIVED <bytes>

PHASE ``load`` (after the test removed node 1's directories) loads step-3 on every rank and
checks it bit for bit; node 1's rank gets its files from its replicas on node 0.

argv: ROOT PHASE
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore import EventKind
from worker_common import run_worker

problems: list[str] = []
FROZEN, ADAPTER = (1024, 1024), (16, 1024)


def state(rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(1000 + rank)
    return {f"frozen.{rank}": torch.randn(*FROZEN, generator=gen),
            f"adapter.{rank}": torch.full(ADAPTER, float(step * 10 + rank)),
            "step": step}


def config(root: str) -> dict:
    return {"tier": [
        {"name": "ram", "backend": "memory", "path": root + "/ram/{node}", "keep": 2,
         "dedup": True},
        {"name": "peer", "backend": "peer", "path": root + "/peer/{node}", "keep": 2,
         "dedup": True, "replication": {"strategy": "clique", "factor": 2}}]}


class Replications:
    """Records the ``replicated`` events."""

    def __init__(self):
        self.seen = []

    @tierstore.hookimpl
    def tierstore_event(self, event):
        if event.kind == EventKind.REPLICATED:
            self.seen.append((event.checkpoint_id, event.detail["sent"],
                              event.detail["received"]))


def main() -> int:
    root, phase = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    observer = Replications()
    with tierstore.open(config(root), plugins=[observer]) as store:
        if phase == "save":
            for step in (1, 2, 3):
                dcp.save(state(rank, step), storage_writer=store.writer(),
                         checkpoint_id=f"step-{step}", process_group=store.process_group)
                store.wait(all_ranks=True)
            for cid, sent, received in observer.seen:
                print(f"RANK {rank} REPLICATED {cid} SENT {sent} RECEIVED {received}",
                      flush=True)
        else:
            want = state(rank, 3)
            got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
                   for k, v in want.items()}
            latest = store.latest()
            if latest != "step-3":
                problems.append(f"latest() is {latest}, not step-3")
            dcp.load(got, storage_reader=store.reader(), checkpoint_id="step-3",
                     process_group=store.process_group)
            for key, value in want.items():
                same = torch.equal(got[key], value) if isinstance(value, torch.Tensor) \
                    else got[key] == value
                if not same:
                    problems.append(f"{key} differs after the load")
            print(f"RANK {rank} LOADED step-3", flush=True)
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "DEDUP-PEER")
