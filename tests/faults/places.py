"""Where trials run: their directories, a worker's small tmpfs, the S3 server's module."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .inject import BALLAST, FIRST_FULL, FULL_FAULTS
from .plan import Trial
from .scenario import Place

__all__ = ["Env", "TMPFS_SIZE", "mount_tmpfs", "server_module", "unmount"]

#: The tmpfs of each worker for tmpfs-full trials: room for a job's two tiers, little more.
TMPFS_SIZE = "16m"


def server_module():
    """tests/servers.py (SeaweedFS), importable from the tests directory."""
    tests_dir = str(Path(__file__).resolve().parent.parent)
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    import servers

    return servers


@dataclass
class Env:
    """What a process running trials has: directories, its tmpfs, the S3 server."""

    workdir: str
    shm: str
    mount: str | None = None
    server: Any = None
    bucket: str | None = None
    keep: bool = False
    made: list[str] = field(default_factory=list)

    def place_for(self, trial: Trial, name: str) -> Place:
        """Fresh directories (and S3 prefix) for one run of ``trial``: the journal and the log
        on disk, the tiers in /dev/shm and on disk, both on the tmpfs (tmpfs-full), or the
        first tier alone on it (first-full)."""
        full = trial.fault in FULL_FAULTS
        if full and self.mount is None:
            raise RuntimeError(f"{trial.fault} trials need a tmpfs (run as root)")
        base = os.path.join(self.workdir, name)
        tiers = os.path.join(self.mount, name) if full and trial.fault != FIRST_FULL else base
        shm = os.path.join(self.mount, name) if full else os.path.join(self.shm, name)
        for path in (base, tiers, shm):
            os.makedirs(path, exist_ok=True)
        self.made[:] = sorted({base, tiers, shm})
        s3 = trial.s3
        if s3 and (self.server is None or self.bucket is None):
            raise RuntimeError("S3 trials need the server (tests/servers.py)")
        return Place(
            fast=os.path.join(shm, "fast"),
            slow=f"s3://{self.bucket}/{name}" if s3 else os.path.join(tiers, "slow"),
            journal=os.path.join(base, "journal"),
            log=os.path.join(base, "log"),
            s3_options=self.server.storage_options() if s3 else None,
            mount=self.mount if full else None,
            server_pid=self.server.pid if s3 and self.server is not None else None,
        )

    def keep_failed(self, place: Place) -> None:
        """Copy a failed trial's tiers off the tmpfs (it is unmounted at the end)."""
        if place.mount is not None:
            base = os.path.dirname(place.journal)
            tiers = os.path.join(place.mount, os.path.basename(base))
            shutil.copytree(tiers, os.path.join(base, "tmpfs-copy"), dirs_exist_ok=True)

    def clean(self) -> None:
        """Remove the last trial's directories (unless kept)."""
        if not self.keep:
            for path in self.made:
                shutil.rmtree(path, ignore_errors=True)
        if self.mount is not None:
            try:
                os.remove(os.path.join(self.mount, BALLAST))
            except FileNotFoundError:
                pass


def mount_tmpfs(path: str) -> str | None:
    """Mount a small tmpfs at ``path`` (None when that is not possible: not root)."""
    if os.geteuid() != 0:
        return None
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", path],
                          capture_output=True)
    return path if done.returncode == 0 else None


def unmount(path: str | None) -> None:
    """Undo :func:`mount_tmpfs`."""
    if path is not None:
        subprocess.run(["umount", "-l", path], capture_output=True)
