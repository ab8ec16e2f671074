"""Saves that die half-way: SIGKILL at several points of a save (in a subprocess), and a save
failing with an ordinary exception. The previous checkpoint must stay the newest, load bitwise,
and what the dead save left must be hidden, then removed by the next save or by ``store.gc()``."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from helpers import assert_state_dicts_equal, empty_like, load_like, make_state_dict, run_script
from scripts.crash_save import config
from torch.distributed.checkpoint.api import CheckpointException

import tierstore

# (kind, name, nth): where the child kills itself while saving step-2.
KILL_POINTS = {
    "first-file-written": ("event", "written", 1),      # one data file complete, others not
    "second-write_file": ("phase", "write_file", 2),    # files being written in parallel
    "write_metadata": ("phase", "write_metadata", 1),   # every data file done, no .metadata
    "write_manifest": ("phase", "write_manifest", 1),   # .metadata done, no manifest
    "publish": ("phase", "publish", 1),                 # manifest written, right before rename
}


def load(store, cid: str, seed: int) -> None:
    """Load ``cid`` into zeros and check it equals ``make_state_dict(seed)`` bit for bit."""
    want = make_state_dict(seed)
    assert_state_dicts_equal(load_like(store, cid, want), want)


def hidden(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(".tierstore-"))


def crash(root: Path, point: str) -> None:
    kind, name, nth = KILL_POINTS[point]
    proc = run_script("crash_save.py", root, kind, name, nth)
    output = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert "saved step-1" in proc.stdout, output
    assert proc.returncode == -signal.SIGKILL, f"expected death by SIGKILL\n{output}"


def assert_state_after_crash(root: Path, store) -> None:
    assert store.latest() == "step-1"
    assert [c.id for c in store.list()] == ["step-1"]
    load(store, "step-1", seed=1)
    assert not (root / "step-2").exists()
    with pytest.raises(tierstore.CheckpointNotFound, match="step-2"):
        dcp.load(empty_like(make_state_dict(2)), storage_reader=store.reader(),
                 checkpoint_id="step-2")
    left = hidden(root)
    assert left and all(n.startswith(".tierstore-tmp.") for n in left), left


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_sigkill_mid_save_next_save_cleans_up(tmp_path, point):
    root = tmp_path / "tier"
    crash(root, point)
    with tierstore.open(config(str(root))) as store:
        assert_state_after_crash(root, store)
        dcp.save(make_state_dict(3), storage_writer=store.writer(),
                 checkpoint_id="step-3")
        assert hidden(root) == []
        assert store.latest() == "step-3"
        assert [c.id for c in store.list()] == ["step-3", "step-1"]
        load(store, "step-3", seed=3)
        load(store, "step-1", seed=1)
        # The id the dead save wanted is free: saving it now works.
        dcp.save(make_state_dict(2), storage_writer=store.writer(),
                 checkpoint_id="step-2")
        load(store, "step-2", seed=2)
        assert hidden(root) == []
    assert sorted(os.listdir(root)) == ["step-1", "step-2", "step-3"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", ["second-write_file", "publish"])
def test_sigkill_mid_save_gc_cleans_up(tmp_path, point):
    root = tmp_path / "tier"
    crash(root, point)
    with tierstore.open(config(str(root))) as store:
        assert_state_after_crash(root, store)
        before = hidden(root)
        removed = store.gc()
        assert sorted(removed) == [f"disk:{n}" for n in before]
        assert hidden(root) == []
        assert store.gc() == []
        assert store.latest() == "step-1"
        assert [c.id for c in store.list()] == ["step-1"]
        load(store, "step-1", seed=1)
    assert os.listdir(root) == ["step-1"]


class FailAt:
    """Raises an ordinary exception just before ``phase`` of ``checkpoint_id``."""

    def __init__(self, phase: str, checkpoint_id: str):
        self.phase, self.checkpoint_id = phase, checkpoint_id
        self.armed = True

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail):
        if self.armed and phase == self.phase and checkpoint_id == self.checkpoint_id:
            raise RuntimeError(f"injected disk failure before {phase} of {checkpoint_id}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("phase", ["write_file", "write_metadata", "write_manifest", "publish"])
def test_save_failing_with_exception_keeps_previous(tmp_path, phase):
    root = tmp_path / "tier"
    fault = FailAt(phase, "step-2")
    with tierstore.open(config(str(root)), plugins=[fault]) as store:
        dcp.save(make_state_dict(1), storage_writer=store.writer(),
                 checkpoint_id="step-1")
        writer = store.writer()
        with pytest.raises(CheckpointException) as info:
            dcp.save(make_state_dict(2), storage_writer=writer,
                     checkpoint_id="step-2")
        assert f"injected disk failure before {phase} of step-2" in str(info.value)
        assert store.latest() == "step-1"
        assert [c.id for c in store.list()] == ["step-1"]
        assert not (root / "step-2").exists()
        load(store, "step-1", seed=1)

        # The same writer saves again once the fault is gone; nothing hidden stays behind.
        fault.armed = False
        dcp.save(make_state_dict(2), storage_writer=writer, checkpoint_id="step-2")
        assert store.latest() == "step-2"
        load(store, "step-2", seed=2)
        load(store, "step-1", seed=1)
        assert hidden(root) == [], "the next save did not remove what the failed save left"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("phase", ["write_file", "write_metadata", "write_manifest", "publish"])
def test_gc_removes_what_a_failed_save_left_in_this_process(tmp_path, phase):
    root = tmp_path / "tier"
    with tierstore.open(config(str(root)), plugins=[FailAt(phase, "step-2")]) as store:
        dcp.save(make_state_dict(1), storage_writer=store.writer(),
                 checkpoint_id="step-1")
        with pytest.raises(CheckpointException, match="injected disk failure"):
            dcp.save(make_state_dict(2), storage_writer=store.writer(),
                     checkpoint_id="step-2")
        left = hidden(root)
        removed = store.gc()
        assert hidden(root) == [], f"gc() left {hidden(root)} (removed {removed})"
        assert sorted(removed) == [f"disk:{n}" for n in left]
        assert store.latest() == "step-1"
        load(store, "step-1", seed=1)
