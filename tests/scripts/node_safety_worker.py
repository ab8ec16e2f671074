"""torchrun worker for tests/test_node_local_safety.py: 2 simulated nodes x 2 ranks, a node-local
RAM tier (``keep = 1``) and, for the drain scenarios, a shared ``fsspec`` ``file://`` tier
(``manifest-last``, no rename: what an object store does).

argv: ROOT ACTION, or ROOT ACTION,ACTION,... to run several in one launch, each in ROOT/ACTION
and each of its lines printed as ``[ACTION] <line>``. Actions:

- ``crash``: save step-1, then step-2 with rank 0 killed (SIGKILL) in ``finish``, right before
  it writes DCP's ``.metadata``: the other node has written its part of step-2 by then.
- ``recover``: a fresh job after ``crash``: latest() and a bitwise load of step-1 from RAM, then
  step-2 saved again under the same id and loaded bitwise.
- ``stale``: ``overwrite = true``; ``ck`` saved with step 1's state, then again with step 2's,
  and rank 0 fails in ``finish`` of the second save (node 1's part is then of the second save,
  node 0's of the first). Each rank prints what latest() says and what a load of ``ck`` gave:
  ``LOADED 1``, ``LOADED 2``, ``LOADED MIXED`` or ``LOAD FAILED``.
- ``corrupt``: step-1 saved; rank 2 flips a byte of its node's copy of ``__2_0.distcp`` (size
  unchanged) right before it drains its part to the shared tier; each rank prints what
  ``store.wait()`` raised.
- ``order``: step-1 saved; rank 0 starts its drain to the shared tier 3 s late, after rank 2
  has started its own; each rank prints when it copied its first file.
- ``torn``: step-1 saved; when node 1's leader (rank 2) copies its first file to the shared
  tier, it first leaves its part report there cut short (what rank 0 reads when it looks while
  the report is being written) and waits 3 s before going on: rank 0 must wait for the whole
  report, not fail the copy.
- ``overwrite``: ``overwrite = true``; ``ck`` saved with step 1's state and drained to the
  shared tier, then saved again with step 2's and drained again (each rank copies its own
  files, while its node's old part of ``ck`` may still be there); then every node's RAM tier
  is removed and ``ck`` must load bitwise as step 2 from the shared tier alone.
- ``damage`` (``keep = 3``): step-1, step-2 and step-3 saved; then rank 0 removes one file of
  node 0's part of step-2 and rank 2 removes node 1's whole part of step-3 (a node replaced
  with its RAM tier lost): neither id can load any more.
- ``resave``: a fresh job after ``damage``: latest() must be step-1; saving step-1 again is
  refused (``RANK <r> REFUSED <message>``); step-2 and step-3 are saved again with new data
  (the states of steps 102 and 103) and each loads bitwise as the new data.
- ``backtoback``: no fault. A RAM tier and a disk tier per node (no ``keep``), eight saves of
  4 MiB per rank back to back (no wait between them), then ``store.wait()``. Each node's leader
  then removes its node's RAM tier (a node restarted with its memory lost), and a fresh store
  loads every one of the eight checkpoints bitwise from the disk tiers alone; a part collected
  as an orphan prints ``RANK <r> COLLECTED ORPHAN <id>``.
"""

import os
import shutil
import sys
import time
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import init_device_mesh

import tierstore
from tierstore.errors import CommitError, DrainError
from tierstore.events import Phase
from worker_common import (check_equal, check_node_checkpoint, check_node_steps, local_shards,
                           node_state, run_worker)

warnings.filterwarnings("ignore")
problems: list[str] = []
OWN_NUMEL = 1000


class Faults:
    """Strikes at a named phase of this rank (see the actions above)."""

    def __init__(self, root: str, action: str, rank: int):
        self.root, self.action, self.rank = root, action, rank
        self.saves = 0
        self.first_file: float | None = None
        self.collected: list[str] = []

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail):
        if phase == Phase.WRITE_METADATA and self.rank == 0:
            if self.action == "crash" and checkpoint_id == "step-2":
                sys.stdout.flush()
                os.kill(os.getpid(), 9)
            if self.action == "stale" and self.saves == 2:
                raise RuntimeError("the coordinator fails in finish")
        if phase == Phase.DRAIN_BEGIN and tier == "shared":
            if self.action == "corrupt" and self.rank == 2:
                path = os.path.join(self.root, "ram", "1", checkpoint_id, "__2_0.distcp")
                with open(path, "r+b") as f:
                    byte = f.read(1)
                    f.seek(0)
                    f.write(bytes([byte[0] ^ 0xFF]))
            if self.action == "order" and self.rank == 0:
                time.sleep(3)
                print(f"RANK 0 DRAIN STARTS {time.time():.3f}", flush=True)
        if phase == Phase.DRAIN_FILE and tier == "shared" and self.first_file is None:
            if self.action == "torn" and self.rank == 2:
                report = os.path.join(self.root, "shared", checkpoint_id,
                                      ".tierstore-rank-2.json")
                with open(report, "w") as f:
                    f.write('{"ok": true, "fi')
                time.sleep(3)
            self.first_file = time.time()
            print(f"RANK {self.rank} FIRST FILE {self.first_file:.3f}", flush=True)

    @tierstore.hookimpl
    def tierstore_event(self, event):
        if event.kind == "collected" and event.detail.get("orphan_part"):
            print(f"RANK {self.rank} COLLECTED ORPHAN {event.checkpoint_id}", flush=True)


def config(root: str, action: str) -> dict:
    tiers = [{"name": "ram", "backend": "memory", "path": root + "/ram/{node}", "keep": 1}]
    if action in ("corrupt", "order", "torn", "overwrite"):
        tiers.append({"name": "shared", "backend": "fsspec", "url": f"file://{root}/shared"})
    if action in ("damage", "resave"):
        tiers[0]["keep"] = 3
    if action in ("crash", "recover", "backtoback"):
        # A slower node-local tier: each node drains its own part to it.
        tiers.append({"name": "disk", "backend": "local", "path": root + "/disk/{node}",
                      "keep": 1})
    if action == "backtoback":
        for tier in tiers:
            del tier["keep"]
    store = {"part_timeout": 60, "collective_timeout": 60}
    if action in ("stale", "overwrite"):
        store["overwrite"] = True
    return {"store": store, "tier": tiers}


def save(store, faults, mesh, rank, cid, step, own_numel=OWN_NUMEL):
    faults.saves += 1
    dcp.save(node_state(step, rank, mesh, own_numel), storage_writer=store.writer(),
             checkpoint_id=cid, process_group=store.process_group)


class _Tagged:
    """stdout with every line an action printed tagged ``[ACTION] `` (several actions in one
    launch: the test reads each one's lines apart)."""

    def __init__(self, stream, tag: str):
        self.stream, self.tag, self.at_line_start = stream, tag, True

    def write(self, text: str) -> int:
        for piece in text.splitlines(keepends=True):
            if self.at_line_start:
                self.stream.write(self.tag)
            self.stream.write(piece)
            self.at_line_start = piece.endswith("\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root, actions = sys.argv[1], sys.argv[2].split(",")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if len(actions) == 1:
        run_action(root, actions[0], rank, mesh)
        return 0
    # Several actions, one after the other, each in ROOT/ACTION with a store of its own: one
    # launch instead of one per action (a launch of 2 nodes x 2 ranks costs seconds of CPU).
    plain = sys.stdout
    for action in actions:
        if rank == 0:
            os.makedirs(os.path.join(root, action))
        dist.barrier()
        sys.stdout = _Tagged(plain, f"[{action}] ")
        try:
            run_action(os.path.join(root, action), action, rank, mesh)
        finally:
            sys.stdout = plain
        dist.barrier()
    return 0


def run_action(root: str, action: str, rank: int, mesh) -> None:
    """One action (see the module's docstring) on its own store, closed at the end."""
    faults = Faults(root, action, rank)
    store = tierstore.open(config(root, action), plugins=[faults])
    if action == "crash":
        save(store, faults, mesh, rank, "step-1", 1)
        store.wait()
        dist.barrier()
        save(store, faults, mesh, rank, "step-2", 2)  # rank 0 dies in it; the others fail
    elif action == "recover":
        check_node_checkpoint(store, problems, rank, mesh, "step-1", OWN_NUMEL)
        save(store, faults, mesh, rank, "step-2", 2)
        store.wait()  # the drains of step-2 to the disk tier (an orphan there is no obstacle)
        check_node_checkpoint(store, problems, rank, mesh, "step-2", OWN_NUMEL)
    elif action == "stale":
        save(store, faults, mesh, rank, "ck", 1)
        try:
            save(store, faults, mesh, rank, "ck", 2)
            problems.append("the second save of ck did not fail")
        except CheckpointException as exc:  # on every rank (DCP's, a BaseException)
            print(f"RANK {rank} SECOND SAVE FAILED {type(exc).__name__}", flush=True)
        print(f"RANK {rank} LATEST {store.latest()}", flush=True)
        out = node_state(1, rank, mesh, OWN_NUMEL, zero=True)
        try:
            dcp.load(out, storage_reader=store.reader(), checkpoint_id="ck",
                     process_group=store.process_group)
        except Exception as exc:  # noqa: BLE001
            print(f"RANK {rank} LOAD FAILED {type(exc).__name__}: {exc}", flush=True)
        else:
            got = {k: v for k, v in local_shards(out).items() if k != "step"}
            which = [s for s in (1, 2) if all(
                got[k].equal(v)
                for k, v in local_shards(node_state(s, rank, mesh, OWN_NUMEL)).items()
                if k != "step")]
            print(f"RANK {rank} LOADED {which[0] if which else 'MIXED'}", flush=True)
    elif action == "damage":
        for step in (1, 2, 3):
            save(store, faults, mesh, rank, f"step-{step}", step)
        store.wait()
        dist.barrier()
        if rank == 0:
            os.remove(os.path.join(root, "ram", "0", "step-2", "__0_0.distcp"))
        if rank == 2:
            shutil.rmtree(os.path.join(root, "ram", "1", "step-3"))
        dist.barrier()
    elif action == "resave":
        latest = store.latest()
        print(f"RANK {rank} LATEST {latest}", flush=True)
        try:
            save(store, faults, mesh, rank, "step-1", 101)
            problems.append("saving step-1 again was not refused")
        except CommitError as exc:
            print(f"RANK {rank} REFUSED {exc}", flush=True)
        for step in (2, 3):
            cid = f"step-{step}"
            save(store, faults, mesh, rank, cid, 100 + step)
            out = node_state(100 + step, rank, mesh, OWN_NUMEL, zero=True)
            dcp.load(out, storage_reader=store.reader(), checkpoint_id=cid,
                     process_group=store.process_group)
            check_equal(problems, local_shards(out),
                        local_shards(node_state(100 + step, rank, mesh, OWN_NUMEL)), cid)
            print(f"RANK {rank} RESAVED {cid}", flush=True)
        store.wait()
        dist.barrier()
    elif action == "backtoback":
        numel = 1 << 20  # 4 MiB of this rank's own per save
        for step in range(1, 9):
            save(store, faults, mesh, rank, f"step-{step}", step, numel)
        store.wait()
        store.close()
        dist.barrier()
        if int(os.environ["LOCAL_RANK"]) == 0:
            shutil.rmtree(os.path.join(root, "ram", os.environ.get("GROUP_RANK", "0")))
        dist.barrier()
        store = tierstore.open(config(root, action), plugins=[faults])
        check_node_steps(store, problems, rank, mesh, range(1, 9), numel, "the disk tiers")
        dist.barrier()
    elif action == "overwrite":
        for step in (1, 2):
            save(store, faults, mesh, rank, "ck", step)
            store.wait()  # raises the drain's failure, if any
        store.close()
        dist.barrier()
        if int(os.environ["LOCAL_RANK"]) == 0:
            shutil.rmtree(os.path.join(root, "ram", os.environ.get("GROUP_RANK", "0")))
        dist.barrier()
        store = tierstore.open(config(root, action), plugins=[faults])
        out = node_state(2, rank, mesh, OWN_NUMEL, zero=True)
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="ck",
                 process_group=store.process_group)
        check_equal(problems, local_shards(out),
                    local_shards(node_state(2, rank, mesh, OWN_NUMEL)), "ck")
        print(f"RANK {rank} OVERWRITTEN", flush=True)
        dist.barrier()
    elif action in ("corrupt", "order", "torn"):
        save(store, faults, mesh, rank, "step-1", 1)
        try:
            store.wait()
            print(f"RANK {rank} DRAINED", flush=True)
        except DrainError as exc:
            print(f"RANK {rank} DRAIN ERROR: {exc}", flush=True)
        dist.barrier()
    store.close()


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
