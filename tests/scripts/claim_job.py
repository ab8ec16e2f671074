"""A job of its own on a RAM tier another job may hold: tests/test_tier_claims.py.

    python claim_job.py RAM DISK MODE

Its store has a ``memory`` tier at RAM and a ``local`` tier at DISK (this job's own), every
save drained there. MODE:

- ``save``: save ``step-1`` (``make_state_dict(7)``) and print ``saved``, or the error's type
  and message on one line; then close the store and print what DISK holds (a JSON list);
- ``die``: save ``step-1`` and ``step-2`` (``make_state_dict(1)``, ``(2)``), wait for their
  drains, print ``saved``, and die by SIGKILL with the store still open (its claim held).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings

import torch.distributed.checkpoint as dcp
from tierstore_conformance import make_state_dict

import tierstore

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def config(ram: str, disk: str) -> dict:
    return {"tier": [{"name": "ram", "backend": "memory", "path": ram},
                     {"name": "disk", "backend": "local", "path": disk}]}


def main(ram: str, disk: str, mode: str) -> None:
    store = tierstore.open(config(ram, disk))
    if mode == "die":
        for step in (1, 2):
            dcp.save(make_state_dict(step), storage_writer=store.writer(),
                     checkpoint_id=f"step-{step}")
        store.wait()
        print("saved", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dcp.save(make_state_dict(7), storage_writer=store.writer(), checkpoint_id="step-1")
        print("saved", flush=True)
    except Exception as exc:  # noqa: BLE001 - the test reads what a user would see
        print(f"{type(exc).__name__}: {exc}", flush=True)
    store.close()
    print(json.dumps(sorted(os.listdir(disk)) if os.path.isdir(disk) else []), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
