"""Where a benchmark puts its files: its temp directories, the filesystems they are on, the
room they need, and the file-level helpers around a timed save or load (delete an output, read a
checkpoint into the page cache, list its files)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from typing import Iterator

#: filesystems in memory: fsync costs nothing there, and a memory tier belongs there
MEMORY_FS = ("tmpfs", "ramfs")


def fs_type(path: str) -> str:
    """Filesystem type of ``path`` (longest mount-point prefix in /proc/mounts), or '?'."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def shm_or_tmp() -> str:
    """/dev/shm when this machine has it, else the system temp dir: the default parent of the
    benchmarks whose tiers are meant to be in memory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def disk_parent(args: argparse.Namespace, why: str) -> tuple[str, str]:
    """``--dir`` (default: the system temp dir) and its filesystem type; exits when it is tmpfs,
    where fsync costs nothing and ``why`` would mean nothing."""
    parent = args.dir or tempfile.gettempdir()
    kind = fs_type(parent)
    if kind in MEMORY_FS:
        raise SystemExit(f"{parent} is on {kind} ({why}); point --dir at a disk-backed "
                         f"filesystem")
    return parent, kind


def memory_parent(path: str, option: str, consequence: str = "") -> str:
    """The filesystem type of ``path``, given as ``option``, with a warning on stderr when it
    is not in memory (``consequence``: what that means for the figures)."""
    kind = fs_type(path)
    if kind not in MEMORY_FS:
        print(f"warning: {option} {path} is on {kind}, not tmpfs"
              + (f"; {consequence}" if consequence else ""), file=sys.stderr)
    return kind


def free_bytes(path: str) -> int:
    """Bytes an unprivileged process may still write on ``path``'s filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def room_problem(path: str, need: int) -> str | None:
    """Why ``path`` cannot hold ``need`` bytes (its free space and the need, in GiB), or
    None when it can."""
    free = free_bytes(path)
    if free >= need:
        return None
    return f"{path} has {free / 2**30:.1f} GiB free, about {need / 2**30:.1f} GiB are needed"


def need_room(path: str, need: int, hint: str = "") -> None:
    """Exit (before minutes are spent) when ``path`` cannot hold ``need`` bytes; ``hint``:
    what to do about it."""
    problem = room_problem(path, need)
    if problem is not None:
        raise SystemExit(problem + (f" ({hint})" if hint else ""))


@contextmanager
def scratch(prefix: str, parent: str | None = None, keep: bool = False) -> Iterator[str]:
    """A fresh temp directory under ``parent`` (default: the system temp dir) for one run,
    removed at the end whatever happened (``keep``: left, for a look afterwards)."""
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


def remove(path: str) -> None:
    """Delete a file or directory tree if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def warm_page_cache(path: str) -> int:
    """Read every file under ``path`` once (untimed) so a following load is served from the page
    cache for every load contender alike. Returns bytes read."""
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb", buffering=0) as f:
                while n := f.readinto(view):
                    total += n
    return total


def checkpoint_files(ckpt_dir: str) -> list[str]:
    """Every file of a committed checkpoint directory, largest first (the drain's order)."""
    names = [n for n in os.listdir(ckpt_dir) if os.path.isfile(os.path.join(ckpt_dir, n))]
    return sorted(names, key=lambda n: (-os.path.getsize(os.path.join(ckpt_dir, n)), n))


def dir_bytes(path: str) -> int:
    """Bytes of every file under ``path``: what a checkpoint takes on a tier."""
    return sum(os.path.getsize(os.path.join(r, n)) for r, _d, ns in os.walk(path) for n in ns)
