"""A dead object store never stands between training and its fast tier: with the S3 server
killed, a store whose first tier is local still saves, lists, finds ``latest()`` and loads from
it; the drain to S3 fails as a DrainError naming the tier and resumes once the server is back."""

from __future__ import annotations

import time

import pytest
import torch.distributed.checkpoint as dcp
from helpers import assert_state_dicts_equal, load_like, make_state_dict
from recording import Recorder

import tierstore
from tierstore import DrainError, EventKind, TierstoreError
from tierstore.plugin import GaveUp


def _config(tmp_path, seaweed, bucket):
    return {"tier": [
        {"name": "local", "backend": "local", "path": str(tmp_path / "local")},
        {"name": "s3", "backend": "fsspec", "url": f"{bucket}/run",
         "options": seaweed.storage_options(), "max_attempts": 2, "retry_seconds": 3},
    ]}


def test_a_dead_object_store_leaves_the_local_tier_working(seaweed, s3_bucket, tmp_path):
    config = _config(tmp_path, seaweed, s3_bucket)
    rec = Recorder()
    store = tierstore.open(config, plugins=[rec])
    try:
        dcp.save(make_state_dict(1), storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
        seaweed.kill()

        assert store.latest() == "step-1"
        assert [(c.id, c.tiers) for c in store.list()] == [("step-1", ["local"])]
        assert any(e.kind == EventKind.UNREACHABLE and e.tier == "s3" for e in rec.events)
        dcp.save(make_state_dict(2), storage_writer=store.writer(), checkpoint_id="step-2")
        assert store.latest() == "step-2"
        assert_state_dicts_equal(load_like(store, "step-2", make_state_dict(2)),
                                 make_state_dict(2))
        assert store.verify("step-2").ok  # the tiers that answer; s3 is left out
        with pytest.raises(DrainError) as info:
            store.wait()
        assert (info.value.checkpoint_id, info.value.tier) == ("step-2", "s3")
        assert "still complete on tier 'local'" in str(info.value)
    finally:
        if not seaweed.running():
            seaweed.restart()
        store.close()
    # The server is back: the next store resumes the copy the dead server missed.
    with tierstore.open(config) as store:
        store.wait()
        assert [(c.id, c.tiers) for c in store.list()] == [
            ("step-2", ["local", "s3"]), ("step-1", ["local", "s3"])]
        assert store.verify("step-2", tier="s3").ok


def test_a_job_restarting_during_an_outage_opens_its_store_and_restores(seaweed, s3_bucket,
                                                                         tmp_path):
    """A process restarted while the object store is down opens the store (the tier is marked
    unreachable, not a ConfigError), restores from the local tier and saves; the copy to S3
    is made once the server is back."""
    config = _config(tmp_path, seaweed, s3_bucket)
    with tierstore.open(config) as store:
        dcp.save(make_state_dict(1), storage_writer=store.writer(), checkpoint_id="step-1")
    seaweed.kill()
    rec = Recorder()
    try:
        store = tierstore.open(config, plugins=[rec])
        try:
            assert [(e.kind, e.tier) for e in rec.events if e.kind == EventKind.UNREACHABLE] \
                == [(EventKind.UNREACHABLE, "s3")]
            assert "cannot be connected to" in next(
                e.detail["error"] for e in rec.events if e.kind == EventKind.UNREACHABLE)
            assert store.latest() == "step-1"
            assert_state_dicts_equal(load_like(store, "step-1", make_state_dict(1)),
                                     make_state_dict(1))
            dcp.save(make_state_dict(2), storage_writer=store.writer(), checkpoint_id="step-2")
        finally:
            store.close(wait=False)
    finally:
        if not seaweed.running():
            seaweed.restart()
    with tierstore.open(config) as store:
        store.wait()
        assert [(c.id, c.tiers) for c in store.list()] == [
            ("step-2", ["local", "s3"]), ("step-1", ["local", "s3"])]


def test_a_dead_tier_costs_its_retries_once_per_outage(seaweed, s3_bucket, tmp_path, caplog,
                                                       monkeypatch):
    """The first call that meets the dead server pays its retries; later calls skip the tier
    at once (no retry, one 'unreachable' event) until a probe in the background finds it
    answering again; then it is listed again, in the same store."""
    monkeypatch.setattr("tierstore.engine.health.COOLDOWN_S", 1.0)
    rec = Recorder()
    store = tierstore.open(_config(tmp_path, seaweed, s3_bucket), plugins=[rec])
    try:
        dcp.save(make_state_dict(1), storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
        seaweed.kill()
        assert store.latest() == "step-1"
        def retries_here():  # the background probe retries too, in its own thread
            return len([r for r in caplog.records if r.name == "tierstore.plugin.retry"
                        and r.threadName == "MainThread"])
        retries = retries_here()
        assert retries > 0
        for _ in range(3):
            assert store.latest() == "step-1"
            assert [(c.id, c.tiers) for c in store.list()] == [("step-1", ["local"])]
            time.sleep(0.5)
        assert retries_here() == retries
        assert len([e for e in rec.events if e.kind == EventKind.UNREACHABLE]) == 1
        seaweed.restart()
        deadline = time.monotonic() + 60
        while [c.tiers for c in store.list()] != [["local", "s3"]]:
            assert time.monotonic() < deadline, "the tier never came back"
            time.sleep(0.5)
    finally:
        if not seaweed.running():
            seaweed.restart()
        store.close()


def test_a_dead_server_is_given_up_on_quickly_by_queries_while_drains_keep_retrying(
        seaweed, s3_bucket, tmp_path, caplog, monkeypatch):
    """With a retry budget of a thousand tries over ten minutes, the first ``latest()`` after
    the server dies gives up on it after one retry of the refused connection, answers from the
    local tier and reports the tier ``unreachable``; a ``dcp.load`` then asks nothing of it. A drain
    queued while the server is dead keeps the tier's budget: it retries until the server is
    back on the same port, then completes."""
    monkeypatch.setattr("tierstore.engine.health.COOLDOWN_S", 1.0)
    config = _config(tmp_path, seaweed, s3_bucket)
    config["tier"][1].update(max_attempts=1000, retry_seconds=600)
    rec = Recorder()
    store = tierstore.open(config, plugins=[rec])

    def retries(thread):
        return [r for r in caplog.records
                if r.name == "tierstore.plugin.retry" and r.threadName == thread]
    try:
        dcp.save(make_state_dict(1), storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
        seaweed.kill()

        assert store.latest() == "step-1"
        tried = len(retries("MainThread"))
        assert 1 <= tried <= 2  # a retry after the refused connect, not the tier's thousand
        down = [e for e in rec.events if e.kind == EventKind.UNREACHABLE]
        assert [(e.tier, e.detail["during"]) for e in down] == [("s3", "latest()")]
        assert "cannot be connected to" in down[0].detail["error"]
        assert_state_dicts_equal(load_like(store, "step-1", make_state_dict(1)),
                                 make_state_dict(1))
        assert len(retries("MainThread")) == tried  # the load skipped the tier

        dcp.save(make_state_dict(2), storage_writer=store.writer(), checkpoint_id="step-2")
        deadline = time.monotonic() + 60
        while len(retries("tierstore-drain")) < 3:  # the drain keeps trying the dead server
            assert time.monotonic() < deadline, "the drain did not retry"
            time.sleep(0.2)
        assert not [e for e in rec.events if e.kind == EventKind.FAILED]
        seaweed.restart()
        store.wait()  # no DrainError: the drain outlasted the outage
        assert [e.checkpoint_id for e in rec.events
                if e.kind == EventKind.DRAIN_FINISHED and e.tier == "s3"] == ["step-1", "step-2"]
        deadline = time.monotonic() + 60
        while [(c.id, c.tiers) for c in store.list()] != [
                ("step-2", ["local", "s3"]), ("step-1", ["local", "s3"])]:
            assert time.monotonic() < deadline, "the tier never came back"
            time.sleep(0.5)
        assert store.verify("step-2", tier="s3").ok
    finally:
        if not seaweed.running():
            seaweed.restart()
        store.close()


def test_giving_up_on_a_remote_tier_is_a_tierstore_error():
    assert issubclass(GaveUp, TierstoreError) and issubclass(GaveUp, OSError)
