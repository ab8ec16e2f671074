"""Saves ``step-1`` fully, then dies by SIGKILL in the middle of saving ``step-2``.

    python crash_save.py ROOT KIND NAME NTH

KIND is ``phase`` (kill just before the NTH announcement of phase NAME during step-2, from a
``tierstore_phase`` hook) or ``event`` (kill right after the NTH event NAME of step-2, from a
``tierstore_event`` hook, e.g. the first ``written`` event: one data file is complete on disk).

Step N holds ``tierstore_conformance.make_state_dict(N)``; tests/test_crash.py builds the same to
check what was saved, and opens the store with ``config`` from here.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings

from tierstore_conformance import make_state_dict

import tierstore

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def config(root: str) -> dict:
    # io_threads = 3: a save writes several data files, in parallel.
    return {"store": {"io_threads": 3},
            "tier": [{"name": "disk", "backend": "local", "path": root}]}


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
