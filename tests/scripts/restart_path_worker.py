"""torchrun worker for a job of 2 simulated nodes x 2 ranks with a node-local RAM tier in front
of an S3 tier (tests/test_restart_path.py): what a restart costs the ranks that do not lead.

argv: ROOT S3_URL OPTIONS_JSON PHASE. PHASE "save" saves step-1 and waits for every rank's
drains to S3. PHASE "restart" opens the store, asks latest() and loads step-1 bitwise, printing
``RANK <r> S3CLIENT <after open> <after latest> <after load>`` (whether the process imported an
S3 client by then) and ``RANK <r> READ <tiers>`` (the tiers its files came from). PHASE
"bad-path" opens a store whose RAM directory on node 1 is a file: every rank prints
``RANK <r> CONFIGERROR <message>``.
"""

import json
import sys
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import init_device_mesh

import tierstore
from tierstore.events import EventKind
from worker_common import check_equal, local_shards, node_state, ram_and_s3, run_worker, say

warnings.filterwarnings("ignore")
problems: list[str] = []
OWN_NUMEL = 1000  # floats of each rank's own in the state


class Loaded:
    """The tiers each ``loaded`` event says this rank's bytes came from."""

    def __init__(self):
        self.sources: set[str] = set()

    @tierstore.hookimpl
    def tierstore_event(self, event):
        if event.kind == EventKind.LOADED:
            self.sources |= set(event.detail["bytes_from"])




def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root, url, options, phase = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if phase == "bad-path":
        try:
            tierstore.open(ram_and_s3(root, url, options))
        except tierstore.ConfigError as exc:
            say(f"RANK {rank} CONFIGERROR {exc}")
        else:
            problems.append("the store opened with node 1's RAM directory a file")
        return 0
    loaded = Loaded()
    store = tierstore.open(ram_and_s3(root, url, options), plugins=[loaded])
    if phase == "save":
        dcp.save(node_state(1, rank, mesh, OWN_NUMEL), storage_writer=store.writer(),
                 checkpoint_id="step-1", process_group=store.process_group)
        store.wait(all_ranks=True)
        store.close()
        return 0
    seen = ["s3fs" in sys.modules]
    latest = store.latest()
    seen.append("s3fs" in sys.modules)
    if latest != "step-1":
        problems.append(f"latest() is {latest!r}")
        return 0
    out = node_state(1, rank, mesh, OWN_NUMEL, zero=True)
    dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1",
             process_group=store.process_group)
    seen.append("s3fs" in sys.modules)
    check_equal(problems, local_shards(out), local_shards(node_state(1, rank, mesh, OWN_NUMEL)),
                "step-1")
    say(f"RANK {rank} S3CLIENT {' '.join(map(str, seen))}")
    say(f"RANK {rank} READ {' '.join(sorted(loaded.sources))}")
    store.close()
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
