"""torchrun worker (2 ranks): a rank that hangs or dies must not make the other wait for ever.

argv: ROOT SCENARIO. ``[store] collective_timeout = 3``.
- "latest-hung": rank 1 sleeps instead of calling ``store.latest()``; rank 0's call fails with a
  ``RanksLostError`` naming rank 1 before rank 1 wakes up.
- "load-dead": a tier per rank; after a save, rank 1 exits; rank 0's ``dcp.load`` fails with a
  ``RanksLostError`` naming rank 1.
Rank 0 prints ``RANK 0 RAISED <message>`` and ``RANK 0 BEFORE-WAKE <bool>``.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tierstore

HUNG_S = 20


def main() -> None:
    root, scenario = sys.argv[1:3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = {"store": {"collective_timeout": 3},
              "tier": [{"name": "ram", "backend": "memory", "path": root + "/ram/{rank}"}]}
    store = tierstore.open(config)
    group = store.process_group
    dcp.save({"x": torch.full((4,), float(rank))}, storage_writer=store.writer(),
             checkpoint_id="step-1", process_group=group)
    wake = os.path.join(root, "rank1-woke")
    if rank == 1:
        if scenario == "latest-hung":
            time.sleep(HUNG_S)
            with open(wake, "w"):
                pass
        os._exit(0)  # dead (load-dead), or gone after its hang (latest-hung)
    started = time.monotonic()
    try:
        if scenario == "latest-hung":
            store.latest()
        else:
            dcp.load({"x": torch.zeros(4)}, storage_reader=store.reader(), checkpoint_id="step-1",
                     process_group=group)
        print("RANK 0 PROBLEM: no error", flush=True)
    except tierstore.RanksLostError as exc:
        print(f"RANK 0 RAISED {exc}", flush=True)
    except Exception as exc:  # noqa: BLE001 - anything else is what the test catches
        print(f"RANK 0 PROBLEM: {type(exc).__name__}: {exc}", flush=True)
    print(f"RANK 0 BEFORE-WAKE {not os.path.exists(wake)} "
          f"AFTER {time.monotonic() - started:.1f} s", flush=True)
    os._exit(0)  # the groups are unusable now: no teardown


if __name__ == "__main__":
    main()
