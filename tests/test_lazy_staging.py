"""Lazy staging (``lazy = true``: ``dcp.async_save`` returns before the copy, DCP's
``AsyncSaveResponse`` says when it is done) and the staging memory budget (``max_staging_bytes``
smaller than the state dict: waves through one buffer, spilled to the first tier, never a
failure), as a training loop uses them."""

from __future__ import annotations

import copy
import io
import json
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import (assert_trees_equal, free_port, load_like, make_async_state,
                     mutate_everything, run_script)
from recording import Recorder
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import tierstore
import tierstore.engine.saves
from tierstore import EventKind


def tiers(tmp_path: Path, staging: dict) -> dict:
    return {"store": {"staging": staging},
            "tier": [{"name": "ram", "backend": "local", "path": str(tmp_path / "ram"), "keep": 2},
                     {"name": "disk", "backend": "local", "path": str(tmp_path / "disk")}]}


def tensor_bytes(tree) -> tuple[int, int]:
    """(all bytes of tensor data in ``tree``, the largest tensor's)."""
    sizes = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            sizes.append(v.numel() * v.element_size())
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(tree)
    return sum(sizes), max(sizes)


def training_state(seed: int = 0) -> dict:
    """make_async_state (nested, non-contiguous, 0-d, bf16, bool, BytesIO, ints) plus tensors
    of several sizes, one of them larger than a quarter of the whole."""
    sd = make_async_state(seed)
    g = torch.Generator().manual_seed(seed + 1)
    sd["layers"] = [torch.randn(256, 64, generator=g), torch.randn(3000, generator=g).double(),
                    torch.randn(7, 5, generator=g)]
    return sd


def hold_the_staging_thread(store) -> threading.Event:
    """Keep the store's staging thread busy until the returned event is set: the next lazy
    copy starts only then (what a machine busy elsewhere does at random)."""
    gate = threading.Event()
    store._stager._worker.submit(lambda: gate.wait(60))
    return gate


def no_spill_left(root: Path) -> bool:
    return not [n for n in os.listdir(root) if n.startswith(".tierstore-tmp.spill")]


@pytest.mark.parametrize("staging", ["cpu", "pinned", "shm"])
def test_lazy_save_returns_at_once_and_holds_the_values_of_the_call(tmp_path, staging):
    sd = training_state()
    with tierstore.open(tiers(tmp_path, {"name": staging, "lazy": True})) as store:
        expected = []
        for i in range(3):
            resp = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id=f"step-{i}")
            assert isinstance(resp, AsyncSaveResponse)
            expected.append(copy.deepcopy(sd))
            resp.staging_completion.result()
            # Training changes every tensor (and the BytesIO) right after the staging completes.
            mutate_everything(sd)
            resp.upload_completion.result()
        store.wait()
        for i in (1, 2):
            assert_trees_equal(load_like(store, f"step-{i}", expected[i]), expected[i])


def test_a_hooked_optimizer_steps_only_once_the_state_is_copied(tmp_path):
    """A real loop with no explicit wait: the optimizer step (which changes every parameter
    and Adam moment in place) runs right after async_save; the step pre-hook makes it wait,
    so each checkpoint is the state at its call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 512))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = Recorder()
    with tierstore.open(tiers(tmp_path, {"name": "cpu", "lazy": True}), plugins=[rec]) as store:
        handle = store.hook_optimizer(opt)
        snapshots, responses = {}, []
        for step in range(4):
            opt.zero_grad()
            model(torch.randn(32, 512)).square().mean().backward()
            if step:
                sd = {"model": model.state_dict(), "optim": opt.state_dict()}
                snapshots[step] = copy.deepcopy(sd)
                responses.append(dcp.async_save(sd, storage_writer=store.writer(),
                                                checkpoint_id=f"step-{step}"))
            opt.step()
        for resp in responses:
            resp.upload_completion.result()
        handle.remove()
        store.wait()
        for step in (2, 3):
            assert_trees_equal(load_like(store, f"step-{step}", snapshots[step]), snapshots[step])
        staged = [e for e in rec.events if e.kind == EventKind.STAGED]
        assert [e.detail["lazy"] for e in staged] == [True] * 3


def test_batchnorm_statistics_changed_by_the_next_forward_are_saved_as_at_the_call(tmp_path):
    """Forward changes BatchNorm's running statistics in place, long before the optimizer step
    the hook guards: lazy staging copies the smallest tensors at the call, so the next step's
    forward can start at once and each checkpoint still holds the state of its call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 2048),
                                torch.nn.BatchNorm1d(2048), torch.nn.ReLU(),
                                torch.nn.Linear(2048, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with tierstore.open(tiers(tmp_path, {"name": "cpu", "lazy": True})) as store:
        store.hook_optimizer(opt)
        snapshots, responses = {}, []
        for step in range(4):
            opt.zero_grad()
            model(torch.randn(64, 256)).square().mean().backward()  # running stats change here
            opt.step()
            sd = {"model": model.state_dict(), "optim": opt.state_dict()}
            snapshots[step] = copy.deepcopy(sd)
            responses.append(dcp.async_save(sd, storage_writer=store.writer(),
                                            checkpoint_id=f"step-{step}"))
        for resp in responses:
            resp.upload_completion.result()
        store.wait()
        for step in (2, 3):
            got = load_like(store, f"step-{step}", snapshots[step])
            assert_trees_equal(got, snapshots[step])
            assert not torch.equal(got["model"]["0.running_mean"],
                                   snapshots[step - 1]["model"]["0.running_mean"])


def test_a_change_before_the_lazy_copy_fails_that_save_clearly_and_loses_nothing(tmp_path):
    """Training that changes a tensor before the lazy copy took it (no hook, no wait): the
    version counter shows it, the save fails through both futures with a message that names
    the tensor and the fix, nothing is committed, and the checkpoint before still loads."""
    sd = {f"t{i}": torch.full((4 << 20,), float(i)) for i in range(16)}  # 256 MiB
    with tierstore.open(tiers(tmp_path, {"name": "cpu", "lazy": True})) as store:
        first = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        first.upload_completion.result()
        gate = hold_the_staging_thread(store)
        resp = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-2")
        sd["t15"].add_(1)  # the optimizer step, too early: the copy has not started
        gate.set()
        with pytest.raises(tierstore.StagingError) as info:
            resp.staging_completion.result()
        message = str(info.value)
        assert "tensor 't15' was changed in place while lazy staging was copying it" in message
        assert "store.hook_optimizer(optimizer)" in message
        with pytest.raises(tierstore.StagingError):
            resp.upload_completion.result()
        assert store.latest() == "step-1"
        assert not (tmp_path / "ram" / "step-2").exists()
        got = load_like(store, "step-1", {"t15": sd["t15"]})
        assert torch.equal(got["t15"], torch.full((4 << 20,), 15.0))
        # The next save, waited for as documented, goes through.
        resp = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-3")
        store.wait_staging()
        resp.upload_completion.result()
        assert store.latest() == "step-3"


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
@pytest.mark.parametrize("fraction", [4, 16])
def test_a_budget_smaller_than_the_state_stages_in_waves_and_round_trips(tmp_path, fraction, lazy):
    sd = training_state()
    total, largest = tensor_bytes(sd)
    budget = total // fraction
    rec = Recorder()
    staging = {"name": "cpu", "lazy": lazy, "max_staging_bytes": budget}
    with tierstore.open(tiers(tmp_path, staging), plugins=[rec]) as store:
        expected = []
        for i in range(3):
            resp = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id=f"step-{i}")
            if lazy:
                resp.staging_completion.result()
            expected.append(copy.deepcopy(sd))
            mutate_everything(sd)
            getattr(resp, "upload_completion", resp).result()
        store.wait()
        for i in (1, 2):
            assert_trees_equal(load_like(store, f"step-{i}", expected[i]), expected[i])
        staged = [e for e in rec.events if e.kind == EventKind.STAGED]
        assert len(staged) == 3
        for event in staged:
            assert event.nbytes == total
            assert event.detail["waves"] > 1
            # The bound: the budget, or the largest tensor where it is larger.
            assert event.detail["buffer_bytes"] <= max(budget, largest) + 64
        # The spilled waves became the data files (written once), checksums and all.
        adopted = [e for e in rec.events if e.kind == EventKind.WRITTEN
                   and e.detail.get("from") == "spill" and e.checkpoint_id == "step-2"]
        assert len(adopted) == staged[-1].detail["waves"]
        assert store.verify("step-2").ok
    # No lock-in: stock DCP reads the budgeted checkpoint from the tier's directory.
    got = copy.deepcopy(expected[2])
    mutate_everything(got)
    dcp.load(got, checkpoint_id=str(tmp_path / "ram" / "step-2"))
    assert_trees_equal(got, expected[2])
    assert no_spill_left(tmp_path / "ram")


@pytest.mark.parametrize("budget", [8190, 8192, 8193])
def test_a_budget_of_any_byte_count_works(tmp_path, budget):
    """Budgets that are not a multiple of an element size (a quarter of a state, say)."""
    sd = {f"w{i}": torch.randn(1000) for i in range(8)}
    staging = {"name": "cpu", "lazy": True, "max_staging_bytes": budget}
    with tierstore.open(tiers(tmp_path, staging)) as store:
        dcp.async_save(sd, storage_writer=store.writer(),
                       checkpoint_id="step-1").upload_completion.result()
        assert_trees_equal(load_like(store, "step-1", sd), sd)
        assert store._stager.allocated_bytes <= budget


def test_a_budgeted_save_to_a_tier_with_codecs_copies_the_spilled_records_through_them(
        tmp_path):
    """The spill holds plain records; a first tier with zstd gets them encoded, item by item,
    in the data files (and the spill files are not taken as they are)."""
    sd = training_state()
    rec = Recorder()
    config = tiers(tmp_path, {"name": "cpu", "lazy": True,
                              "max_staging_bytes": tensor_bytes(sd)[0] // 4})
    config["tier"][0]["codecs"] = ["zstd"]
    with tierstore.open(config, plugins=[rec]) as store:
        resp = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        resp.staging_completion.result()
        expected = copy.deepcopy(sd)
        mutate_everything(sd)
        resp.upload_completion.result()
        store.wait()
        assert_trees_equal(load_like(store, "step-1", expected), expected)
        assert store.verify("step-1").ok
        assert not [e for e in rec.events if e.kind == EventKind.WRITTEN
                    and e.detail.get("from") == "spill"]
        assert no_spill_left(tmp_path / "ram")


def test_a_state_that_fits_the_budget_again_goes_back_to_whole_buffers(tmp_path):
    rec = Recorder()
    staging = {"name": "cpu", "max_staging_bytes": 64 << 10}
    with tierstore.open(tiers(tmp_path, staging), plugins=[rec]) as store:
        big = {f"w{i}": torch.randn(8 << 10) for i in range(8)}  # 256 KiB: waves
        small = {"w0": torch.randn(1000)}  # fits
        for i, sd in enumerate([big, small, small, big]):
            dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id=f"step-{i}").result()
        staged = [e for e in rec.events if e.kind == EventKind.STAGED]
        assert [e.detail["waves"] > 1 for e in staged] == [True, False, False, True]
        assert [e.detail["reused"] for e in staged] == [False, False, True, False]
        assert_trees_equal(load_like(store, "step-3", big), big)


def test_non_tensor_values_are_taken_at_the_call_in_every_mode(tmp_path):
    for staging in ({"name": "cpu", "lazy": True},
                    {"name": "cpu", "lazy": True, "max_staging_bytes": 1024}):
        sd = {"w": torch.randn(4096), "blob": io.BytesIO(b"before"), "meta": {"lr": [0.1]}}
        with tierstore.open(tiers(tmp_path / str(len(staging)), staging)) as store:
            resp = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
            sd["blob"] = io.BytesIO(b"after")  # replaced and changed before the copy is done
            sd["meta"]["lr"].append(0.2)
            resp.upload_completion.result()
            got = {"w": torch.zeros(4096), "blob": io.BytesIO(), "meta": {"lr": []}}
            dcp.load(got, storage_reader=store.reader(), checkpoint_id="step-1")
            assert got["blob"].getvalue() == b"before" and got["meta"]["lr"] == [0.1]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("staging", [
    {"name": "shm", "lazy": True},
    {"name": "shm", "lazy": True, "budget_fraction": 4},
    {"name": "cpu", "budget_fraction": 16},
], ids=["shm-lazy", "shm-lazy-quarter", "cpu-eager-sixteenth"])
def test_lazy_and_budgeted_saves_with_the_process_executor_round_trip(tmp_path, staging):
    proc = run_script("async_process_worker.py", tmp_path / "tiers", json.dumps(staging),
                      free_port(), timeout=200)
    assert proc.returncode == 0 and "PROCESS EXECUTOR OK" in proc.stdout, \
        f"{proc.stdout}\n{proc.stderr[-8000:]}"
    assert ("WAVES" in proc.stdout) == ("budget_fraction" in staging), proc.stdout


@pytest.mark.timeout(120)
def test_a_plain_save_during_a_lazy_staging_waits_for_that_save(tmp_path):
    """dcp.save on the training thread while a lazy async_save is still copying: the plain save
    waits for the async one (one save in flight), and both commit."""
    sd = {f"t{i}": torch.full((4 << 20,), float(i)) for i in range(8)}  # 128 MiB
    with tierstore.open(tiers(tmp_path, {"name": "cpu", "lazy": True})) as store:
        resp = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        other = {"w": torch.ones(10)}
        dcp.save(other, storage_writer=store.writer(), checkpoint_id="step-2")
        resp.upload_completion.result(timeout=60)
        store.wait()
        assert [c.id for c in store.list()] == ["step-2", "step-1"]
        assert_trees_equal(load_like(store, "step-1", sd), sd)
        assert_trees_equal(load_like(store, "step-2", other), other)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["lazy", "budget"])
def test_a_dtensor_changed_before_the_lazy_copy_fails_that_save(tmp_path, mode):
    """FSDP2's DTensors: an in-place op bumps the DTensor's version, not its local tensor's;
    the change is caught all the same."""
    proc = run_script("lazy_dtensor_worker.py", tmp_path, free_port(), mode, timeout=150)
    assert proc.returncode == 0 and "DETECTED" in proc.stdout, \
        f"{proc.stdout}\n{proc.stderr[-6000:]}"
    assert "tensor 'w7' was changed in place" in proc.stdout, proc.stdout


def test_tensors_in_a_tuple_under_a_budget_are_saved_with_their_values(tmp_path):
    """DCP pickles a tuple whole (a BYTE_IO item): a budgeted staging copies it whole instead
    of putting placeholders in it."""
    sd = {"w": torch.randn(4096), "pair": (torch.arange(6.0), 3),
          "nested": [(torch.ones(2), "x")]}
    staging = {"name": "cpu", "lazy": True, "max_staging_bytes": 4096}
    with tierstore.open(tiers(tmp_path, staging)) as store:
        dcp.async_save(sd, storage_writer=store.writer(),
                       checkpoint_id="step-1").upload_completion.result()
        got = {"w": torch.zeros(4096), "pair": None, "nested": None}
        dcp.load(got, storage_reader=store.reader(), checkpoint_id="step-1")
    assert torch.equal(got["w"], sd["w"])
    assert torch.equal(got["pair"][0], torch.arange(6.0)) and got["pair"][1] == 3
    assert torch.equal(got["nested"][0][0], torch.ones(2)) and got["nested"][0][1] == "x"


def test_a_long_staging_is_never_taken_for_an_abandoned_save(tmp_path, monkeypatch):
    """A staged save DCP never starts is given up after a grace; a budgeted staging that takes
    longer than that grace is still running, and the next save must wait for it, not remove
    its spill under it."""
    monkeypatch.setattr(tierstore.engine.saves, "_PENDING_GRACE_S", 0.01)
    sd = {f"t{i}": torch.full((4 << 20,), float(i)) for i in range(8)}  # 128 MiB
    staging = {"name": "cpu", "lazy": True, "max_staging_bytes": 32 << 20}
    with tierstore.open(tiers(tmp_path, staging)) as store:
        first = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        second = dcp.async_save({"w": torch.ones(10)}, storage_writer=store.writer(),
                                checkpoint_id="step-2")
        first.upload_completion.result()
        second.upload_completion.result()
        store.wait()
        assert_trees_equal(load_like(store, "step-1", sd), sd)


@pytest.mark.timeout(180)
def test_a_sharded_tensor_under_a_budget_is_copied_whole_and_round_trips(tmp_path):
    """FSDP1's ShardedTensor beside plain tensors, with a budget between the plain tensors'
    bytes and the whole state's (that once sent staging between whole buffers and waves
    forever)."""
    proc = run_script("budget_sharded_worker.py", tmp_path, free_port(), timeout=150)
    assert proc.returncode == 0 and "SHARDED OK" in proc.stdout, \
        f"{proc.stdout}\n{proc.stderr[-6000:]}"
