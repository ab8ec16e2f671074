"""A training loop that checkpoints asynchronously and saves an emergency checkpoint on SIGTERM.

Run by tests/test_preemption.py as a plain process or under torchrun (gloo). argv: the tier
root, the number of steps. Each step fills every tensor with the step number (so a checkpoint's
content says which step it holds), prints ``STEP <rank> <step> <pid>``, and async-saves every
third step (keys ``rank<r>_bytes`` are per rank). When any rank got SIGTERM, every rank prints ``EMERGENCY <rank> <step>`` and
``preemption.save_and_exit`` saves that step and exits 0. Running out of steps exits 3. An
``atexit`` handler prints ``ATEXIT <rank>`` without flushing: ``save_and_exit`` must run it and
flush what it printed before the process ends.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tierstore

# Whole lines in one write: the ranks share a pipe (see worker_common).
sys.stdout.reconfigure(line_buffering=True, write_through=False)

warnings.filterwarnings("ignore", category=UserWarning)


def main() -> int:
    root, steps = sys.argv[1], int(sys.argv[2])
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    store = tierstore.open({"tier": [
        {"name": "ram", "backend": "local", "path": f"{root}/ram", "keep": 2},
        {"name": "disk", "backend": "local", "path": f"{root}/disk"},
    ]})
    preemption = store.preemption()
    atexit.register(lambda: print(f"ATEXIT {rank}"))  # no flush: save_and_exit flushes
    state = {"weights": torch.zeros(256, 64), "bias": torch.zeros(64, dtype=torch.float64),
             f"rank{rank}_bytes": torch.zeros(1000, dtype=torch.uint8), "step": 0}
    future = None
    for step in range(1, steps + 1):
        for t in (state["weights"], state["bias"]):
            t.fill_(step)  # replicated: equal on every rank
        state[f"rank{rank}_bytes"].fill_((step * 7 + rank) % 256)  # this rank's own
        state["step"] = step
        time.sleep(0.02)  # the "training" of this step
        print(f"STEP {rank} {step} {os.getpid()}", flush=True)
        if preemption.requested_by_any():
            print(f"EMERGENCY {rank} {step}", flush=True)
            preemption.save_and_exit(state, f"step-{step}")
        if step % 3 == 0:
            if future is not None:
                future.result()
            future = dcp.async_save(state, storage_writer=store.writer(),
                                    checkpoint_id=f"step-{step}",
                                    process_group=store.process_group)
    print(f"NO SIGNAL {rank}", flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main())
