"""Saves ``step-1``, then saves ``step-1`` again over it ([store] overwrite = true) and dies by
SIGKILL just before the first announcement of phase NAME during that second save.

    python crash_overwrite.py ROOT BACKEND NAME

BACKEND is ``local``, ``memory`` (both swap the two copies in one step where the filesystem can)
or ``renaming`` (a ``local`` directory reached without an OS path, as a backend that renames but
is not on a local filesystem would be: the commit protocol replaces in two steps).

The first save holds ``tierstore_conformance.make_state_dict(1)``, the second
``make_state_dict(2)``; tests/test_commit_crash_windows.py checks which of them a fresh store
finds, opening it with ``config`` and ``plugins`` from here.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings

from tierstore_conformance import make_state_dict
from tierstore_plugins.local import LocalBackend

import tierstore

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class RenamingBackend(LocalBackend):
    """A ``local`` directory that offers rename but no OS path: the commit protocol cannot swap
    entries through the OS and takes its two-step way."""

    def local_path(self, path: str) -> str | None:
        return None


class Backends:
    @tierstore.hookimpl
    def tierstore_register_backends(self, register):
        register("renaming", RenamingBackend)


def config(root: str, backend: str) -> dict:
    return {"store": {"overwrite": True},
            "tier": [{"name": "disk", "backend": backend, "path": root}]}


def plugins() -> list:
    return [Backends()]


class Killer:
    """Kills its own process at the first ``name`` phase once armed."""

    def __init__(self, name: str):
        self.name, self.armed = name, False

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail):
        if self.armed and phase == self.name:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    import torch.distributed.checkpoint as dcp

    root, backend, name = sys.argv[1], sys.argv[2], sys.argv[3]
    killer = Killer(name)
    store = tierstore.open(config(root, backend), plugins=[*plugins(), killer])
    dcp.save(make_state_dict(1), storage_writer=store.writer(), checkpoint_id="step-1")
    print("saved step-1", flush=True)
    killer.armed = True
    dcp.save(make_state_dict(2), storage_writer=store.writer(), checkpoint_id="step-1")
    print("saved step-1 again (the kill point was never reached)", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    main()
