"""torchrun worker for 2 simulated nodes x 2 ranks with a peer tier (tests/test_peer.py).

Tiers: "ram" (node-local RAM), "peer" (node-local, replicas over torch.distributed with the
strategy given), and, unless argv says "noobj", "objects" (an fsspec ``file://`` object-store
tier every rank sees); "obj-signed" also signs with the key in $TIERSTORE_TEST_KEY.
argv: ROOT STRATEGY OBJ PHASE [EXPECTED]. PHASE "save" saves step-1..3
and waits for drains and replication; "load" checks latest() == EXPECTED and loads it bitwise,
printing where each file came from; "load-missing" loads EXPECTED and prints the
CheckpointNotFound it expects.
"""

import os
import sys
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.tensor import init_device_mesh

import tierstore
from tierstore import EventKind
from tierstore.events import Phase
from worker_common import (check_equal, check_node_checkpoint, load_expecting_not_found,
                           local_shards, node_state, run_worker)

warnings.filterwarnings("ignore")
problems: list[str] = []
OWN_NUMEL = 5000  # floats of each rank's own in the state

STRATEGIES = {"clique": {"strategy": "clique", "factor": 2, "jump": 2},
              "ring": {"strategy": "ring", "offset": 2}}


class Observer:
    """Records which tier each file was read from, and peer fetches and replications."""

    def __init__(self):
        self.reads, self.fetched, self.replicated = [], [], []

    @tierstore.hookimpl
    def tierstore_phase(self, phase, tier, detail):
        if phase == Phase.READ_FILE:
            self.reads.append((detail["file"], tier))

    @tierstore.hookimpl
    def tierstore_event(self, event):
        if event.kind == EventKind.PEER_FETCHED:
            self.fetched.append((event.detail["file"], event.detail["from"]))
        elif event.kind == EventKind.REPLICATED:
            self.replicated.append((event.checkpoint_id, event.detail["to"],
                                    event.detail["from"]))


def config(root, strategy, obj):
    tiers = [
        {"name": "ram", "backend": "memory", "path": root + "/ram/{node}", "keep": 2},
        # keep 1: step-3's files and replicas go into the pages of step-1's (recycled)
        {"name": "peer", "backend": "peer", "path": root + "/peer/{node}", "keep": 1,
         "replication": STRATEGIES[strategy]},
    ]
    if obj.startswith("obj"):
        tiers.append({"name": "objects", "backend": "fsspec", "url": f"file://{root}/objects"})
    signed = {"signing_key": {"env": "TIERSTORE_TEST_KEY"}} if obj == "obj-signed" else {}
    return {"store": signed, "tier": tiers}


def count_servable_sent() -> dict:
    """Counts, as loads start, the files this rank says it serves and the manifest entries it
    sends with them (what every rank gathers from every rank)."""
    import tierstore.dcp.reader as reader_module

    counts = {"names": 0, "entries": 0}
    gather = reader_module.all_gather_message

    def counting(obj, group, *args, **kwargs):
        # [token, by_token, world, servable], each servable [token, codecs, metadata, files]
        if isinstance(obj, list) and len(obj) == 4 and isinstance(obj[3], list):
            for source in obj[3]:
                counts["names"] += len(source[3])
                counts["entries"] += sum(e is not None for e in source[3].values())
        return gather(obj, group, *args, **kwargs)

    reader_module.all_gather_message = counting
    return counts


class Replanning(DefaultLoadPlanner):
    """DCP's default load planner, whose global plans are new objects holding only the items."""

    def create_global_plan(self, global_plan):
        return [LoadPlan(p.items) for p in super().create_global_plan(global_plan)]


def replica_inodes(root, rank, seen, cid):
    """Inodes of the data files of ``cid``'s replicas this rank holds."""
    node = rank // 2
    out = set()
    for _cid, _to, sources in seen.replicated[-1:]:
        for src in sources:
            d = os.path.join(root, "peer", str(node), ".replicas", f"{src}-held-by-{rank}", cid)
            out |= {os.stat(os.path.join(d, n)).st_ino for n in os.listdir(d)
                    if n.endswith(".distcp")}
    return out


def state(step, rank, mesh, zero=False):
    return node_state(step, rank, mesh, OWN_NUMEL, zero=zero)


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root, strategy, obj, phase = sys.argv[1:5]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    seen = Observer()
    store = tierstore.open(config(root, strategy, obj), plugins=[seen])
    if phase == "save":
        inodes = {}
        for step in (1, 2, 3):
            dcp.save(state(step, rank, mesh), storage_writer=store.writer(),
                     checkpoint_id=f"step-{step}", process_group=store.process_group)
            store.wait()
            inodes[step] = replica_inodes(root, rank, seen, f"step-{step}")
        for cid, to, frm in seen.replicated:
            print(f"RANK {rank} REPLICATED {cid} TO {to} FROM {frm}", flush=True)
        print(f"RANK {rank} RECYCLED {len(inodes[1] & inodes[3])} OF {len(inodes[3])}",
              flush=True)
        dist.barrier()
    elif phase == "load":
        sent = count_servable_sent()
        check_node_checkpoint(store, problems, rank, mesh, sys.argv[5], OWN_NUMEL)
        print(f"RANK {rank} SERVES {sent['names']} FILES WITH {sent['entries']} ENTRIES",
              flush=True)
        for file, tier in sorted(set(seen.reads)):
            print(f"RANK {rank} READ {file} FROM {tier}", flush=True)
        for file, src in sorted(set(seen.fetched)):
            print(f"RANK {rank} FETCHED {file} FROM RANK {src}", flush=True)
        # A planner that builds its global plans anew, as a user's may: what each rank's
        # plan carried to the coordinator (what it asks its peers for) is gone from them,
        # and the ranks exchange it themselves. Same bytes, from the same peers.
        seen.fetched.clear()
        step = int(sys.argv[5].split("-")[1])
        out = state(step, rank, mesh, zero=True)
        dcp.load(out, storage_reader=store.reader(), checkpoint_id=sys.argv[5],
                 planner=Replanning(), process_group=store.process_group)
        check_equal(problems, local_shards(out), local_shards(state(step, rank, mesh)),
                    sys.argv[5] + " (replanned)")
        for file, src in sorted(set(seen.fetched)):
            print(f"RANK {rank} REPLANNED FETCHED {file} FROM RANK {src}", flush=True)
    elif phase == "load-missing":
        load_expecting_not_found(store, problems, rank, state(3, rank, mesh, zero=True),
                                 sys.argv[5])
    store.close()
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
