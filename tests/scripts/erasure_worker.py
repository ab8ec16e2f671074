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
CheckpointNotFound every rank must get; "flipped-survivor" saves step-1, deletes node 2's
directories and flips one byte of rank 1's data file on both of its tiers (in a block of its own
tensor that no other rank reads, in a piece rank 2's parity covered: rank 2's rebuild does not
read it), then loads step-1 into zeroed
tensors: every rank's load must fail (FLIPPED <its own error>) and leave its state as it was;
then deletes node 0's directories too (rank 0's files cannot be rebuilt: node 2's parity is
gone) and prints the CheckpointNotFound every rank must get; "save-killed" saves
step-1 and step-2, then the job is killed while step-3's parity is encoded: ranks 1 and 2 as they
publish their parity, the others once theirs is committed (a mix of complete and missing parity
of step-3 is left behind, beside step-2's complete parity).
"""

import copy
import json
import os
import shutil
import sys
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import init_device_mesh

import tierstore
from tierstore import EventKind
from tierstore.events import Phase
from tierstore.format.metadata import load_metadata
from tierstore.tiers.parity_sets import read_members
from worker_common import (check_equal, check_node_checkpoint, load_expecting_not_found,
                           local_shards, node_state, run_worker)

warnings.filterwarnings("ignore")
problems: list[str] = []
OWN_NUMEL = 50_000  # floats of each rank's own in the state
#: "flipped-survivor": a tensor of several blocks (128 KiB each), so that one holds nothing
#: another rank's load reads
FLIPPED_OWN_NUMEL = 400_000


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


def flip_where_only_it_reads(root: str, member: int, lost: int) -> str:
    """Flip one byte of ``member``'s data file on both of its node's tiers: in a block of the
    file holding nothing but ``member``'s own tensor (no other rank's load reads that block),
    and in a piece of the file that ``lost``'s parity chunk covers (a rebuild of ``lost`` does
    not read it). The file's name, or "" when no byte is both."""
    with open(os.path.join(root, "peer", str(member), ".parity", f"held-by-{member}", "step-1",
                           "members.json"), "rb") as f:
        found = read_members(f.read())
    with open(os.path.join(root, "ram", "0", "step-1", ".metadata"), "rb") as f:
        metadata = load_metadata(f.read(), "the test's copy")
    info = next(i for k, i in metadata.storage_data.items() if k.fqn == f"rank{member}")
    rel = info.relative_path
    with open(os.path.join(root, "peer", str(member), "step-1", "tierstore.json")) as f:
        block = json.load(f)["files"][rel]["block_bytes"]
    lo = -(-info.offset // block) * block  # whole blocks of the tensor only
    hi = (info.offset + info.length) // block * block
    at = next(((max(lo, off) + min(hi, off + size)) // 2
               for name, off, size, _ in found.pieces(member, lost)
               if name == rel and max(lo, off) < min(hi, off + size)), None)
    if at is None:
        return ""
    for tier in ("ram", "peer"):
        with open(os.path.join(root, tier, str(member), "step-1", rel), "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 1]))
    return rel


def flipped_survivor(store, root, data, obj, per_node, rank, mesh, seen):
    """The "flipped-survivor" phase (see the module's docstring); the store it leaves open."""
    own = FLIPPED_OWN_NUMEL
    dcp.save(node_state(1, rank, mesh, own), storage_writer=store.writer(),
             checkpoint_id="step-1", process_group=store.process_group)
    store.wait()
    store.close()
    dist.barrier()
    if rank == 0:
        for tier in ("ram", "peer"):
            shutil.rmtree(os.path.join(root, tier, "2"))
        print(f"FLIPPED FILE {flip_where_only_it_reads(root, 1, 2) or None}", flush=True)
    dist.barrier()
    store = tierstore.open(config(root, data, obj, per_node), plugins=[seen])
    dest = node_state(1, rank, mesh, own, zero=True)
    before = copy.deepcopy(local_shards(dest))
    try:
        dcp.load(dest, storage_reader=store.reader(), checkpoint_id="step-1",
                 process_group=store.process_group)
        problems.append("the load with a flipped byte in rank 1's file succeeded")
    except CheckpointException as exc:
        failed = exc.failures.get(rank)  # this rank's own error (DCP gathers every rank's)
        message = " ".join(str(failed[0]).split()) if failed is not None else ""
        print(f"RANK {rank} FLIPPED {type(failed[0]).__name__ if failed else None}: {message}",
              flush=True)
    check_equal(problems, local_shards(dest), before, "the state after the failed load")
    for cid, tier, files in seen.rebuilt:
        print(f"RANK {rank} REBUILT {cid} INTO {tier} FILES {files}", flush=True)
    store.close()
    dist.barrier()
    if rank == 0:
        for tier in ("ram", "peer"):
            shutil.rmtree(os.path.join(root, tier, "0"))
    dist.barrier()
    store = tierstore.open(config(root, data, obj, per_node), plugins=[seen])
    load_expecting_not_found(store, problems, rank, node_state(1, rank, mesh, own, zero=True),
                             "step-1")
    return store


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
    elif phase == "flipped-survivor":
        store = flipped_survivor(store, root, data, obj, per_node, rank, mesh, seen)
    elif phase == "load-missing":
        load_expecting_not_found(store, problems, rank,
                                 node_state(3, rank, mesh, OWN_NUMEL, zero=True), sys.argv[5])
    store.close()
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
