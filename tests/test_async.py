"""dcp.async_save through store.writer(): staging into reused buffers, what training may do once
a save has staged, one save in flight, the memory bound, errors through the future, and the
process executor (in a subprocess, which DCP needs a process group for). Lazy staging and
the budget's waves: tests/test_lazy_staging.py."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import (assert_trees_equal, free_port, load_like, make_async_state,
                     mutate_everything, run_script)
from recording import Recorder

import tierstore
from tierstore import EventKind


def two_tiers(tmp_path: Path, staging: str | dict = "cpu") -> dict:
    return {"store": {"staging": staging},
            "tier": [{"name": "ram", "backend": "local", "path": str(tmp_path / "ram"), "keep": 2},
                     {"name": "disk", "backend": "local", "path": str(tmp_path / "disk")}]}


@pytest.mark.parametrize("staging", ["cpu", "pinned", "shm"])
def test_async_save_round_trips_bitwise_and_ignores_later_mutation(tmp_path, staging):
    sd = make_async_state()
    with tierstore.open(two_tiers(tmp_path, staging)) as store:
        expected = []
        for i in range(3):
            fut = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id=f"step-{i}")
            expected.append(copy.deepcopy(sd))
            # Training changes every tensor (and the BytesIO) right after the save staged.
            mutate_everything(sd)
            fut.result()
        store.wait()
        assert store.latest() == "step-2"
        for i in (1, 2):  # ram keeps 2, disk has all
            assert_trees_equal(load_like(store, f"step-{i}", expected[i]), expected[i])
        assert [c.tiers for c in store.list()][0] == ["ram", "disk"]


def test_buffers_are_reused_while_the_layout_holds_and_reallocated_when_it_changes(tmp_path):
    rec = Recorder()
    sd = {"w": torch.randn(100, 10), "b": torch.randn(10)}
    with tierstore.open(two_tiers(tmp_path), plugins=[rec]) as store:
        dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-1").result()
        dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-2").result()
        grown = {"w": torch.randn(200, 10), "b": torch.randn(10)}  # a shape changed
        dcp.async_save(grown, storage_writer=store.writer(), checkpoint_id="step-3").result()
        retyped = {"w": grown["w"].double(), "b": grown["b"]}  # a dtype changed
        dcp.async_save(retyped, storage_writer=store.writer(), checkpoint_id="step-4").result()
        store.wait()
        staged = [e for e in rec.events if e.kind == EventKind.STAGED]
        assert [e.detail["reused"] for e in staged] == [False, True, False, False]
        assert staged[0].nbytes == 100 * 10 * 4 + 10 * 4
        assert_trees_equal(load_like(store, "step-3", grown), grown)
        assert_trees_equal(load_like(store, "step-4", retyped), retyped)


def test_staging_reuses_buffers_for_nested_state_and_never_shares_what_training_changes(tmp_path):
    """The per-save walk of reused buffers: nested dicts, lists, tuples, an OrderedDict,
    Parameters, scalars and a BytesIO; every staged tensor is a copy, the BytesIO too."""
    from collections import OrderedDict
    import io

    layer = torch.nn.Linear(8, 4)
    sd = {"model": OrderedDict(weight=layer.weight, bias=layer.bias),
          "optim": {"state": {"exp_avg": [torch.randn(8, 4), torch.randn(4)],
                              "pair": (torch.tensor(3.0), torch.arange(5))},
                    "lr": 0.1, "name": "adam"},
          "blob": io.BytesIO(b"rng-state-1"), "step": 1}
    rec = Recorder()
    with tierstore.open(two_tiers(tmp_path), plugins=[rec]) as store:
        expected = {}
        for i in (1, 2, 3):
            fut = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id=f"step-{i}")
            expected[i] = {"w": layer.weight.detach().clone(), "m": sd["optim"]["state"]["exp_avg"][0].clone(),
                           "blob": sd["blob"].getvalue(), "step": sd["step"]}
            with torch.no_grad():  # training changes everything right after staging
                layer.weight.add_(1)
                sd["optim"]["state"]["exp_avg"][0].mul_(2)
            sd["blob"].write(b"-more")
            sd["step"] += 1
            fut.result()
        store.wait()
        staged = [e for e in rec.events if e.kind == EventKind.STAGED]
        assert [e.detail["reused"] for e in staged] == [False, True, True]
        for i in (1, 2, 3):
            out = {"model": OrderedDict(weight=torch.zeros(4, 8), bias=torch.zeros(4)),
                   "optim": {"state": {"exp_avg": [torch.zeros(8, 4), torch.zeros(4)],
                                       "pair": (torch.zeros(()), torch.zeros(5, dtype=torch.int64))},
                             "lr": None, "name": None},
                   "blob": io.BytesIO(), "step": None}
            dcp.load(out, storage_reader=store.reader(), checkpoint_id=f"step-{i}")
            assert torch.equal(out["model"]["weight"], expected[i]["w"]), i
            assert torch.equal(out["optim"]["state"]["exp_avg"][0], expected[i]["m"]), i
            assert out["blob"].getvalue() == expected[i]["blob"], i
            assert out["step"] == expected[i]["step"] and out["optim"]["lr"] == 0.1


@pytest.mark.parametrize("first, then", [
    ({"a": torch.randn(3), "b": torch.randn(3)}, {"a": torch.randn(3), "c": torch.randn(3)}),
    # (6,) into a (1, 6) buffer would broadcast silently: the saved shape must be the new one
    ({"w": torch.randn(1, 6), "b": torch.randn(4)}, {"w": torch.randn(6), "b": torch.randn(4)}),
], ids=["a key renamed", "a shape changed but not its size"])
def test_staging_reallocates_when_the_layout_changes_at_the_same_bytes(tmp_path, first, then):
    rec = Recorder()
    with tierstore.open(two_tiers(tmp_path), plugins=[rec]) as store:
        dcp.async_save(first, storage_writer=store.writer(), checkpoint_id="step-1").result()
        dcp.async_save(then, storage_writer=store.writer(), checkpoint_id="step-2").result()
        store.wait()
        assert [e.detail["reused"] for e in rec.events if e.kind == EventKind.STAGED] == \
            [False, False]
        assert_trees_equal(load_like(store, "step-2", then), then)


def test_staging_copies_dtensors_bitwise_and_refuses_a_changed_placement():
    """FSDP2's DTensors in an OrderedDict, the way training hands them over, through reused
    buffers (tests/scripts/staging_dtensor_worker.py, one rank on gloo)."""
    proc = run_script("staging_dtensor_worker.py")
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stdout + proc.stderr


def test_shm_staging_buffers_are_in_shared_memory(tmp_path):
    with tierstore.open(two_tiers(tmp_path, "shm")) as store:
        staged = store.writer().stage({"w": torch.randn(8, 8)})
        assert staged["w"].is_shared()
        store._ledger.slot.release_pending()  # staged by hand, never saved


class HoldFirstWrite:
    """Holds the save of step-1 inside its first file write until ``gate`` is set."""

    def __init__(self, gate: threading.Event):
        self.gate = gate

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, detail):
        if phase == tierstore.Phase.WRITE_FILE and checkpoint_id == "step-1":
            self.gate.wait(30)


def test_a_second_async_save_waits_for_the_first(tmp_path):
    """The first save is held inside its file write; the second async_save must not stage over
    its buffers (nor start its collectives) before the first has committed."""
    gate = threading.Event()

    rec = Recorder()
    sd = {"w": torch.full((1000,), 1.0)}
    with tierstore.open(two_tiers(tmp_path), plugins=[HoldFirstWrite(gate), rec]) as store:
        first = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        sd["w"].fill_(2.0)
        threading.Timer(0.5, gate.set).start()
        started = time.perf_counter()
        second = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-2")
        waited = time.perf_counter() - started
        assert first.done(), "the second save returned while the first was still writing"
        second.result()
        store.wait()
        kinds = [(e.kind, e.checkpoint_id) for e in rec.events
                 if e.kind in (EventKind.STAGED, EventKind.COMMITTED) and e.tier in (None, "ram")]
        assert kinds == [(EventKind.STAGED, None), (EventKind.COMMITTED, "step-1"),
                         (EventKind.STAGED, None), (EventKind.COMMITTED, "step-2")]
        assert waited >= 0.4
        first_staged, second_staged = [e for e in rec.events if e.kind == EventKind.STAGED]
        assert first_staged.detail["waited_s"] < 0.4 <= second_staged.detail["waited_s"]
        assert torch.equal(load_like(store, "step-1", sd)["w"], torch.full((1000,), 1.0))
        assert torch.equal(load_like(store, "step-2", sd)["w"], torch.full((1000,), 2.0))


def test_a_plain_save_waits_for_an_async_save_in_flight(tmp_path):
    gate = threading.Event()

    sd = {"w": torch.full((100,), 1.0)}
    with tierstore.open(two_tiers(tmp_path), plugins=[HoldFirstWrite(gate)]) as store:
        first = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        threading.Timer(0.3, gate.set).start()
        dcp.save({"w": torch.full((100,), 2.0)}, storage_writer=store.writer(),
                 checkpoint_id="step-2")
        assert first.done()
        store.wait()
        assert [c.id for c in store.list()] == ["step-2", "step-1"]


def test_a_tensor_larger_than_the_memory_bound_is_staged_alone_not_refused(tmp_path):
    """The bound is never a reason to fail: a tensor larger than it is a wave of its own, in a
    buffer of its size (the bound plus one tensor)."""
    rec = Recorder()
    config = two_tiers(tmp_path, {"name": "cpu", "max_staging_bytes": 1 << 20})
    with tierstore.open(config, plugins=[rec]) as store:
        small = {"w": torch.ones(1000)}
        dcp.async_save(small, storage_writer=store.writer(), checkpoint_id="step-1").result()
        big = {"w": torch.arange(1 << 19, dtype=torch.float32), "b": torch.ones(10)}  # 2 MiB
        dcp.async_save(big, storage_writer=store.writer(), checkpoint_id="step-2").result()
        assert store.latest() == "step-2"
        assert_trees_equal(load_like(store, "step-2", big), big)
        assert_trees_equal(load_like(store, "step-1", small), small)
        staged = [e for e in rec.events if e.kind == EventKind.STAGED]
        assert staged[1].detail["buffer_bytes"] == 2 << 20  # the 2 MiB tensor, not the 1 MiB bound
        assert store._stager.allocated_bytes == 2 << 20


def test_a_negative_memory_bound_is_a_config_error(tmp_path):
    with pytest.raises(tierstore.ConfigError, match="max_staging_bytes"):
        tierstore.open(two_tiers(tmp_path, {"name": "shm", "max_staging_bytes": -1}))


def test_errors_surface_through_the_future(tmp_path):
    sd = {"w": torch.ones(10)}
    with tierstore.open(two_tiers(tmp_path)) as store:
        dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-1").result()
        fut = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        with pytest.raises(BaseException) as info:
            fut.result()
        assert "already exists" in str(info.value)
        # The failed save is over: the next one neither waits forever nor fails.
        dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-2").result()
        assert store.latest() == "step-2"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("staging", ["shm", "cpu"])
def test_process_executor_round_trips_and_drains_from_the_training_process(tmp_path, staging):
    proc = run_script("async_process_worker.py", tmp_path / "tiers", staging, free_port(),
                      timeout=200)
    assert proc.returncode == 0 and "PROCESS EXECUTOR OK" in proc.stdout, \
        f"{proc.stdout}\n{proc.stderr[-8000:]}"
