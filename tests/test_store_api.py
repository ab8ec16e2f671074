"""The Store API of the contract: ids, latest/list, keep/every, pin/unpin, overwrite, verify,
errors on load, gc and close."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tierstore
from tierstore import CheckpointNotFound, CommitError, IntegrityError


def save(store, cid, value=1.0, n=1000):
    dcp.save({"w": torch.full((n,), value), "step": cid}, storage_writer=store.writer(),
             checkpoint_id=cid)


def load(store, cid, n=1000):
    out = {"w": torch.zeros(n), "step": None}
    dcp.load(out, storage_reader=store.reader(), checkpoint_id=cid)
    return out


def entries(path):
    return sorted(os.listdir(path)) if os.path.exists(path) else []


@pytest.mark.parametrize("bad", ["../x", "a/b", "", ".hidden", "with space", "x\n", "a" * 300])
def test_invalid_ids_are_value_errors_before_anything_is_written(store, local_config, bad):
    root = local_config["tier"][0]["path"]
    with pytest.raises(ValueError, match="checkpoint"):
        save(store, bad)
    assert entries(root) == []
    with pytest.raises(ValueError):
        load(store, bad)


def test_a_missing_id_is_refused_even_after_an_earlier_save(store, local_config):
    writer = store.writer()
    dcp.save({"w": torch.ones(3)}, storage_writer=writer, checkpoint_id="step-1")
    # DCP does not call reset without an id; the writer must not reuse the previous one.
    # DCP wraps errors raised inside its collective steps in CheckpointException (a
    # BaseException); the user still reads our message in it.
    with pytest.raises(CheckpointException, match="without a checkpoint id"):
        dcp.save({"w": torch.zeros(3)}, storage_writer=writer)
    reader = store.reader()
    dcp.load({"w": torch.zeros(3)}, storage_reader=reader, checkpoint_id="step-1")
    with pytest.raises(CheckpointException, match="needs a checkpoint id"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=reader)
    assert entries(local_config["tier"][0]["path"]) == ["step-1"]


def test_latest_and_list_newest_first(store):
    assert store.latest() is None and store.list() == []
    for cid in ("step-10", "step-9", "final"):
        save(store, cid)
    assert store.latest() == "final"  # newest means most recently committed
    infos = store.list()
    assert [i.id for i in infos] == ["final", "step-9", "step-10"]
    assert all(i.tiers == ["nvme"] and i.size_bytes > 4000 and not i.pinned for i in infos)
    assert infos[1].step == 9 and infos[0].step == 3  # no trailing integer: the 3rd save
    assert infos[0].created <= infos[0].committed


def test_keep_deletes_oldest_but_never_pinned(tmp_path):
    config = {"tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path), "keep": 2}]}
    with tierstore.open(config) as store:
        save(store, "step-1")
        store.pin("step-1")
        for step in range(2, 6):
            save(store, f"step-{step}")
        assert [i.id for i in store.list()] == ["step-5", "step-4", "step-1"]
        assert store.list()[-1].pinned
        store.unpin("step-1")
        save(store, "step-6")
        assert [i.id for i in store.list()] == ["step-6", "step-5"]
    assert entries(tmp_path) == ["step-5", "step-6"]


def test_every_on_a_single_tier_counts_trailing_integers_or_saves(tmp_path):
    config = {"tier": [{"name": "ram", "backend": "memory", "path": str(tmp_path / "a")},
                       {"name": "nvme", "backend": "local", "path": str(tmp_path / "b"),
                        "every": 2}]}
    with tierstore.open(config) as store:
        # step-3 goes to the first tier that takes it: ram (every 1); step-4 also to ram first.
        save(store, "step-3")
        assert store.list()[0].tiers == ["ram"]
        assert store._ctx.tiers.take_save(4)[0].name == "ram"
    config = {"tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "c"),
                        "every": 1}]}
    with tierstore.open(config) as store:
        assert [store._ledger.step_for("alpha"), store._ledger.step_for("beta"), store._ledger.step_for("step-7")] == [1, 2, 7]


def test_saving_an_existing_id_is_refused_and_loses_nothing(store):
    save(store, "step-1", value=1.0)
    with pytest.raises(CommitError) as info:
        save(store, "step-1", value=2.0)
    msg = str(info.value)
    assert "checkpoint 'step-1' already exists on tier 'nvme'" in msg and "overwrite = true" in msg
    assert torch.equal(load(store, "step-1")["w"], torch.full((1000,), 1.0))


def test_overwrite_replaces_and_keeps_the_pin(tmp_path):
    config = {"store": {"overwrite": True},
              "tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path)}]}
    with tierstore.open(config) as store:
        save(store, "step-1", value=1.0)
        store.pin("step-1")
        save(store, "step-1", value=2.0)
        assert torch.equal(load(store, "step-1")["w"], torch.full((1000,), 2.0))
        assert store.list()[0].pinned
    assert entries(tmp_path) == ["step-1"]


def test_loading_a_missing_checkpoint_says_what_exists(store):
    save(store, "step-1")
    with pytest.raises(CheckpointNotFound) as info:
        load(store, "step-2")
    msg = str(info.value)
    assert "checkpoint 'step-2' is not complete on any tier (nvme)" in msg
    assert "newest available: step-1" in msg and "store.latest()" in msg


def test_a_checkpoint_without_manifest_does_not_exist(store, local_config):
    save(store, "step-1")
    save(store, "step-2")
    root = local_config["tier"][0]["path"]
    os.remove(os.path.join(root, "step-2", "tierstore.json"))
    assert store.latest() == "step-1"
    with pytest.raises(CheckpointNotFound):
        load(store, "step-2")
    # A truncated data file also makes the copy incomplete (sizes are checked without reading).
    data = os.path.join(root, "step-1", "__0_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(10)
    assert store.latest() is None


def test_corrupt_byte_is_found_by_verify_and_never_loaded(store, local_config):
    save(store, "step-1", value=3.0, n=200_000)
    assert store.verify("step-1").ok
    path = os.path.join(local_config["tier"][0]["path"], "step-1", "__0_0.distcp")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    report = store.verify("step-1")
    assert not report.ok and report.tiers == ["nvme"]
    assert [p.file for p in report.problems] == ["__0_0.distcp"]
    assert "checksum" in str(report)
    with pytest.raises(CheckpointException) as info:
        load(store, "step-1", n=200_000)
    assert isinstance(info.value.failures[0][0], IntegrityError)
    assert "__0_0.distcp" in str(info.value) and "checksum mismatch" in str(info.value)


def test_verify_of_unknown_id_and_unknown_tier(store):
    # An id no tier holds is not a report of problems but a missing checkpoint (issue 14, #9).
    with pytest.raises(CheckpointNotFound, match="cannot verify 'step-404': no tier holds it"):
        store.verify("step-404")
    with pytest.raises(ValueError, match="no tier named 'tape'"):
        store.verify("step-404", tier="tape")


@pytest.mark.parametrize("backend", ["local", "fsspec"])
def test_keep_in_a_process_sharing_the_directory_never_evicts_a_checkpoint_being_pinned(
        tmp_path, monkeypatch, backend):
    """``keep`` evicts only under an exclusive lock on the checkpoint's directory, and a pin
    holds it shared from reading the manifest to rewriting it: another process sharing the
    directory (a node's leader applying ``keep``) is refused meanwhile, and the checkpoint
    stays whole and pinned. (An eviction in between made the rewrite fail on the missing
    directory, or, on an object store, bring back a manifest whose files were gone.)"""
    from tierstore_plugins.fsspec_backend import FsspecBackend
    from tierstore_plugins.local import LocalBackend

    from tierstore.tiers.tier import Tier

    root = tmp_path / "t"
    if backend == "local":
        config = {"tier": [{"name": "t", "backend": "local", "path": str(root)}]}
        neighbour = LocalBackend(str(root))
    else:
        config = {"tier": [{"name": "t", "backend": "fsspec", "url": f"file://{root}"}]}
        neighbour = FsspecBackend(str(root), url=f"file://{root}")
    with tierstore.open(config) as store:
        save(store, "step-1", value=3.0)
    armed, refused = [], []
    complete_manifest = Tier.complete_manifest

    def evicting_meanwhile(self, cid):
        manifest = complete_manifest(self, cid)
        if armed:  # the neighbour's keep, between the pin's read and its rewrite
            lock = neighbour.lock_directory(cid, exclusive=True)
            refused.append(lock is None)
            if lock is not None:
                try:
                    neighbour.delete(cid)
                finally:
                    lock.release()
        return manifest

    monkeypatch.setattr(Tier, "complete_manifest", evicting_meanwhile)
    with tierstore.open(config) as store:
        armed.append(True)
        store.pin("step-1")
        armed.clear()
    assert refused == [True], refused
    monkeypatch.undo()
    with open(root / "step-1" / "tierstore.json") as f:
        assert json.load(f)["pinned"] is True
    with tierstore.open(config) as store:
        assert torch.equal(load(store, "step-1")["w"], torch.full((1000,), 3.0))
    lock = neighbour.lock_directory("step-1", exclusive=True)
    assert lock is not None  # the pin let it go
    lock.release()
    neighbour.close()


def _from_another_thread(fn, *args) -> None:
    """Run ``fn(*args)`` on a thread of its own, as a user's monitoring thread would, and
    wait for it (a store call that hangs fails the test)."""
    import threading

    errors: list[BaseException] = []

    def run():
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"{fn.__name__} did not return"
    if errors:
        raise errors[0]


class _PinWhileDraining:
    """Pins ``step-1`` from another thread as its drain to tier ``disk`` is about to commit:
    after the drain read the flag, before the copy there is complete."""

    def __init__(self):
        self.store = None

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail):
        if phase == "drain_commit" and tier == "disk" and checkpoint_id == "step-1":
            _from_another_thread(self.store.pin, "step-1")


def test_a_pin_during_a_drain_pins_the_copy_it_commits(tmp_path):
    pinner = _PinWhileDraining()
    config = {"tier": [{"name": "ram", "backend": "memory", "path": str(tmp_path / "ram"),
                        "keep": 1},
                       {"name": "disk", "backend": "local", "path": str(tmp_path / "disk"),
                        "keep": 1}]}
    with tierstore.open(config, plugins=[pinner]) as store:
        pinner.store = store
        save(store, "step-1", value=1.0)
        store.wait()
        for step in (2, 3):  # keep = 1 on both tiers: only a pin keeps step-1
            save(store, f"step-{step}", value=float(step))
            store.wait()
        assert store.list()[-1].id == "step-1" and store.list()[-1].pinned
    for tier in ("ram", "disk"):
        manifest = json.loads((tmp_path / tier / "step-1" / "tierstore.json").read_text())
        assert manifest["pinned"] is True, f"step-1 is not pinned on {tier}"
    with tierstore.open({"tier": [config["tier"][1]]}) as disk_only:
        assert torch.equal(load(disk_only, "step-1")["w"], torch.full((1000,), 1.0))


def test_a_pin_after_keep_chose_its_victims_keeps_the_checkpoint(tmp_path, monkeypatch):
    from tierstore.tiers.tier import Tier

    config = {"tier": [{"name": "ram", "backend": "memory", "path": str(tmp_path / "ram"),
                        "keep": 1}]}
    choose = Tier.retention_victims
    pinned_late = []

    def slow_listing(self, manifests):
        victims = choose(self, manifests)
        if "step-1" in victims and not pinned_late:
            # A slow listing: the user pins step-1 (its only copy) after the choice.
            pinned_late.append(True)
            _from_another_thread(store.pin, "step-1")
        return victims

    monkeypatch.setattr(Tier, "retention_victims", slow_listing)
    with tierstore.open(config) as store:
        save(store, "step-1", value=1.0)
        save(store, "step-2", value=2.0)  # keep = 1 chooses step-1
        assert pinned_late
        assert [(i.id, i.pinned) for i in store.list()] == [("step-2", False), ("step-1", True)]
        assert torch.equal(load(store, "step-1")["w"], torch.full((1000,), 1.0))
        save(store, "step-3", value=3.0)  # and the next pass keeps it too
        assert [i.id for i in store.list()] == ["step-3", "step-1"]


def test_pin_unknown_checkpoint(store):
    with pytest.raises(CheckpointNotFound, match="cannot pin 'step-3'"):
        store.pin("step-3")


def test_manifest_describes_the_checkpoint(store, local_config):
    save(store, "step-12")
    with open(os.path.join(local_config["tier"][0]["path"], "step-12", "tierstore.json")) as f:
        manifest = json.load(f)
    files = manifest["files"]
    assert ".metadata" in files and any(k.endswith(".distcp") for k in files)
    assert all(v["checksum"].startswith("xxh3_128:") and v["size"] > 0 for v in files.values())
    assert manifest["world_size"] == 1 and manifest["step"] == 12 and manifest["pinned"] is False
    assert manifest["torch_version"] == torch.__version__
    assert manifest["tierstore_version"] == tierstore.__version__
    assert manifest["plugins"] == {"backend": "local", "commit": "atomic", "staging": "cpu"}
    assert manifest["codecs"] == []


def test_gc_removes_leftovers_only(store, local_config):
    save(store, "step-1")
    root = local_config["tier"][0]["path"]
    os.makedirs(os.path.join(root, ".tierstore-tmp.step-2.abcdef"))
    with open(os.path.join(root, ".tierstore-tmp.step-2.abcdef", "__0_0.distcp"), "wb") as f:
        f.write(b"partial")
    assert store.gc() == ["nvme:.tierstore-tmp.step-2.abcdef"]
    assert entries(root) == ["step-1"]


def test_closed_store_refuses_work(local_config):
    store = tierstore.open(local_config)
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.writer()


def test_async_save_through_the_writer(store):
    sd = {"w": torch.randn(1000)}
    fut = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
    fut.result()
    assert store.latest() == "step-1"
    out = {"w": torch.zeros(1000)}
    dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    assert torch.equal(out["w"], sd["w"])


def test_gc_never_touches_a_users_own_stock_checkpoint_in_the_root(store, local_config):
    root = local_config["tier"][0]["path"]
    os.makedirs(root, exist_ok=True)
    dcp.save({"w": torch.ones(10)}, checkpoint_id=os.path.join(root, "from-stock-dcp"))
    save(store, "step-1")
    assert store.gc() == []
    assert entries(root) == ["from-stock-dcp", "step-1"]
    assert [c.id for c in store.list()] == ["step-1"]


def test_a_delete_cut_short_leaves_a_hidden_entry_that_gc_removes(store, local_config):
    save(store, "step-1")
    save(store, "step-2")
    root = local_config["tier"][0]["path"]
    # What Tier.delete does before removing files: the rename aside, then a crash.
    os.rename(os.path.join(root, "step-1"), os.path.join(root, ".tierstore-trash.step-1.0a1b"))
    assert [c.id for c in store.list()] == ["step-2"]
    assert store.gc() == ["nvme:.tierstore-trash.step-1.0a1b"]
    assert entries(root) == ["step-2"]


def test_no_thread_of_a_store_outlives_its_close(tmp_path):
    """Background work (drains, their copy threads, the watchdog) ends with ``close()``: a
    thread left running into the interpreter's exit can take the process down with it."""
    import threading

    config = {"store": {"watchdog": 30},
              "tier": [{"name": "fast", "backend": "local", "path": str(tmp_path / "fast")},
                       {"name": "slow", "backend": "fsspec", "url": f"file://{tmp_path}/slow"}]}
    before = {t.ident for t in threading.enumerate()}
    store = tierstore.open(config)
    save(store, "step-1")
    save(store, "step-2")
    store.close()
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert left == [], left
    assert (tmp_path / "slow/step-2/tierstore.json").exists()  # the drains were done
