"""A small training job for tests/test_goodput.py: trains to step ``STEPS`` with a save every 3
steps into a store whose ``[store] events_log`` is ``ROOT/events.jsonl``, resuming from
``store.latest()``; the test kills it (SIGKILL) while it runs and starts it again.

argv: ROOT STEPS. Prints, flushed, what the test compares the goodput report with:
``RESUMED <step>`` once, then ``STEP <step> <start> <end>`` after each step (epoch seconds of
the step's own time, what ``Store.record_step`` is told), and ``DONE`` at the end.
"""

import sys
import time

import torch
import torch.distributed.checkpoint as dcp

import tierstore

# Whole lines in one write: the ranks share a pipe (see worker_common).
sys.stdout.reconfigure(line_buffering=True, write_through=False)


def main() -> int:
    root, steps = sys.argv[1], int(sys.argv[2])
    config = {"store": {"events_log": f"{root}/events.jsonl"}, "tier": [
        {"name": "ram", "backend": "memory", "path": f"{root}/ram", "keep": 2},
        {"name": "disk", "backend": "local", "path": f"{root}/disk", "every": 2, "keep": 2}]}
    state = {"w": torch.zeros(256, 256), "step": 0}
    with tierstore.open(config) as store:
        latest = store.latest()
        if latest is not None:
            dcp.load(state, storage_reader=store.reader(), checkpoint_id=latest)
        print(f"RESUMED {state['step']}", flush=True)
        for step in range(state["step"] + 1, steps + 1):
            start = time.time()
            state["w"] += 1.0  # the step's work; every element counts the steps taken
            time.sleep(0.15)
            end = time.time()
            state["step"] = step
            store.record_step(step, end - start)
            print(f"STEP {step} {start:.6f} {end:.6f}", flush=True)
            if step % 3 == 0:
                dcp.save(state, storage_writer=store.writer(), checkpoint_id=f"step-{step}")
        assert torch.equal(state["w"], torch.full((256, 256), float(steps))), "history broken"
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
