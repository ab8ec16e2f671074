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


def test_giving_up_on_a_remote_tier_is_a_tierstore_error():
    assert issubclass(GaveUp, TierstoreError) and issubclass(GaveUp, OSError)
