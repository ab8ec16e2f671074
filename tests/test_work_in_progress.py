"""Work in progress belongs to its writer: a store's gc never removes a save, a drain or a
replica that another store (another process, another job) is still writing on the same tier."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore import Phase


class HoldAt:
    """Blocks the save that reaches ``phase`` until released."""

    def __init__(self, phase: str):
        self.phase = phase
        self.reached = threading.Event()
        self.release = threading.Event()

    @tierstore.hookimpl
    def tierstore_phase(self, phase):
        if phase == self.phase:
            self.reached.set()
            assert self.release.wait(60), "the test never released the held save"


def _config(tmp_path):
    return {"tier": [{"name": "disk", "backend": "local", "path": str(tmp_path / "disk")}]}


def test_another_stores_gc_spares_a_save_in_progress(tmp_path):
    """On a local directory the second store may not save beside the first (one job per
    directory: its save is refused before it writes), but its gc, as an operator's
    ``tierstore gc`` beside the job, must still spare the save in progress."""
    _another_stores_gc_spares_a_save_in_progress(_config(tmp_path), second_saves=False)
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["a"]


def test_another_stores_gc_spares_a_save_in_progress_on_an_object_store(seaweed, s3_bucket):
    """No file locks there: the writer holds a lease, renewed while it writes."""
    config = {"tier": [{"name": "s3", "backend": "fsspec", "url": s3_bucket,
                        "options": seaweed.storage_options(), "lease_seconds": 2}]}
    _another_stores_gc_spares_a_save_in_progress(config, slow=3)
    fs = seaweed.filesystem()
    bucket = s3_bucket.split("://", 1)[1]
    assert sorted(fs.ls(bucket, detail=False)) == [f"{bucket}/a", f"{bucket}/b"]
    assert not [k for k in fs.find(bucket) if ".tierstore-" in k]  # markers and leases gone


def _another_stores_gc_spares_a_save_in_progress(config, slow: float = 0,
                                                  second_saves: bool = True):
    """Two stores on one tier: save "a" is held just before its metadata while the other store
    saves "b" (its gc runs first) and runs gc; then "a" goes on and commits. ``slow``: seconds
    "a" stays held (longer than a lease, so that only renewal keeps it). Without
    ``second_saves`` (a tier that takes one job's saves only), the other store's save is
    refused as another job's and only its gc runs."""
    hold = HoldAt(Phase.WRITE_METADATA)
    sd_a = {"a": torch.arange(10_000, dtype=torch.float32)}
    sd_b = {"b": torch.arange(10_000, dtype=torch.float64)}
    errors: list[BaseException] = []
    with tierstore.open(config, plugins=[hold]) as first, tierstore.open(config) as second:
        def save_a():
            try:
                dcp.save(sd_a, storage_writer=first.writer(), checkpoint_id="a")
            except BaseException as exc:  # reported below
                errors.append(exc)

        thread = threading.Thread(target=save_a)
        thread.start()
        assert hold.reached.wait(60)
        time.sleep(slow)
        if second_saves:
            dcp.save(sd_b, storage_writer=second.writer(), checkpoint_id="b")  # gc runs first
        else:
            with pytest.raises(tierstore.TierInUseError, match="another store of this process"):
                dcp.save(sd_b, storage_writer=second.writer(), checkpoint_id="b")
        assert second.gc() == []  # and an explicit gc spares it too
        hold.release.set()
        thread.join(60)
        assert errors == []
        ids = {"a", "b"} if second_saves else {"a"}
        for store in (first, second):
            assert {c.id for c in store.list()} == ids
        out_a, out_b = {"a": torch.zeros(10_000)}, {"b": torch.zeros(10_000, dtype=torch.float64)}
        dcp.load(out_a, storage_reader=second.reader(), checkpoint_id="a")
        if second_saves:
            dcp.load(out_b, storage_reader=first.reader(), checkpoint_id="b")
    assert torch.equal(out_a["a"], sd_a["a"])
    assert not second_saves or torch.equal(out_b["b"], sd_b["b"])


def test_gc_still_removes_what_a_dead_writer_left(tmp_path):
    """The lock goes with its writer: a staging directory nobody holds is collected."""
    with tierstore.open(_config(tmp_path)) as store:
        dcp.save({"w": torch.ones(4)}, storage_writer=store.writer(), checkpoint_id="step-1")
        left = tmp_path / "disk" / ".tierstore-tmp.step-2.0123456789abcdef"
        left.mkdir()
        (left / "__0_0.distcp").write_bytes(b"partial")
        assert store.gc() == ["disk:.tierstore-tmp.step-2.0123456789abcdef"]
        assert not left.exists()


def test_gc_on_an_object_store_waits_for_a_lease_to_expire(seaweed, s3_bucket):
    """A prefix an interrupted save left (marker, no manifest) is collected once its writer's
    lease expired (the writer was killed: nobody renews it), never while it is current."""
    config = {"tier": [{"name": "s3", "backend": "fsspec", "url": s3_bucket,
                        "options": seaweed.storage_options()}]}
    fs = seaweed.filesystem()
    bucket = s3_bucket.split("://", 1)[1]
    now = time.time()
    for cid, expires in (("step-1", now - 3600), ("step-2", now + 3600)):
        fs.pipe_file(f"{bucket}/{cid}/.tierstore-pending", b"0123456789abcdef")
        fs.pipe_file(f"{bucket}/{cid}/__0_0.distcp", b"partial")
        fs.pipe_file(f"{bucket}/{cid}/.tierstore-lease.0123", json.dumps(
            {"expires": expires, "host": "elsewhere", "pid": 1}).encode())
    with tierstore.open(config) as store:
        assert store.gc() == ["s3:step-1"]
    assert not fs.exists(f"{bucket}/step-1/__0_0.distcp")
    assert fs.exists(f"{bucket}/step-2/__0_0.distcp")


def test_gc_announces_each_removal(tmp_path):
    """An event at every phase: gc announces each leftover just before removing it."""
    seen = []
    left = tmp_path / "disk" / ".tierstore-tmp.step-2.0123456789abcdef"

    class Watch:
        @tierstore.hookimpl
        def tierstore_phase(self, phase, tier, detail):
            if phase == Phase.COLLECT:
                seen.append((tier, detail["entry"], left.exists()))

    with tierstore.open(_config(tmp_path), plugins=[Watch()]) as store:
        left.mkdir(parents=True)
        assert store.gc() == ["disk:.tierstore-tmp.step-2.0123456789abcdef"]
    assert seen == [("disk", left.name, True)] and not left.exists()


class GcRightAfterBegin:
    """Registers ``atomic-gc-after-begin``: the ``atomic`` protocol, except that right after a
    staging directory is made (before its writer locks it) ``collect()`` runs a gc: the window
    where a gc elsewhere used to delete a save, drain or replica that had just begun."""

    def __init__(self, collect):
        from tierstore_plugins.atomic import AtomicRenameCommit

        class Commit(AtomicRenameCommit):
            def begin(self, backend, checkpoint_id, token):
                staging = super().begin(backend, checkpoint_id, token)
                collect()
                return staging

        self.commit = Commit

    @tierstore.hookimpl
    def tierstore_register_commit_protocols(self, register):
        register("atomic-gc-after-begin", self.commit)


def _gc_window_config(tmp_path):
    return {"store": {"commit": "atomic-gc-after-begin"},
            "tier": [{"name": "disk", "backend": "local", "path": str(tmp_path / "disk")}]}


def test_gc_of_the_same_store_spares_a_drain_between_its_directory_and_its_lock(tmp_path):
    """A store's drain and its next save run on different threads: the gc the save runs must
    spare the drain's directory even before the drain locks it (it spares it by its token)."""
    collected, stores = [], []
    plugin = GcRightAfterBegin(lambda: collected.append(stores[0].gc()))
    config = {"store": {"commit": "atomic-gc-after-begin"},
              "tier": [{"name": "ram", "backend": "memory", "path": str(tmp_path / "ram")},
                       {"name": "disk", "backend": "local", "path": str(tmp_path / "disk")}]}
    with tierstore.open(config, plugins=[plugin]) as store:
        stores.append(store)
        sd = {"w": torch.arange(1000, dtype=torch.float32)}
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()  # the drain to "disk" began (and gc ran) on the drain thread
        out = {"w": torch.zeros(1000)}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
        assert store.verify("step-1", tier="disk").ok
    assert collected == [[], []] and torch.equal(out["w"], sd["w"])
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["step-1"]


@pytest.mark.parametrize("elsewhere", ["another store", "another process"])
def test_a_save_whose_directory_is_collected_before_its_lock_makes_it_again(tmp_path,
                                                                            elsewhere):
    """``tierstore gc`` in another process (or another store's gc in this one) removes the new staging directory (nobody holds it
    yet); the writer's lock notices and the save makes its directory again, once."""
    config = _gc_window_config(tmp_path)
    toml = tmp_path / "tiers.toml"
    toml.write_text(f'[[tier]]\nname = "disk"\nbackend = "local"\npath = "{tmp_path / "disk"}"\n')
    printed = []

    def gc_elsewhere():
        if printed:  # the first attempt only: the directory made again is then locked
            return
        if elsewhere == "another store":
            with tierstore.open(str(toml)) as other:
                printed.append("".join(f"removed {r}\n" for r in other.gc()))
            return
        printed.append(subprocess.run(
            [sys.executable, "-m", "tierstore.cli", "gc", str(toml)], capture_output=True,
            text=True, check=True, timeout=120).stdout)

    with tierstore.open(config, plugins=[GcRightAfterBegin(gc_elsewhere)]) as store:
        sd = {"w": torch.arange(1000, dtype=torch.float32)}
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        out = {"w": torch.zeros(1000)}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    assert printed[0].startswith("removed disk:.tierstore-tmp.step-1.")
    assert torch.equal(out["w"], sd["w"])
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["step-1"]
