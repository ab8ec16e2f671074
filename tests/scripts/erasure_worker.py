"""torchrun worker for simulated nodes with a peer tier protected by parity (``erasure``
strategy; tests/test_erasure.py). Ranks per node = torchrun's local world size; the strategy's
jump is that, so a set's members are on different nodes.

Tiers: "ram" (node-local RAM) and "peer" (node-local, ``erasure`` with DATA data members and
parity 1), no shared tier unless argv's OBJ is "obj" ("objects": an fsspec ``file://`` tier).
argv: ROOT DATA OBJ PHASE [EXPECTED [MISSING]]. PHASE "save" saves step-1..3 and waits for the
parity; "save-lose-load" (EXPECTED: a node) saves them, closes the store, deletes that node's
directories (a replaced node), opens the store again, prints ``store.plan`` of step-3 (PLAN
<json>) and loads step-3 as "load" does; "missing-then-shared" does "load-missing", then "load"
with the shared tier configured; "load" checks latest() == EXPECTED and loads it bitwise, printing where each file came
from, then, given MISSING, loads that and prints the CheckpointNotFound it expects;
"load-missing" loads EXPECTED and prints the CheckpointNotFound it expects; "verify-parity"
prints what ``store.verify_parity(EXPECTED)`` finds on each rank, then what it finds with
``repair=True``, then with rank 3's ``members.json`` changed (a file's digest in it: still a
set, no longer the one its manifest seals) what a repair finds (TAMPERED), and puts it back;
"load-survivor-fails" loads EXPECTED (a node lost) while one survivor of its set, rank 3,
cannot read its set's description (an error inside the rebuild), and prints the
CheckpointNotFound every rank must get; "save-killed" saves
step-1 and step-2, then the job is killed while step-3's parity is encoded: ranks 1 and 2 as they
publish their parity, the others once theirs is committed (a mix of complete and missing parity
of step-3 is left behind, beside step-2's complete parity).
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
from tierstore import EventKind
from tierstore.events import Phase
from worker_common import (check_node_checkpoint, load_expecting_not_found, node_state,
                           run_worker)

warnings.filterwarnings("ignore")
problems: list[str] = []
OWN_NUMEL = 50_000  # floats of each rank's own in the state


class Observer:
    """Records which tier each file was read from, peer fetches and parity events."""

    def __init__(self):
        self.reads, self.fetched, self.protected, self.rebuilt = [], [], [], []

    kill_step3 = False

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail):
        if phase == Phase.READ_FILE:
            self.reads.append((detail["file"], tier))
        if (self.kill_step3 and checkpoint_id == "step-3" and rank in (1, 2)
                and phase == Phase.PUBLISH and tier == f"peer:parity-{rank}"):
            print(f"RANK {rank} KILLED PUBLISHING ITS PARITY", flush=True)
            os._exit(9)

    @tierstore.hookimpl
    def tierstore_event(self, event):
        if event.kind == EventKind.PEER_FETCHED:
            self.fetched.append((event.detail["file"], event.detail["from"]))
        elif event.kind == EventKind.REBUILT:
            self.rebuilt.append((event.checkpoint_id, event.tier, event.detail["files"]))
        elif event.kind == EventKind.REPLICATED:
            self.protected.append((event.checkpoint_id, event.detail.get("parity_set"),
                                   event.detail.get("parity_bytes")))
            if self.kill_step3 and event.checkpoint_id == "step-3":
                print(f"RANK {event.rank} KILLED WITH ITS PARITY COMMITTED", flush=True)
                os._exit(9)


def config(root, data, obj, per_node):
    tiers = [
        {"name": "ram", "backend": "memory", "path": root + "/ram/{node}", "keep": 2},
        {"name": "peer", "backend": "peer", "path": root + "/peer/{node}", "keep": 2,
         "replication": {"strategy": "erasure", "data": data, "parity": 1, "jump": per_node}},
    ]
    if obj == "obj":
        tiers.append({"name": "objects", "backend": "fsspec", "url": f"file://{root}/objects"})
    return {"tier": tiers}


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    root, data, obj, phase = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    seen = Observer()
    store = tierstore.open(config(root, data, obj, per_node), plugins=[seen])
    if phase in ("save", "save-killed", "save-lose-load"):
        seen.kill_step3 = phase == "save-killed"
        for step in (1, 2, 3):
            dcp.save(node_state(step, rank, mesh, OWN_NUMEL), storage_writer=store.writer(),
                     checkpoint_id=f"step-{step}", process_group=store.process_group)
            store.wait()
        for cid, members, nbytes in seen.protected:
            print(f"RANK {rank} PROTECTED {cid} SET {members} PARITY {nbytes}", flush=True)
        dist.barrier()
    if phase == "save-lose-load":
        store.close()
        dist.barrier()
        if rank == 0:
            for tier in ("ram", "peer"):
                shutil.rmtree(os.path.join(root, tier, sys.argv[5]))
        dist.barrier()
        store = tierstore.open(config(root, data, obj, per_node), plugins=[seen])
        if rank == 0:
            plan = store.plan("step-3", dist.get_world_size(), per_node)
            print(f"PLAN {json.dumps(plan.to_json())}", flush=True)
        sys.argv[5] = "step-3"
    if phase == "missing-then-shared":
        # EXPECTED cannot load from the nodes alone; then, with the shared tier configured
        # (a store opened again), it loads as "load" does.
        load_expecting_not_found(store, problems, rank,
                                 node_state(3, rank, mesh, OWN_NUMEL, zero=True), sys.argv[5])
        store.close()
        store = tierstore.open(config(root, data, "obj", per_node), plugins=[seen])
    if phase in ("load", "save-lose-load", "missing-then-shared"):
        check_node_checkpoint(store, problems, rank, mesh, sys.argv[5], OWN_NUMEL)
        for file, tier in sorted(set(seen.reads)):
            print(f"RANK {rank} READ {file} FROM {tier}", flush=True)
        for file, src in sorted(set(seen.fetched)):
            print(f"RANK {rank} FETCHED {file} FROM RANK {src}", flush=True)
        for cid, tier, files in seen.rebuilt:
            print(f"RANK {rank} REBUILT {cid} INTO {tier} FILES {files}", flush=True)
        if len(sys.argv) > 6:
            load_expecting_not_found(store, problems, rank,
                                     node_state(3, rank, mesh, OWN_NUMEL, zero=True), sys.argv[6])
    elif phase == "verify-parity":
        for repair in (False, True):
            found = store.verify_parity(sys.argv[5], repair=repair)
            print(f"RANK {rank} {'REPAIR' if repair else 'VERIFY'} {found.state} "
                  f"{found.members} {found.detail}", flush=True)
        dist.barrier()
        members = os.path.join(root, "peer", "3", ".parity", "held-by-3", sys.argv[5],
                               "members.json")
        if rank == 3:
            kept = open(members, "rb").read()
            doc = json.loads(kept)
            entry = next(iter(doc["headers"]["0"]["files"].values()))
            entry["checksum"] = entry["checksum"][:-1] + ("0" if entry["checksum"][-1] != "0"
                                                          else "1")
            with open(members, "w") as f:
                json.dump(doc, f)
        dist.barrier()
        found = store.verify_parity(sys.argv[5], repair=True)
        print(f"RANK {rank} TAMPERED {found.state} {found.members} {found.detail}", flush=True)
        dist.barrier()
        if rank == 3:
            with open(members, "wb") as f:
                f.write(kept)
        dist.barrier()
    elif phase == "load-survivor-fails":
        if rank == 3:
            import tierstore.engine.parity as parity

            def unreadable(raw):
                raise OSError("injected: the set's description cannot be read")

            parity.read_members = unreadable
        load_expecting_not_found(store, problems, rank,
                                 node_state(3, rank, mesh, OWN_NUMEL, zero=True), sys.argv[5])
    elif phase == "load-missing":
        load_expecting_not_found(store, problems, rank,
                                 node_state(3, rank, mesh, OWN_NUMEL, zero=True), sys.argv[5])
    store.close()
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
