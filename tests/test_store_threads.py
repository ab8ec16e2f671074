"""Store calls from a thread other than the one that saved: once a save is over (a synchronous
``dcp.save`` returned, an ``async_save``'s future completed), ``latest``, ``wait``, ``load`` and
``save`` from another thread return; while a save is in flight they wait for it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_trees_equal, load_like

import tierstore
from tierstore import Phase

#: how long a store call on another thread may take before the test calls it hung
_HANG_S = 60


def _config(tmp_path: Path) -> dict:
    return {"store": {"staging": "cpu"},
            "tier": [{"name": "ram", "backend": "local", "path": str(tmp_path / "ram")},
                     {"name": "disk", "backend": "local", "path": str(tmp_path / "disk")}]}


def _state(value: float) -> dict:
    return {"w": torch.full((1000,), value), "step": torch.tensor(int(value))}


def _on_another_thread(calls: list[tuple[str, Callable[[], object]]]) -> dict[str, object]:
    """Run ``calls`` in order on a thread of their own (a user's monitoring or checkpointing
    thread) and return their results by name; fail naming the first call that did not return
    within ``_HANG_S`` seconds, or raise the first call's error."""
    results: dict[str, object] = {}
    errors: list[BaseException] = []
    at: list[str] = []

    def run() -> None:
        try:
            for name, call in calls:
                at.append(name)
                results[name] = call()
        except BaseException as exc:  # noqa: BLE001 - raised on the test's thread below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)  # a hung call must not hang the exit
    thread.start()
    thread.join(_HANG_S)
    assert not thread.is_alive(), f"store.{at[-1]}() on another thread did not return"
    if errors:
        raise errors[0]
    return results


def _every_call(store, saved: dict, new_id: str) -> dict[str, object]:
    """latest, wait, a load of ``saved['id']`` and a new save, from another thread."""
    return _on_another_thread([
        ("latest", store.latest),
        ("wait", store.wait),
        ("load", lambda: load_like(store, saved["id"], saved["state"])),
        ("save", lambda: dcp.save(_state(9.0), storage_writer=store.writer(),
                                  checkpoint_id=new_id)),
        ("latest_after", store.latest),
    ])


def test_calls_from_another_thread_return_after_a_synchronous_save(tmp_path):
    sd = _state(1.0)
    with tierstore.open(_config(tmp_path)) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        got = _every_call(store, {"id": "step-1", "state": sd}, "step-2")
        assert got["latest"] == "step-1" and got["latest_after"] == "step-2"
        assert_trees_equal(got["load"], sd)
        # And back on the thread that saved first: the other thread's save is over too.
        dcp.save(_state(3.0), storage_writer=store.writer(), checkpoint_id="step-3")
        store.wait()
        assert [c.id for c in store.list()] == ["step-3", "step-2", "step-1"]


def test_calls_from_another_thread_return_after_an_async_save(tmp_path):
    sd = _state(1.0)
    with tierstore.open(_config(tmp_path)) as store:
        dcp.save(_state(0.0), storage_writer=store.writer(), checkpoint_id="step-0")
        dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-1").result()
        got = _every_call(store, {"id": "step-1", "state": sd}, "step-2")
        assert got["latest"] == "step-1" and got["latest_after"] == "step-2"
        assert_trees_equal(got["load"], sd)


def test_calls_from_another_thread_return_after_a_refused_save(tmp_path):
    """A save refused in ``reset`` (its id exists) is over when ``dcp.save`` raises."""
    sd = _state(1.0)
    with tierstore.open(_config(tmp_path)) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        with pytest.raises(tierstore.CommitError, match="already exists"):
            dcp.save(_state(2.0), storage_writer=store.writer(), checkpoint_id="step-1")
        got = _every_call(store, {"id": "step-1", "state": sd}, "step-2")
        assert got["latest"] == "step-1" and got["latest_after"] == "step-2"


class _FailingPlanner(dcp.DefaultSavePlanner):
    """DCP fails the save after the writer's ``reset`` and before any ``write_data``: the
    writer is told nothing more of it (as on a rank whose peer failed)."""

    def create_local_plan(self):
        raise RuntimeError("planner failed on purpose")


def test_calls_from_another_thread_return_after_a_save_dcp_abandoned(tmp_path):
    sd = _state(1.0)
    with tierstore.open(_config(tmp_path)) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        with pytest.raises(BaseException, match="planner failed on purpose"):
            dcp.save(_state(2.0), storage_writer=store.writer(), checkpoint_id="step-5",
                     planner=_FailingPlanner())
        got = _every_call(store, {"id": "step-1", "state": sd}, "step-2")
        assert got["latest"] == "step-1" and got["latest_after"] == "step-2"


class _HoldWrite:
    """Holds the save of ``step-1`` in its first file write until released."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.release = threading.Event()

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id):
        if phase == Phase.WRITE_FILE and checkpoint_id == "step-1":
            self.reached.set()
            assert self.release.wait(_HANG_S), "the test never released the held save"


def test_a_call_from_another_thread_still_waits_for_a_synchronous_save_in_flight(tmp_path):
    """The other side of the rule: while ``dcp.save`` runs on one thread, ``latest()`` on
    another waits for it (and then sees its checkpoint)."""
    hold = _HoldWrite()
    with tierstore.open(_config(tmp_path), plugins=[hold]) as store:
        saver = threading.Thread(target=lambda: dcp.save(
            _state(1.0), storage_writer=store.writer(), checkpoint_id="step-1"), daemon=True)
        saver.start()
        assert hold.reached.wait(_HANG_S)
        answers: list[object] = []
        asker = threading.Thread(target=lambda: answers.append(store.latest()), daemon=True)
        asker.start()
        asker.join(0.5)
        assert asker.is_alive() and answers == [], "latest() did not wait for the save"
        hold.release.set()
        saver.join(_HANG_S)
        asker.join(_HANG_S)
        assert answers == ["step-1"]
