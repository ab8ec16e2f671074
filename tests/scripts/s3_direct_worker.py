"""torchrun worker for tests/test_s3_direct.py: every rank saves straight into one shared S3
tier (no node-local tier in front), several times, and loads the newest save bitwise.

argv: BACKEND URL OPTIONS_JSON SAVES. BACKEND is the tier's backend (``fsspec`` or
``obstore``). Each save's id is ``step-<n>``; the last one overwrites ``step-1`` (a committed
checkpoint replaced in place) from a store writing one file per rank where the first wrote
several, so that the old checkpoint leaves objects the new one does not replace. Every rank
loads each step it saved and compares bitwise.
"""

import json
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import tierstore
from worker_common import check_equal, local_shards, node_state, run_worker

warnings.filterwarnings("ignore")
problems: list[str] = []
OWN_NUMEL = 50_000  # floats of each rank's own part: big enough to be written for a while


def state(values: int, rank: int, mesh, zero: bool = False) -> dict:
    """The test's state: ``node_state`` (a sharded tensor, DDP-style replicated items) and a
    second large shard per rank, so that a rank with threads to spare writes two files."""
    sd = node_state(values, rank, mesh, OWN_NUMEL, zero=zero)
    full = torch.arange(OWN_NUMEL * mesh.size(), dtype=torch.float32) * (0 if zero else values)
    sd["w2"] = distribute_tensor(full, mesh, [Shard(0)])
    return sd


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    backend, url, options, saves = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), \
        int(sys.argv[4])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tier = {"name": "s3", "backend": backend, "url": url, "options": options}
    for checkpoint_id, values, io_threads in (
            [(f"step-{n}", n, 4) for n in range(1, saves + 1)] + [("step-1", saves + 1, 1)]):
        config = {"store": {"overwrite": True, "io_threads": io_threads}, "tier": [tier]}
        with tierstore.open(config) as store:
            dcp.save(state(values, rank, mesh), storage_writer=store.writer(),
                     checkpoint_id=checkpoint_id, process_group=store.process_group)
    newest = {f"step-{n}": n for n in range(2, saves + 1)} | {"step-1": saves + 1}
    with tierstore.open({"tier": [tier]}) as store:
        for checkpoint_id, values in sorted(newest.items()):
            out = state(values, rank, mesh, zero=True)
            try:
                dcp.load(out, storage_reader=store.reader(), checkpoint_id=checkpoint_id,
                         process_group=store.process_group)
            except Exception as exc:  # noqa: BLE001 - reported, the other steps still checked
                problems.append(f"{checkpoint_id}: {type(exc).__name__}: {exc}")
                continue
            check_equal(problems, local_shards(out),
                        local_shards(state(values, rank, mesh)), checkpoint_id)
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
