"""Saves ``step-1`` fully, then dies by SIGKILL in the middle of saving ``step-2``.

    python crash_save.py ROOT KIND NAME NTH

KIND is ``phase`` (kill just before the NTH announcement of phase NAME during step-2, from a
``tierstore_phase`` hook) or ``event`` (kill right after the NTH event NAME of step-2, from a
``tierstore_event`` hook, e.g. the first ``written`` event: one data file is complete on disk).

tests/test_crash.py imports ``make_state_dict`` and ``config`` from here so it can regenerate the
exact data step-1 holds.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import warnings

import torch

import tierstore

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def config(root: str) -> dict:
    # io_threads = 3: a save writes several data files, in parallel.
    return {"store": {"io_threads": 3},
            "tier": [{"name": "disk", "backend": "local", "path": root}]}


def make_state_dict(seed: int) -> dict:
    """Deterministic state: a few tensors of different dtypes and a non-tensor item."""
    gen = torch.Generator().manual_seed(seed)
    sd = {
        "w1": torch.randn(64, 64, generator=gen),
        "w2": torch.randn(32, 48, generator=gen).to(torch.bfloat16),
        "b": torch.randn(300, generator=gen).to(torch.float16),
        "ids": torch.randint(-2**40, 2**40, (128,), generator=gen, dtype=torch.int64),
        "mask": torch.randint(0, 2, (77,), generator=gen).bool(),
        "extra": {"step": seed, "rng": random.Random(seed).getstate()},
    }
    return sd


def zeros_like_state_dict(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": -1, "rng": None}
            for k, v in sd.items()}


class Killer:
    """Kills its own process at a chosen point of the save of ``step-2``."""

    def __init__(self, kind: str, name: str, nth: int):
        self.kind, self.name, self.nth = kind, name, nth
        self.seen = 0
        self.lock = threading.Lock()

    def _hit(self) -> None:
        with self.lock:
            self.seen += 1
            if self.seen == self.nth:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail):
        if self.kind == "phase" and checkpoint_id == "step-2" and phase == self.name:
            self._hit()

    @tierstore.hookimpl
    def tierstore_event(self, event):
        if self.kind == "event" and event.checkpoint_id == "step-2" and event.kind == self.name:
            self._hit()


def main() -> None:
    import torch.distributed.checkpoint as dcp

    root, kind, name, nth = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    store = tierstore.open(config(root), plugins=[Killer(kind, name, nth)])
    dcp.save(make_state_dict(1), storage_writer=store.writer(), checkpoint_id="step-1")
    print("saved step-1", flush=True)
    dcp.save(make_state_dict(2), storage_writer=store.writer(), checkpoint_id="step-2")
    print("saved step-2 (the kill point was never reached)", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    main()
