"""A save bigger than its tier's free space (tests/test_full_tier.py): it fails with a
TierFullError naming the tier, gc collects what it wrote, the previous checkpoint loads, and the
process exits 0 (torch's zip writer must never abort it)."""

import gc
import sys

import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore import TierFullError


def main() -> int:
    root, big = sys.argv[1], int(sys.argv[2])
    with tierstore.open({"tier": [{"name": "nvme", "backend": "local", "path": root}]}) as store:
        dcp.save({"w": torch.ones(256 * 1024)}, storage_writer=store.writer(),
                 checkpoint_id="step-1")
        try:
            dcp.save({"w": torch.full((big,), 2.0)}, storage_writer=store.writer(),
                     checkpoint_id="step-2")
        except BaseException as exc:  # DCP wraps it in a CheckpointException
            found = [f[0] for f in getattr(exc, "failures", {}).values()] or [exc]
            print("FAILED", " | ".join(f"{type(f).__name__}: {f}" for f in found), flush=True)
            print("IS TIER FULL", any(isinstance(f, TierFullError) for f in found), flush=True)
        gc.collect()
        print("LATEST", store.latest(), flush=True)
        print("GC", store.gc(), flush=True)
        out = {"w": torch.zeros(256 * 1024)}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
        print("LOADED", torch.equal(out["w"], torch.ones(256 * 1024)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
