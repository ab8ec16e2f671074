"""dcp.async_save with DCP's process executor, in a 1-rank gloo job (tests/test_async.py).

    python async_process_worker.py ROOT STAGING PORT

STAGING is a staging plugin's name, or a JSON table of it; ``budget_fraction`` N in the table
sets ``max_staging_bytes`` to 1/N of the state's tensor bytes (the worker then also checks that
the saves went in waves and prints ``WAVES``). With ``lazy``, each save's state is changed right
after its ``staging_completion``.

Saves step-0..2 of ``worker_common.make_async_state`` (changed after each save staged) into a
"ram" tier (keep 1) with a "disk" tier behind it, then checks, after ``store.wait()`` (the drains
of the checkpoint process's saves run in this process), where each checkpoint is and that each
loads back bit for bit. Prints ``PROCESS EXECUTOR OK`` at the end; fails by an exception.
"""

import copy
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType  # noqa: E402
from worker_common import (StagedEvents, assert_trees_equal, load_like,  # noqa: E402
                           make_async_state, mutate_everything)
from tierstore_plugins.staging_buffers import describe_state_dict  # noqa: E402

import tierstore  # noqa: E402


def main() -> None:
    root, staging, port = sys.argv[1], sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    sd = make_async_state()
    budgeted = False
    if staging.startswith("{"):
        staging = json.loads(staging)
        fraction = staging.pop("budget_fraction", None)
        if fraction:
            staging["max_staging_bytes"] = describe_state_dict(sd).nbytes // fraction
            budgeted = True
    config = {"store": {"staging": staging},
              "tier": [{"name": "ram", "backend": "local", "path": f"{root}/ram", "keep": 1},
                       {"name": "disk", "backend": "local", "path": f"{root}/disk"}]}
    store = tierstore.open(config, plugins=[staged := StagedEvents()])
    expected = {}
    for i in range(3):
        resp = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id=f"step-{i}",
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                              process_group=store.process_group)
        expected[i] = copy.deepcopy(sd)
        if hasattr(resp, "staging_completion"):  # lazy: the copy runs after the call
            resp.staging_completion.result()
        mutate_everything(sd)
        getattr(resp, "upload_completion", resp).result()
    if budgeted:
        waves = [e.detail["waves"] for e in staged.events]
        assert len(waves) == 3 and min(waves) > 1, waves
        print("WAVES", waves, flush=True)
    store.wait()  # drains of the checkpoint process's saves run in this process
    tiers = {c.id: c.tiers for c in store.list()}
    assert tiers == {"step-2": ["ram", "disk"], "step-1": ["disk"], "step-0": ["disk"]}, tiers
    for i in range(3):
        assert_trees_equal(load_like(store, f"step-{i}", expected[i]), expected[i], f"step-{i}")
    store.close()
    print("PROCESS EXECUTOR OK", flush=True)


if __name__ == "__main__":
    main()
