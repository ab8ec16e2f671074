"""torchrun worker for tests/test_restart_requests.py: what a restart asks of the object store.

One simulated node of N ranks, a node-local RAM tier in front of an S3 tier (SeaweedFS).

argv: ROOT S3_URL OPTIONS_JSON PHASE. PHASE "save" saves step-1 and step-2 (replicated items,
DDP style, and each rank's own shard) and waits for every rank's drains to S3. PHASE "restart"
opens the store, asks ``latest()`` and loads it bitwise, as a restarted job does, and prints
``RANK <r> CALLS <json>``: the S3 operations this rank's clients made (operation and key),
recorded at the client, so that a test can say which rank asked for what (the server counts
the total).
"""

import json
import os
import sys
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import init_device_mesh

import tierstore
from worker_common import check_equal, local_shards, node_state, ram_and_s3, run_worker, say

warnings.filterwarnings("ignore")
problems: list[str] = []
OWN_NUMEL = 1000  # floats of each rank's own in the state
calls: list[list[str]] = []


def record_s3_calls() -> None:
    """Record every S3 operation this process's clients make (aiobotocore's one entry)."""
    from aiobotocore.client import AioBaseClient

    made = AioBaseClient._make_api_call

    async def counted(self, operation_name, api_params):
        where = api_params.get("Key") or api_params.get("Prefix") or ""
        calls.append([operation_name, str(where)])
        return await made(self, operation_name, api_params)

    AioBaseClient._make_api_call = counted
    if os.environ.get("RESTART_REQUESTS_STACKS"):  # for a person finding who asks what
        import traceback

        import fsspec.asyn

        synced = fsspec.asyn.sync

        def traced(loop, func, *args, **kwargs):
            frames = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}:{f.name}"
                      for f in traceback.extract_stack()[:-1]
                      if "tierstore" in f.filename or "plugins" in f.filename]
            sys.stderr.write(f"STACK {getattr(func, '__name__', func)} {args[:1]} "
                             f"{' < '.join(frames[::-1][:9])}\n")
            return synced(loop, func, *args, **kwargs)

        fsspec.asyn.sync = traced




def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root, url, options, phase = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if phase == "save":
        store = tierstore.open(ram_and_s3(root, url, options))
        for step in (1, 2):
            dcp.save(node_state(step, rank, mesh, OWN_NUMEL), storage_writer=store.writer(),
                     checkpoint_id=f"step-{step}", process_group=store.process_group)
        store.wait(all_ranks=True)
        store.close()
        return 0
    record_s3_calls()
    store = tierstore.open(ram_and_s3(root, url, options))
    latest = store.latest()
    if latest != "step-2":
        problems.append(f"latest() is {latest!r}")
    else:
        out = node_state(2, rank, mesh, OWN_NUMEL, zero=True)
        dcp.load(out, storage_reader=store.reader(), checkpoint_id=latest,
                 process_group=store.process_group)
        check_equal(problems, local_shards(out),
                    local_shards(node_state(2, rank, mesh, OWN_NUMEL)), latest)
    store.close()
    say(f"RANK {rank} CALLS {json.dumps(calls)}")
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
