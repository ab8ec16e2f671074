"""Repairs that never destroy a good copy, retention that never stalls a healthy tier, and
leases that stay dropped (issue 25, findings 3, 7 and 10).

The object store is the real SeaweedFS of ``conftest.py``; "slow" and "flaky" mean its process
really stopped (SIGSTOP) and continued (SIGCONT), "dies" that it is killed (SIGKILL) and started
again on its data, at a chosen phase of the store, announced through tierstore's own
``tierstore_phase`` hook. (A write to a stopped server can wait forever: no client timeout
covers a request body the server does not read, so writes are cut off by killing it.)
"""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed.checkpoint as dcp
from tierstore_plugins.fsspec_backend import FsspecBackend
from tierstore_plugins.leases import LeaseKeeper

import tierstore
from tierstore.engine.drain import PendingCopy
from tierstore.events import Phase

DATA = "__0_0.distcp"
MANIFEST = "tierstore.json"


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g),
            "step": seed}


def _tiers(tmp_path, seaweed, bucket, *, ram: dict | None = None, cold: dict | None = None,
           retry_seconds: float = 2, max_attempts: int = 2) -> list[dict]:
    """A local tier ``ram`` and an S3 tier ``cold`` whose calls give up soon on a stopped
    server (1 s read timeout, ``retry_seconds``)."""
    options = seaweed.storage_options(config_kwargs={"read_timeout": 1, "connect_timeout": 1})
    return [{"name": "ram", "backend": "local", "path": str(tmp_path / "ram"), **(ram or {})},
            {"name": "cold", "backend": "fsspec", "url": f"{bucket}/run", "options": options,
             "max_attempts": max_attempts, "retry_seconds": retry_seconds, **(cold or {})}]


def _key(bucket: str, cid: str, rel: str) -> str:
    return f"{bucket.split('://', 1)[1]}/run/{cid}/{rel}"


def _corrupt(seaweed, bucket: str, cid: str, rel: str = DATA) -> None:
    """Flip the last byte of an object, with a client of its own (rot on the server)."""
    fs = seaweed.filesystem()
    good = fs.cat_file(_key(bucket, cid, rel))
    fs.pipe_file(_key(bucket, cid, rel), good[:-1] + bytes([good[-1] ^ 1]))


class _Server:
    """Stops, continues, kills and restarts the S3 server's process; ``resume()`` and
    ``revive()`` are safe to call when there is nothing to undo."""

    def __init__(self, seaweed):
        self.seaweed = seaweed

    def stop(self) -> None:
        os.kill(self.seaweed.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.seaweed.running():
            os.kill(self.seaweed.pid, signal.SIGCONT)

    def kill(self) -> None:
        self.seaweed.kill()

    def revive(self) -> None:
        if not self.seaweed.running():
            self.seaweed.restart()


class _AtPhases:
    """A plugin running ``actions[(phase, tier)]`` the first time the store announces that
    phase on that tier (for ``checkpoint_id`` only, when given), in the announcing thread."""

    def __init__(self, actions: dict, checkpoint_id: str | None = None):
        self.actions, self.checkpoint_id = dict(actions), checkpoint_id
        self.armed = True
        self.seen: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, detail):
        if self.checkpoint_id is not None and checkpoint_id != self.checkpoint_id:
            return
        with self._lock:
            action = self.actions.pop((phase, tier), None) if self.armed else None
            if action is not None:
                self.seen.append((phase, tier))
        if action is not None:
            action()


def _verified_good(config: dict, cid: str, tier: str) -> tierstore.VerifyReport:
    """``verify`` of one copy from a fresh store (nothing cached, no tier marked down)."""
    with tierstore.open(config) as store:
        return store.verify(cid, tier=tier)


# -- finding 3: repair --------------------------------------------------------------------------

def test_scrub_repair_against_a_flaky_object_store_leaves_its_good_copy_alone(
        tmp_path, seaweed, s3_bucket):
    """The server stops while the archive copy is re-read (no answer), comes back when a
    repair would begin and dies while it would copy: a copy that did not answer is not a bad
    copy, so nothing is rewritten and the archive copy is still good afterwards."""
    config = {"tier": _tiers(tmp_path, seaweed, s3_bucket)}
    with tierstore.open(config) as store:
        dcp.save(_state(1), storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
    server = _Server(seaweed)
    flaky = _AtPhases({(Phase.VERIFY_FILE, "cold"): server.stop,
                       (Phase.DRAIN_BEGIN, "cold"): server.resume,
                       (Phase.DRAIN_FILE, "cold"): server.kill})
    try:
        with tierstore.open(config, plugins=[flaky]) as store:
            report = store.scrub(repair=True)
            flaky.armed = False
            server.resume()
            server.revive()
    finally:
        server.resume()
        server.revive()
    assert report.repaired == [] and report.bad == []
    assert [(p.tier, p.checkpoint_id) for p in report.unrepaired] == [("cold", "step-1")]
    assert "did not answer" in report.unrepaired[0].what
    assert flaky.seen == [(Phase.VERIFY_FILE, "cold")]  # no repair began
    assert _verified_good(config, "step-1", "cold").ok


def test_a_repair_cut_off_midway_on_an_object_store_keeps_the_old_copy(
        tmp_path, seaweed, s3_bucket):
    """The data object of the archive copy rots; its repair is cut off (the server dies) as
    it writes: the copy keeps its manifest and its good files, and the next scrub repairs it."""
    config = {"tier": _tiers(tmp_path, seaweed, s3_bucket)}
    with tierstore.open(config) as store:
        dcp.save(_state(1), storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
    _corrupt(seaweed, s3_bucket, "step-1")
    server = _Server(seaweed)
    cut = _AtPhases({(Phase.DRAIN_FILE, "cold"): server.kill})
    try:
        with tierstore.open(config, plugins=[cut]) as store:
            report = store.scrub(repair=True)
            server.revive()
    finally:
        server.revive()
    assert cut.seen == [(Phase.DRAIN_FILE, "cold")]
    assert report.repaired == []
    assert [(p.tier, p.file) for p in report.unrepaired] == [("cold", DATA)]
    assert "the repair failed" in report.unrepaired[0].what
    after = _verified_good(config, "step-1", "cold")
    # Still a committed copy, bad only where it was bad: its manifest and metadata are there.
    assert [(p.tier, p.file) for p in after.problems] == [("cold", DATA)]
    with tierstore.open(config) as store:
        assert store.verify("step-1", tier="ram").ok  # the source, untouched
        again = store.scrub(repair=True)
        assert [(r.checkpoint_id, r.tier, r.files, r.source) for r in again.repaired] == [
            ("step-1", "cold", [DATA], "ram")]
        assert again.ok
    assert _verified_good(config, "step-1", "cold").ok


def test_a_repair_keeps_its_source_from_keep_while_it_copies(tmp_path, seaweed, s3_bucket):
    """While the archive copy is repaired from the only good copy, a save lands on that copy's
    tier, whose keep = 1 would evict it: it is spared until the repair is done."""
    config = {"tier": _tiers(tmp_path, seaweed, s3_bucket, ram={"keep": 1})}
    with tierstore.open(config) as store:
        dcp.save(_state(1), storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
    _corrupt(seaweed, s3_bucket, "step-1")
    repairing, saved = threading.Event(), threading.Event()

    def hold_repair():
        repairing.set()
        assert saved.wait(120), "the save beside the repair did not end"

    at_begin = _AtPhases({(Phase.DRAIN_BEGIN, "cold"): hold_repair}, checkpoint_id="step-1")
    reports = []
    with tierstore.open(config, plugins=[at_begin]) as store:
        scrub = threading.Thread(target=lambda: reports.append(store.scrub(repair=True)))
        scrub.start()
        try:
            assert repairing.wait(120), "the repair never began"
            dcp.save(_state(2), storage_writer=store.writer(), checkpoint_id="step-2")
        finally:
            saved.set()
            scrub.join(120)
        store.wait()
        (report,) = reports
        assert [(r.checkpoint_id, r.tier, r.source) for r in report.repaired] == [
            ("step-1", "cold", "ram")]
        assert report.ok
        # keep = 1 takes step-1 off the local tier once nothing reads it any more
        assert [(i.id, i.tiers) for i in store.list()] == [
            ("step-2", ["ram", "cold"]), ("step-1", ["cold"])]
    assert _verified_good(config, "step-1", "cold").ok


# -- finding 7: retention per tier --------------------------------------------------------------

def test_a_save_returns_while_keep_on_a_stopped_object_store_is_stuck(
        tmp_path, seaweed, s3_bucket):
    """The drain applies keep = 1 on the S3 tier and the server stops right then: that pass
    waits for the server (retried for minutes), and a save on the local tier, whose own keep
    runs meanwhile, returns all the same."""
    config = {"tier": _tiers(tmp_path, seaweed, s3_bucket, ram={"keep": 3},
                             cold={"keep": 1}, retry_seconds=600, max_attempts=1000)}
    server = _Server(seaweed)
    stuck = threading.Event()

    def stop_server():
        server.stop()
        stuck.set()

    at_keep = _AtPhases({(Phase.RETAIN, "cold"): stop_server})
    at_keep.armed = False
    saved = threading.Event()
    try:
        with tierstore.open(config, plugins=[at_keep]) as store:
            def training():  # one thread saves, as a training loop does
                dcp.save(_state(1), storage_writer=store.writer(), checkpoint_id="step-1")
                store.wait()
                at_keep.armed = True
                dcp.save(_state(2), storage_writer=store.writer(), checkpoint_id="step-2")
                assert stuck.wait(120), "the drain never applied keep on the S3 tier"
                dcp.save(_state(3), storage_writer=store.writer(), checkpoint_id="step-3")
                saved.set()

            trainer = threading.Thread(target=training, daemon=True)
            trainer.start()
            assert stuck.wait(120), "the drain never applied keep on the S3 tier"
            # The pass on S3 retries for 600 s: a save that waits for it does not end here.
            returned = saved.wait(120)
            still_stuck = PendingCopy("step-2", "cold") in store.pending()
            server.resume()
            trainer.join(120)
            store.wait()
            assert returned and still_stuck, "the save waited for keep on the stopped tier"
            listed = [(i.id, i.tiers) for i in store.list()]
    finally:
        server.resume()
    assert listed == [("step-3", ["ram", "cold"]), ("step-2", ["ram"]), ("step-1", ["ram"])]


# -- finding 10: leases -------------------------------------------------------------------------

def test_a_lease_renewal_in_flight_never_rewrites_a_lease_just_dropped(tmp_path):
    """A renewal is held at the moment it writes the lease object (a slow write); the writer
    lets go of the lease meanwhile. Afterwards no lease object is left: gc and keep may take
    the prefix at once, not lease_seconds + 60 s later."""
    backend = FsspecBackend(f"file://{tmp_path}/tier", url=f"file://{tmp_path}/tier")
    (tmp_path / "tier" / "step-1").mkdir(parents=True)
    renewing, deleted, renewed = threading.Event(), threading.Event(), threading.Event()
    held = {"armed": False}

    def slow_write(path: str, data: bytes) -> None:
        if held["armed"] and threading.current_thread().name == "tierstore-leases":
            held["armed"] = False
            renewing.set()
            # A correct keeper never deletes the lease while its renewal writes: then this
            # waits the full second, in vain, and writes.
            deleted.wait(1.0)
            backend.write_bytes(path, data)
            renewed.set()
            return
        backend.write_bytes(path, data)

    def delete(path: str) -> None:
        backend.delete(path)
        deleted.set()

    backend.leases = keeper = LeaseKeeper(0.3, slow_write, delete)
    try:
        lease = backend.lock_directory("step-1", exclusive=False)
        assert backend.lock_directory("step-1", exclusive=True) is None  # it holds
        held["armed"] = True
        assert renewing.wait(30), "the lease was never renewed"
        releaser = threading.Thread(target=lease.release)
        releaser.start()
        releaser.join(30)
        assert not releaser.is_alive()
        assert renewed.wait(30)
    finally:
        keeper.close()
    leftover = [p.name for p in (tmp_path / "tier" / "step-1").iterdir()]
    assert leftover == []
    assert backend.lock_directory("step-1", exclusive=True) is not None
