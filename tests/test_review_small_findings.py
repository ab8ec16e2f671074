"""Smaller paths where a store could lose or misreport data: a directory lock that cannot be
taken, a retry's lost cause, gc reporting removals that did not happen, a manifest without a
seal, and the demo deleting what it did not make. Each on real files, locks and processes."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore.errors import IntegrityError
from tierstore.format.manifest import MANIFEST_NAME, Manifest
from tierstore.format.manifest_check import SEAL_KEY
from tierstore.format.signing import Keyring
from tierstore.plugin.retry import GaveUp, RetryPolicy, with_retries

from tierstore_plugins.local import _nobody_holds


# -- (a) a lock that cannot be taken is never "nobody holds it" ------------------------------

HOLDER = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
    fcntl.lockf(fd, fcntl.LOCK_SH)   # a POSIX read lock: what a writer's shared flock is on NFS
    print("held", flush=True)
    sys.stdin.read()                 # until the test closes stdin
""")


def test_exclusive_lock_refused_by_the_filesystem_is_answered_by_who_holds_it(tmp_path):
    """NFS turns an exclusive flock on a read-only directory descriptor into EBADF; the
    directory is then deleted only when no other process holds a lock on it."""
    work = tmp_path / ".tierstore-tmp.step-1.abc"
    work.mkdir()
    fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
    refused = OSError(errno.EBADF, os.strerror(errno.EBADF))
    try:
        assert _nobody_holds(fd, refused, str(work))  # nobody: it may be collected
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(work)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            assert not _nobody_holds(fd, refused, str(work))  # a writer holds it: kept
        finally:
            holder.stdin.close()
            holder.wait(timeout=30)
        assert _nobody_holds(fd, refused, str(work))
    finally:
        os.close(fd)


def test_a_lock_that_fails_for_real_keeps_the_directory(tmp_path):
    """A descriptor on which no lock works at all (an O_PATH one refuses flock and fcntl locks
    with EBADF, as a mount without locks refuses them): the answer is "keep it", not "nobody
    holds it"."""
    work = tmp_path / ".tierstore-tmp.step-1.abc"
    work.mkdir()
    fd = os.open(work, os.O_PATH | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError) as failed:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert not _nobody_holds(fd, failed.value, str(work))
        assert not _nobody_holds(fd, OSError(errno.ENOLCK, "no locks"), str(work))
    finally:
        os.close(fd)


# -- (b) GaveUp keeps its cause ----------------------------------------------------------------

def test_gave_up_names_the_last_error_as_its_cause():
    errors = [ConnectionResetError(f"attempt {n}") for n in range(3)]
    calls = iter(errors)

    def call():
        raise next(calls)

    with pytest.raises(GaveUp) as gave_up:
        with_retries(call, RetryPolicy(max_attempts=3, base_delay=0, max_delay=0), "reading x")
    assert gave_up.value.__cause__ is errors[-1]


# -- (c) gc reports only what it removed -------------------------------------------------------

def _chattr(flag: str, path) -> bool:
    return shutil.which("chattr") is not None and subprocess.run(
        ["chattr", flag, str(path)], capture_output=True).returncode == 0


def test_gc_does_not_report_a_leftover_it_could_not_remove(tmp_path, caplog):
    root = tmp_path / "disk"
    config = {"tier": [{"name": "disk", "backend": "local", "path": str(root)}]}
    with tierstore.open(config) as store:
        dcp.save({"w": torch.ones(4)}, storage_writer=store.writer(), checkpoint_id="step-1")
    leftover = root / ".tierstore-tmp.step-2.0123456789abcdef"
    (leftover / "sub").mkdir(parents=True)
    stuck = leftover / "sub" / "__0_0.distcp"
    stuck.write_bytes(b"x" * 16)
    if not _chattr("+i", stuck):
        pytest.skip("no immutable files here (chattr +i needs root on ext4/xfs/btrfs)")
    try:
        with tierstore.open(config) as store:
            assert store.gc() == []  # it is still there: not reported as removed
        assert stuck.exists()
        assert "could not remove all of leftover" in caplog.text
    finally:
        _chattr("-i", stuck)
    with tierstore.open(config) as store:
        assert store.gc() == [f"disk:{leftover.name}"]  # removable now: removed and said
    assert not leftover.exists()
    assert os.listdir(root) == ["step-1"]


# -- (d) a manifest without a seal -------------------------------------------------------------

def _unsealed(tmp_path) -> bytes:
    root = tmp_path / "disk"
    with tierstore.open({"tier": [{"name": "disk", "backend": "local",
                                   "path": str(root)}]}) as store:
        dcp.save({"w": torch.ones(4)}, storage_writer=store.writer(), checkpoint_id="step-1")
    data = json.loads((root / "step-1" / MANIFEST_NAME).read_bytes())
    del data[SEAL_KEY]
    return json.dumps(data).encode()


def test_a_manifest_without_a_seal_is_refused(tmp_path):
    with pytest.raises(IntegrityError, match="no seal"):
        Manifest.from_json(_unsealed(tmp_path))


def test_a_manifest_without_a_seal_is_read_under_accept_unsigned(tmp_path):
    manifest = Manifest.from_json(_unsealed(tmp_path), Keyring(accept_unsigned=True))
    assert manifest.checkpoint_id == "step-1"


def test_a_store_does_not_list_an_unsealed_copy_unless_told(tmp_path):
    raw = _unsealed(tmp_path)
    (tmp_path / "disk" / "step-1" / MANIFEST_NAME).write_bytes(raw)
    tier = {"name": "disk", "backend": "local", "path": str(tmp_path / "disk")}
    with tierstore.open({"tier": [tier]}) as store:
        assert store.list() == []
    with tierstore.open({"store": {"accept_unsigned": True}, "tier": [tier]}) as store:
        assert [i.id for i in store.list()] == ["step-1"]


# -- (e) the demo deletes only what it made ----------------------------------------------------

def test_demo_dir_keeps_what_was_there(tmp_path):
    mine = tmp_path / "shm" / "notes.txt"
    mine.parent.mkdir()
    mine.write_text("the user's")
    (tmp_path / "tiers.toml").write_text("# the user's config\n")
    proc = subprocess.run([sys.executable, "-m", "tierstore.demo", "--dir", str(tmp_path),
                           "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert mine.read_text() == "the user's"
    assert (tmp_path / "tiers.toml").read_text() == "# the user's config\n"
