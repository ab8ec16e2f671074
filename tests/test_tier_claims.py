"""One job per tier directory: a second job saving into a directory another job saves into is
refused before it writes anything, and the first job's checkpoints stay its own.

Two jobs of one user on one node share the default ``memory`` path. Before claims, each
replaced the other's checkpoints of the same id: one job's drain found its step-8 file holding
the other job's bytes (same size, another digest: the "intermittent mismatch" of a busy machine,
where another run was saving beside it), and one job's open copied the other's checkpoints into
its own disk tier.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import uuid
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from helpers import (assert_state_dicts_equal, load_like, make_state_dict, run_script,
                     run_torchrun)
from scripts.claim_job import config

import tierstore
from tierstore import TierInUseError


@pytest.fixture
def ram():
    """A RAM tier's directory of this test's own, on tmpfs."""
    path = Path("/dev/shm") / f"tierstore-test-{uuid.uuid4().hex[:12]}"
    yield str(path)
    shutil.rmtree(path, ignore_errors=True)


def _files(root: str, cid: str) -> dict[str, bytes]:
    folder = Path(root) / cid
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_second_job_on_a_held_ram_tier_is_refused_and_takes_nothing(ram, tmp_path):
    steps = (1, 2, 3)
    with tierstore.open(config(ram, str(tmp_path / "disk-a"))) as store:
        for step in steps[:2]:
            dcp.save(make_state_dict(step), storage_writer=store.writer(),
                     checkpoint_id=f"step-{step}")
        store.wait()
        before = _files(ram, "step-1")

        # Another job, same RAM directory, its own disk: its save of the same id is refused.
        other_disk = tmp_path / "disk-b"
        proc = run_script("claim_job.py", ram, other_disk, "save")
        lines = proc.stdout.splitlines()
        assert proc.returncode == 0, proc.stderr
        assert lines[0].startswith("TierInUseError: tier 'ram' ("), lines
        assert ram in lines[0] and "in use by another job" in lines[0]
        assert f"pid {os.getpid()}" in lines[0]
        assert "Nothing was written" in lines[0]
        # It copied none of this job's checkpoints to its own disk, and wrote nothing here.
        assert [n for n in json.loads(lines[1]) if not n.startswith(".")] == [], lines
        assert _files(ram, "step-1") == before

        # This job goes on: its checkpoints are its own on every tier.
        dcp.save(make_state_dict(steps[2]), storage_writer=store.writer(),
                 checkpoint_id=f"step-{steps[2]}")
        store.wait()
    for tier in config(ram, str(tmp_path / "disk-a"))["tier"]:
        with tierstore.open({"tier": [tier]}, read_only=True) as alone:
            for step in steps:
                got = load_like(alone, f"step-{step}", make_state_dict(0))
                assert_state_dicts_equal(got, make_state_dict(step))


def test_a_killed_job_leaves_no_claim_and_its_restart_finds_its_checkpoints(ram, tmp_path):
    proc = run_script("claim_job.py", ram, tmp_path / "disk", "die")
    assert proc.stdout.splitlines() == ["saved"], proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGKILL
    with tierstore.open(config(ram, str(tmp_path / "disk"))) as store:
        assert store.latest() == "step-2"
        assert_state_dicts_equal(load_like(store, "step-2", make_state_dict(0)),
                                 make_state_dict(2))
        dcp.save(make_state_dict(3), storage_writer=store.writer(), checkpoint_id="step-3")
        store.wait()
    with tierstore.open(config(ram, str(tmp_path / "disk"))) as store:
        assert_state_dicts_equal(load_like(store, "step-3", make_state_dict(0)),
                                 make_state_dict(3))


def test_a_second_open_store_of_one_process_is_refused_until_the_first_closes(ram, tmp_path):
    first = tierstore.open(config(ram, str(tmp_path / "disk")))
    try:
        dcp.save(make_state_dict(1), storage_writer=first.writer(), checkpoint_id="step-1")
        with tierstore.open(config(ram, str(tmp_path / "disk"))) as second:
            with pytest.raises(TierInUseError, match="another store of this process") as err:
                dcp.save(make_state_dict(2), storage_writer=second.writer(),
                         checkpoint_id="step-2")
            assert "close it before opening a new one" in str(err.value)
            assert not (Path(ram) / "step-2").exists()
    finally:
        first.close()
    with tierstore.open(config(ram, str(tmp_path / "disk"))) as second:
        dcp.save(make_state_dict(2), storage_writer=second.writer(), checkpoint_id="step-2")
        second.wait()
        assert [c.id for c in second.list()] == ["step-2", "step-1"]


def test_readers_and_queries_beside_a_job_claim_nothing(ram, tmp_path):
    with tierstore.open(config(ram, str(tmp_path / "disk"))) as store:
        dcp.save(make_state_dict(1), storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
        # A read-only store (what `tierstore ls` opens) and a store that only loads (an
        # evaluation beside training) both work while the job holds the tier.
        with tierstore.open(config(ram, str(tmp_path / "disk")), read_only=True) as query:
            assert query.latest() == "step-1"
        with tierstore.open(config(ram, str(tmp_path / "disk"))) as evaluation:
            assert_state_dicts_equal(load_like(evaluation, "step-1", make_state_dict(0)),
                                     make_state_dict(1))
        dcp.save(make_state_dict(2), storage_writer=store.writer(), checkpoint_id="step-2")
        store.wait()


def test_a_claim_file_of_garbage_held_by_someone_is_an_unknown_job(ram, tmp_path):
    """A claim's bytes are untrusted: a record that is no JSON object still refuses the save
    (someone holds the directory), naming no process rather than failing to parse."""
    import fcntl

    from tierstore_plugins.claims import CLAIMS_DIR

    os.makedirs(ram)
    st = os.stat(ram)
    os.makedirs(CLAIMS_DIR, exist_ok=True)
    path = os.path.join(CLAIMS_DIR, f"{st.st_dev:x}-{st.st_ino:x}")
    with open(path, "wb") as f:
        f.write(b"\xff[not json")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_SH)  # held, as a live job's would be
        with tierstore.open(config(ram, str(tmp_path / "disk"))) as store:
            with pytest.raises(TierInUseError, match=r"another job \(its claim names no process\)"):
                dcp.save(make_state_dict(1), storage_writer=store.writer(),
                         checkpoint_id="step-1")
    os.unlink(path)


def test_every_rank_is_refused_alike_when_another_job_holds_one_nodes_directory(tmp_path):
    """Under torchrun, a node-local RAM tier of two parts, the second held by another job:
    both ranks get the TierInUseError naming it (none goes on into DCP's collectives alone),
    and nothing is written on either."""
    from tierstore_plugins.claims import claim_root

    held_dir = tmp_path / "ram" / "1"
    held_dir.mkdir(parents=True)
    fd = os.open(held_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        claim = claim_root(fd, "another-job")
    finally:
        os.close(fd)
    assert not isinstance(claim, str)
    try:
        run_torchrun("claim_ranks_worker.py", tmp_path)
    finally:
        claim.release()
