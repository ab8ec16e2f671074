"""torchrun worker (1 node x 2 ranks) for tests/test_load_atomicity.py: a load that fails on one
rank leaves every rank's state dict as it was.

    torchrun --nproc-per-node=2 load_atomicity_worker.py ROOT

For each layout in turn, a store of two tiers, ``ram`` (memory) and ``disk`` (local): ``shared``
(one directory per tier for both ranks) and ``per-rank`` (``{rank}`` in the paths: node-local
tiers, a load that may fetch from peers). Each rank saves its own tensors (large ones, read
straight into their destinations, and small ones, copied from read windows) and a value that is
not a tensor, as ``step-1``; then rank 1 flips one byte of its data file on both tiers, and every
rank loads ``step-1`` into a state of other values. The load must raise on both ranks, each
rank's own error naming that file (printed as ``RANK <r> <layout> FAILED <class>: <message>``),
and leave each rank's state bitwise as it was. Once the byte is put back, the same store loads
``step-1`` bitwise (the ranks' collectives still pair up), and with shared tiers rank 1 alone
exports it (a load DCP runs in one process: no rank to agree with, none waited for); with a
directory per rank, rank 1 then deletes that file from both tiers, and the load must raise
``CheckpointNotFound`` on both ranks (``RANK <r> per-rank DELETED <message>``). Prints one line
per problem and exits 1 when there is any; "RANK <r> OK" otherwise.
"""

from __future__ import annotations

import copy
import glob
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tierstore
from worker_common import check_equal, run_worker

warnings.filterwarnings("ignore")
problems: list[str] = []
CID = "step-1"


def state(rank: int, seed: int) -> dict:
    """This rank's own items only (no rank reads another's file): tensors of both read paths
    and a non-tensor value."""
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    sd = {f"r{rank}.large{i}": torch.randn(1 << 16, generator=gen) for i in range(3)}
    sd.update({f"r{rank}.small{i}": torch.randn(50, generator=gen) for i in range(20)})
    sd[f"r{rank}.extra"] = {"seed": seed, "names": [f"run-{seed}"]}
    return sd


def config(root: str, layout: str) -> dict:
    per = "/{rank}" if layout == "per-rank" else ""
    # A short collective timeout: a rank left waiting for another fails the test soon.
    return {"store": {"collective_timeout": 60},
            "tier": [{"name": "ram", "backend": "memory", "path": f"{root}/{layout}/ram{per}"},
                     {"name": "disk", "backend": "local", "path": f"{root}/{layout}/disk{per}"}]}


def flip(paths: list[str]) -> dict[str, bytes]:
    """Flip one byte in the middle of each of ``paths``; their bytes before."""
    kept = {}
    for path in paths:
        with open(path, "rb") as f:
            kept[path] = f.read()
        data = bytearray(kept[path])
        data[len(data) // 2] ^= 0x01
        with open(path, "wb") as f:
            f.write(bytes(data))
    return kept


def run_layout(root: str, layout: str, rank: int) -> None:
    store = tierstore.open(config(root, layout))
    pg = store.process_group
    dcp.save(state(rank, 1), storage_writer=store.writer(), checkpoint_id=CID, process_group=pg)
    store.wait(all_ranks=True)  # the drain to disk is the coordinator's on shared tiers
    per = f"/{rank}" if layout == "per-rank" else ""
    mine = sorted(glob.glob(f"{root}/{layout}/*{per}/{CID}/__{rank}_0.distcp"))
    if len(mine) != 2:
        problems.append(f"{layout}: expected this rank's data file on both tiers, found {mine}")
    dist.barrier()
    kept = flip(mine) if rank == 1 else {}
    dist.barrier()
    bad = sorted({os.path.basename(p) for p in mine})[0] if rank == 1 else ""
    named = [bad]
    dist.broadcast_object_list(named, src=1)
    dest = state(rank, 2)
    before = copy.deepcopy(dest)
    try:
        dcp.load(dest, storage_reader=store.reader(), checkpoint_id=CID, process_group=pg)
        problems.append(f"{layout}: the load with {named[0]} bad on every tier succeeded")
    except CheckpointException as exc:
        # This rank's own error (DCP gathers every rank's): each must say why on its own.
        own = exc.failures.get(rank)
        message = (" ".join(f"{type(own[0]).__name__}: {own[0]}".split()) if own is not None
                   else "")
        print(f"RANK {rank} {layout} FAILED {message}", flush=True)
        if named[0] not in message:
            problems.append(f"{layout}: this rank's error does not name {named[0]}: {exc}")
    check_equal(problems, dest, before, f"{layout}: the state after the failed load")
    dist.barrier()
    for path, raw in kept.items():
        with open(path, "wb") as f:
            f.write(raw)
    dist.barrier()
    dest = state(rank, 2)
    dcp.load(dest, storage_reader=store.reader(), checkpoint_id=CID, process_group=pg)
    check_equal(problems, dest, state(rank, 1), f"{layout}: the load once the byte is back")
    if layout == "shared" and rank == 1:
        # A load DCP runs in one process (no_dist) has no other rank to agree with: it must
        # not wait for rank 0, which waits at the barrier below meanwhile.
        exported = store.export(CID, "torch", f"{root}/export-r1.pt")
        got = torch.load(exported.path, weights_only=False)
        want = {k: v for k, v in state(rank, 1).items() if isinstance(v, torch.Tensor)}
        check_equal(problems, {k: got.get(k) for k in want}, want, "the export by one rank alone")
    if layout == "per-rank":
        # The same file deleted from both of rank 1's tiers: no rank holds it, and the error
        # names it, not only the ranks whose part it belongs to.
        dist.barrier()
        for path in kept:
            os.remove(path)
        dist.barrier()
        try:
            dcp.load(state(rank, 2), storage_reader=store.reader(), checkpoint_id=CID,
                     process_group=pg)
            problems.append(f"{layout}: the load with {named[0]} deleted succeeded")
        except tierstore.CheckpointNotFound as exc:
            print(f"RANK {rank} {layout} DELETED {' '.join(str(exc).split())}", flush=True)
    dist.barrier()
    store.close()


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for layout in ("shared", "per-rank"):
        run_layout(sys.argv[1], layout, rank)
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
