"""Overwriting a checkpoint id with the ``atomic`` protocol, killed (SIGKILL, in a subprocess)
between the steps that replace the old copy with the new one: a fresh store must still hold a
committed copy under that id, the old one or the new one, bit for bit, and gc must keep it.

Where the filesystem swaps two entries in one step (``local`` on ext4, ``memory`` on tmpfs) the
id never goes missing; a backend that renames without an OS path (``renaming``) replaces in two
steps, and gc puts the old copy back under the id."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import struct
import uuid
from pathlib import Path

import pytest
from helpers import assert_state_dicts_equal, load_like, make_state_dict, run_script
from scripts.crash_overwrite import config, plugins

import tierstore
from tierstore_plugins.atomic import PHASE_REPLACE

SWAPPING = ("local", "memory")


@pytest.fixture
def root(request, tmp_path):
    """The tier's directory: under /dev/shm (tmpfs) for ``memory``, else under tmp_path."""
    if request.node.callspec.params["backend"] != "memory":
        yield tmp_path / "tier"
        return
    path = Path("/dev/shm") / f"tierstore-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def hidden(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(".tierstore-"))


def loads_as_one_of(store, cid: str, seeds: tuple[int, ...]) -> int:
    """Load ``cid`` and return which ``make_state_dict(seed)`` it equals bit for bit."""
    got = load_like(store, cid, make_state_dict(1))
    for seed in seeds:
        try:
            assert_state_dicts_equal(got, make_state_dict(seed))
        except AssertionError:
            continue
        return seed
    raise AssertionError(f"{cid} loads as neither of the saves {seeds}")


def crash_overwrite(root: Path, backend: str, phase: str) -> None:
    proc = run_script("crash_overwrite.py", root, backend, phase)
    output = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert "saved step-1\n" in proc.stdout, output
    assert proc.returncode == -signal.SIGKILL, f"expected death by SIGKILL\n{output}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", [*SWAPPING, "renaming"])
def test_overwrite_killed_between_its_two_steps_keeps_the_id(root, backend):
    crash_overwrite(root, backend, PHASE_REPLACE)
    with tierstore.open(config(str(root), backend), plugins=plugins()) as store:
        if backend in SWAPPING:
            # Swapped in one step: the id names the new copy at once, before any gc.
            assert store.latest() == "step-1"
            assert loads_as_one_of(store, "step-1", (2,)) == 2
        left = hidden(root)
        assert left, "the kill point is between two steps: something must be left to collect"
        removed = sorted(store.gc())
        if backend in SWAPPING:
            assert removed == [f"disk:{n}" for n in left]  # the old copy, under a hidden name
        else:
            # The old copy went back under the id; only the new, never published, is removed.
            assert removed and set(removed) < {f"disk:{n}" for n in left}, (removed, left)
        assert hidden(root) == []
        assert store.latest() == "step-1"
        assert [c.id for c in store.list()] == ["step-1"]
        kept = loads_as_one_of(store, "step-1", (1, 2))
        assert store.verify("step-1").ok
        assert store.gc() == []
        assert loads_as_one_of(store, "step-1", (1, 2)) == kept
    assert os.listdir(root) == ["step-1"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", [*SWAPPING, "renaming"])
def test_overwrite_killed_before_publishing_keeps_the_old_copy(root, backend):
    crash_overwrite(root, backend, "publish")
    with tierstore.open(config(str(root), backend), plugins=plugins()) as store:
        assert store.latest() == "step-1"
        assert loads_as_one_of(store, "step-1", (1,)) == 1
        left = hidden(root)
        assert sorted(store.gc()) == [f"disk:{n}" for n in left]
        assert hidden(root) == []
        assert loads_as_one_of(store, "step-1", (1,)) == 1
    assert os.listdir(root) == ["step-1"]


# -- a power loss: what a durable backend's close() hands to the disk ---------------------------
# A power loss cannot be staged here; what can be observed is whether a file's bytes have reached
# the disk when close() returns. On filesystems with delayed allocation (ext4, xfs) bytes that
# are only in the page cache have no blocks yet: FIEMAP reports their extents as DELALLOC until
# they are written back, which without fsync happens up to 30 s later. A file fsynced on close
# has none left. (This proves the file's data was flushed; that its directory entry was synced
# too cannot be observed without a power loss.)
_FS_IOC_FIEMAP = 0xC020660B
_FIEMAP_EXTENT_DELALLOC = 0x4
_EXTENTS = 64


def delalloc_extents(path: str) -> tuple[int, int]:
    """(extents, extents still waiting for delayed allocation) of the file at ``path``, read
    without syncing it first."""
    header = struct.pack("=QQIIII", 0, 0xFFFFFFFFFFFFFFFF, 0, 0, _EXTENTS, 0)
    buf = bytearray(header + bytes(56 * _EXTENTS))
    with open(path, "rb") as f:
        fcntl.ioctl(f.fileno(), _FS_IOC_FIEMAP, buf)
    mapped = struct.unpack_from("=I", buf, 20)[0]
    flags = [struct.unpack_from("=I", buf, 32 + 56 * i + 40)[0] for i in range(mapped)]
    return mapped, sum(1 for f in flags if f & _FIEMAP_EXTENT_DELALLOC)


def _open_backend(kind: str, root: Path):
    if kind == "local":
        from tierstore_plugins.local import LocalBackend
        return LocalBackend(str(root))
    from tierstore_plugins.fsspec_backend import FsspecBackend
    return FsspecBackend(f"file://{root}")


@pytest.mark.parametrize("kind,how", [("local", "open_write"), ("local", "write_bytes"),
                                      ("fsspec-file", "open_write"), ("fsspec-file", "write_bytes"),
                                      ("fsspec-file", "put_files")])
def test_durable_backend_close_leaves_nothing_in_the_page_cache(tmp_path, kind, how):
    """What a durable backend wrote (a data file, the manifest through write_bytes, a drain's
    upload through put_files) has reached the disk when the call returns."""
    data = os.urandom(4 << 20)
    control = tmp_path / "control"
    with open(control, "wb") as f:  # written without fsync: its blocks are not allocated yet
        f.write(data)
    if delalloc_extents(str(control))[1] == 0:
        pytest.skip(f"{tmp_path} allocates blocks at write time: nothing to observe here")
    backend = _open_backend(kind, tmp_path / "tier")
    try:
        assert backend.durable
        backend.makedirs("step-1")
        if how == "open_write":
            with backend.open_write("step-1/__0_0.distcp") as f:
                f.write(data)
        elif how == "write_bytes":
            backend.write_bytes("step-1/__0_0.distcp", data)
        else:
            backend.put_files([(str(control), "step-1/__0_0.distcp")],
                              {"step-1/__0_0.distcp": len(data)})
        path = backend.local_path("step-1/__0_0.distcp")
        mapped, waiting = delalloc_extents(path)
        assert mapped and waiting == 0, \
            f"{kind}: {waiting} of {mapped} extents of {path} were still only in memory " \
            f"after close(): a power loss now would lose them"
        with open(path, "rb") as f:
            assert f.read() == data
    finally:
        backend.close()
