"""Object-store tiers (backend ``fsspec``) against real servers: SeaweedFS for S3 and
fake-gcs-server for GCS (tests/servers.py). What a user checks: checkpoints drained from a
local tier load from the object store alone, bit for bit; ``zstd`` on the object tier shrinks
what is uploaded; a drain cut off by a dead server fails loudly, leaves nothing visible and is
cleaned up; permanent errors fail fast with a message saying what to do; credentials never
show up anywhere; a ``zstd`` checkpoint on a local tier still loads with stock DCP.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import shutil
import subprocess
import sys
import threading
import time
import traceback
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_state_dicts_equal, empty_like, load_like, make_state_dict, script_env
from recording import Recorder
from torch.distributed.checkpoint.api import CheckpointException

import tierstore
from tierstore import ConfigError, DrainError, IntegrityError
from tierstore.events import Phase

MANIFEST = "tierstore.json"
MARKER = ".tierstore-pending"


# ----------------------------------------------------------------------------- helpers

def local_tier(tmp_path, **extra) -> dict:
    return {"name": "local", "backend": "local", "path": str(tmp_path / "local"), **extra}


def object_tier(kind: str, server, url: str, **extra) -> dict:
    return {"name": kind, "backend": "fsspec", "url": url, "options": server.storage_options(),
            **extra}


def server_and_bucket(request, kind: str):
    """(server, bucket URL) for ``kind`` ("s3": SeaweedFS, "gcs": fake-gcs-server)."""
    if kind == "s3":
        return request.getfixturevalue("seaweed"), request.getfixturevalue("s3_bucket")
    return request.getfixturevalue("fake_gcs"), request.getfixturevalue("gcs_bucket")


def bare(url: str) -> str:
    """``s3://bucket/x`` -> ``bucket/x`` (the path a raw fsspec client takes)."""
    return url.split("://", 1)[1]


def objects_under(server, prefix: str) -> dict[str, int]:
    """Every object below ``prefix`` (raw client, fresh listing) with its size."""
    fs = server.filesystem()
    return {p[len(prefix) + 1:]: info["size"]
            for p, info in fs.find(prefix, detail=True).items() if info["type"] == "file"}


def compressible_state(seed: int) -> dict:
    """About 6 MiB that zstd shrinks a lot (zeros, ramps, small-range ints), plus a random
    tensor so a wrong byte anywhere is caught."""
    g = torch.Generator().manual_seed(seed)
    return {
        "zeros": torch.zeros(512, 1024),
        "ramp": torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024) % 97,
        "ids": torch.randint(0, 4, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32),
        "noise": torch.randn(1000, generator=g),
        "step": seed,
    }


def reads_by_tier(rec: Recorder, checkpoint_id: str) -> set[str]:
    return {tier for phase, cid, tier, _ in rec.phases
            if phase == Phase.READ_FILE and cid == checkpoint_id}


# ----------------------------------------------------------------------------- a.

@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_checkpoints_drained_to_the_object_store_load_without_the_local_tier(
        request, tmp_path, kind):
    server, bucket = server_and_bucket(request, kind)
    config = {"tier": [local_tier(tmp_path), object_tier(kind, server, f"{bucket}/run-7")]}
    first, second = make_state_dict(1), make_state_dict(2)
    want = copy.deepcopy(second)
    with tierstore.open(config) as store:
        dcp.save(first, storage_writer=store.writer(), checkpoint_id="step-1")
        dcp.save(second, storage_writer=store.writer(), checkpoint_id="step-2")
        store.wait()
        assert [(i.id, i.tiers) for i in store.list()] == [
            ("step-2", ["local", kind]), ("step-1", ["local", kind])]
    # Both are really in the bucket, each with its manifest.
    for cid in ("step-1", "step-2"):
        assert MANIFEST in objects_under(server, f"{bare(bucket)}/run-7/{cid}")

    shutil.rmtree(tmp_path / "local")  # the node is gone; only the bucket is left
    rec = Recorder()
    with tierstore.open(config, plugins=[rec]) as store:
        assert store.latest() == "step-2"
        assert [(i.id, i.tiers) for i in store.list()] == [
            ("step-2", [kind]), ("step-1", [kind])]
        assert_state_dicts_equal(load_like(store, store.latest(), want), want)
        assert reads_by_tier(rec, "step-2") == {kind}
        assert store.stats()[kind].loads == 1


# ----------------------------------------------------------------------------- b.

def test_zstd_on_the_s3_tier_recompresses_the_drain_and_loads_from_s3_alone(
        seaweed, s3_bucket, tmp_path):
    config = {"tier": [local_tier(tmp_path),
                       object_tier("s3", seaweed, f"{s3_bucket}/run", codecs=["zstd"])]}
    sd = compressible_state(3)
    want = copy.deepcopy(sd)
    with tierstore.open(config) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-3")
        store.wait()
        assert store.list()[0].tiers == ["local", "s3"]
        assert store.verify("step-3").ok

    local_dir = tmp_path / "local" / "step-3"
    local_sizes = {p.name: p.stat().st_size for p in local_dir.iterdir()}
    s3_sizes = objects_under(seaweed, f"{bare(s3_bucket)}/run/step-3")
    assert sorted(s3_sizes) == sorted(local_sizes)  # same files, no leftovers (no marker)
    data = [n for n in local_sizes if n.endswith(".distcp")]
    local_data = sum(local_sizes[n] for n in data)
    s3_data = sum(s3_sizes[n] for n in data)
    assert local_data > 6 << 20  # the local tier holds it uncompressed
    assert s3_data * 4 < local_data, (s3_data, local_data)
    fs = seaweed.filesystem()
    manifest = json.loads(fs.cat_file(f"{bare(s3_bucket)}/run/step-3/{MANIFEST}"))
    assert manifest["codecs"] == ["zstd"]
    assert json.loads((local_dir / MANIFEST).read_bytes())["codecs"] == []

    shutil.rmtree(tmp_path / "local")
    rec = Recorder()
    with tierstore.open(config, plugins=[rec]) as store:
        assert [(i.id, i.tiers) for i in store.list()] == [("step-3", ["s3"])]
        assert_state_dicts_equal(load_like(store, "step-3", want), want)
        assert reads_by_tier(rec, "step-3") == {"s3"}


# ----------------------------------------------------------------------------- c.

class KillServerAt:
    """Kills the server when the ``nth`` file of a drain to ``tier`` is about to be copied."""

    def __init__(self, server, tier: str, nth: int = 2):
        self.server, self.tier, self.nth = server, tier, nth
        self.seen = 0
        self.killed = False
        self._lock = threading.Lock()

    @tierstore.hookimpl
    def tierstore_phase(self, phase, tier):
        if phase != Phase.DRAIN_FILE or tier != self.tier:
            return
        with self._lock:
            self.seen += 1
            if self.seen == self.nth and not self.killed:
                self.killed = True
                self.server.kill()


@pytest.mark.parametrize("cleanup", ["gc", "next drain"])
def test_a_drain_cut_off_by_a_dead_server_fails_loudly_and_is_cleaned_up(
        seaweed, s3_bucket, tmp_path, cleanup):
    url = f"{s3_bucket}/run"
    config = {"tier": [local_tier(tmp_path),
                       object_tier("s3", seaweed, url, max_attempts=2, retry_seconds=3)]}
    prefix = f"{bare(url)}/step-1"
    killer = KillServerAt(seaweed, "s3")
    store = tierstore.open(config, plugins=[killer])
    try:
        sd = make_state_dict(1)
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        started = time.monotonic()
        try:
            with pytest.raises(DrainError) as info:
                store.wait()
            waited = time.monotonic() - started
        finally:
            seaweed.restart()
        assert killer.killed
        err = info.value
        assert (err.checkpoint_id, err.tier) == ("step-1", "s3")
        assert "step-1" in str(err) and "'s3'" in str(err)
        assert "still complete on tier 'local'" in str(err)
        assert seaweed.secret not in str(err)

        # Invisible on S3: only the local copy counts, and no manifest object was written.
        assert [(i.id, i.tiers) for i in store.list()] == [("step-1", ["local"])]
        assert store.latest() == "step-1"
        left = objects_under(seaweed, prefix)
        assert MANIFEST not in left

        if cleanup == "gc":
            removed = store.gc()
            if left:
                assert removed == ["s3:step-1"]
            assert objects_under(seaweed, prefix) == {}
            # A new store queues the copy the failed drain did not make, and it completes.
            store.close()
            store = tierstore.open(config)
            store.wait()
            assert [(i.id, i.tiers) for i in store.list()] == [("step-1", ["local", "s3"])]
            assert store.verify("step-1", tier="s3").ok
            shutil.rmtree(tmp_path / "local")
            assert_state_dicts_equal(load_like(store, "step-1", sd), make_state_dict(1))
        else:
            dcp.save(make_state_dict(2), storage_writer=store.writer(), checkpoint_id="step-2")
            store.wait()  # this drain completes, and removes what the failed one left
            assert objects_under(seaweed, prefix) == {}
            assert [(i.id, i.tiers) for i in store.list()] == [
                ("step-2", ["local", "s3"]), ("step-1", ["local"])]
            assert store.verify("step-2", tier="s3").ok
            assert MARKER not in objects_under(seaweed, f"{bare(url)}/step-2")

        # The retry limits bound how long a dead server holds things up: the failed drain
        # talks to it in a couple of operations (the upload, the clean-up), each retried for at
        # most retry_seconds; a refused connection itself fails at once.
        assert waited < 8, (
            f"store.wait() raised only after {waited:.1f} s with max_attempts = 2 and "
            f"retry_seconds = 3: something retries beyond the tier's limits ({err})")
    finally:
        if not seaweed.running():
            seaweed.restart()
        store.close()


_EXITS_WITHOUT_CLOSE = """
import json, sys
import torch, torch.distributed.checkpoint as dcp, tierstore
root, url, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
store = tierstore.open({"tier": [
    {"name": "ram", "backend": "memory", "path": root + "/ram"},
    {"name": "s3", "backend": "fsspec", "url": url, "options": options}]})
dcp.save({"w": torch.arange(1 << 20, dtype=torch.float32)}, storage_writer=store.writer(),
         checkpoint_id="step-1")
# exits without store.close() or store.wait(): the drain to S3 is in flight
"""


def test_a_process_exiting_without_close_finishes_its_drain_to_the_object_store(
        seaweed, s3_bucket, tmp_path):
    # At exit, thread pools (and the S3 client's lookups and uploads on them) refuse new work
    # before atexit handlers run: the drain failed with "cannot schedule new futures after
    # shutdown", at every exit without close(), and the checkpoint never reached S3.
    url = f"{s3_bucket}/run"
    done = subprocess.run([sys.executable, "-c", _EXITS_WITHOUT_CLOSE, str(tmp_path), url,
                           json.dumps(seaweed.storage_options())],
                          env=script_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not copied" not in done.stderr and "drain failed" not in done.stderr, done.stderr
    config = {"tier": [{"name": "s3", "backend": "fsspec", "url": url,
                        "options": seaweed.storage_options()}]}
    with tierstore.open(config) as store:
        assert [c.id for c in store.list()] == ["step-1"]
        got = load_like(store, "step-1", {"w": torch.zeros(1 << 20)})
    assert torch.equal(got["w"], torch.arange(1 << 20, dtype=torch.float32))


# ----------------------------------------------------------------------------- d.

def _messages(exc: BaseException) -> str:
    """The exception, its causes and its traceback text, as a user would see them."""
    return "".join(traceback.format_exception(exc))


@pytest.mark.parametrize("where", ["bucket root", "prefix in the bucket"])
def test_a_wrong_secret_fails_fast_at_open_saying_access_denied(seaweed, s3_bucket, where):
    wrong = f"not-the-secret-{uuid.uuid4().hex}"
    url = s3_bucket if where == "bucket root" else f"{s3_bucket}/run"
    config = {"tier": [{"name": "s3", "backend": "fsspec", "url": url,
                        "options": seaweed.storage_options(secret=wrong)}]}
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        tierstore.open(config)
    assert time.monotonic() - started < 10
    msg = str(info.value).lower()
    assert "tier 's3'" in msg
    assert "access denied" in msg or "credentials" in msg, msg
    assert "does not exist" not in msg, msg  # the bucket is there: it is the secret
    assert wrong not in _messages(info.value)


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_missing_bucket_fails_fast_at_open_saying_it_does_not_exist(request, kind):
    server = request.getfixturevalue("seaweed" if kind == "s3" else "fake_gcs")
    if not server.running():
        server.restart()
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:12]}"
    scheme = "s3" if kind == "s3" else "gs"
    config = {"tier": [{"name": kind, "backend": "fsspec", "url": f"{scheme}://{bucket}/run",
                        "options": server.storage_options()}]}
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        tierstore.open(config)
    assert time.monotonic() - started < 10
    msg = str(info.value)
    assert bucket in msg and "does not exist" in msg, msg
    assert server.filesystem().exists(bucket) is False  # tierstore never creates buckets


# ----------------------------------------------------------------------------- e.

class _Capture:
    """Every log record of every logger, at DEBUG, into a string (restored afterwards)."""

    def __enter__(self):
        self.buf = io.StringIO()
        self.handler = logging.StreamHandler(self.buf)
        self.handler.setLevel(logging.DEBUG)
        self.handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        root = logging.getLogger()
        self.saved = [(root, root.level, root.propagate, root.disabled)]
        root.addHandler(self.handler)
        root.setLevel(logging.DEBUG)
        for logger in list(logging.root.manager.loggerDict.values()):
            if isinstance(logger, logging.Logger):
                self.saved.append((logger, logger.level, logger.propagate, logger.disabled))
                logger.setLevel(logging.DEBUG)
                logger.disabled = False
                if not logger.propagate:
                    logger.addHandler(self.handler)
        return self

    @property
    def text(self) -> str:
        return self.buf.getvalue()

    def __exit__(self, *exc):
        for logger, level, propagate, disabled in self.saved:
            logger.setLevel(level)
            logger.disabled = disabled
            if self.handler in logger.handlers:
                logger.removeHandler(self.handler)


def test_credentials_from_the_environment_appear_nowhere(seaweed, s3_bucket, tmp_path,
                                                         monkeypatch):
    monkeypatch.setenv("TIERSTORE_TEST_S3_KEY", seaweed.key)
    monkeypatch.setenv("TIERSTORE_TEST_S3_SECRET", seaweed.secret)
    options = seaweed.storage_options()
    options.update(key={"env": "TIERSTORE_TEST_S3_KEY"}, secret={"env": "TIERSTORE_TEST_S3_SECRET"})
    url = f"{s3_bucket}/run"
    config = {"tier": [local_tier(tmp_path),
                       {"name": "s3", "backend": "fsspec", "url": url, "options": options}]}
    secret = seaweed.secret
    # What redaction must not leave behind either: the secret's parts around any public value
    # (the access key is not a secret; "***-test-secret" would still give most of it away).
    pieces = [p for p in secret.split(seaweed.key) if len(p) >= 6] if seaweed.key in secret else []
    sd = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(16, 16), "step": 1}
    rec = Recorder()
    texts: dict[str, str] = {}
    with _Capture() as capture, tierstore.open(config, plugins=[rec]) as store:
        texts["describe"] = " ".join([t.backend.describe() for t in store._ctx.tiers]
                                     + [repr(store)])
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
        assert store.list()[0].tiers == ["local", "s3"]
        shutil.rmtree(tmp_path / "local" / "step-1")
        out = {"w": torch.zeros(4096), "b": torch.zeros(16, 16), "step": 0}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
        assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])
        # Damage the object on S3: verify reports it, and the load fails (no other copy).
        fs = seaweed.filesystem()
        path = f"{bare(url)}/step-1/__0_0.distcp"
        data = bytearray(fs.cat_file(path))
        data[len(data) // 2] ^= 0xFF
        fs.pipe_file(path, bytes(data))
        report = store.verify("step-1", tier="s3")
        assert not report.ok
        texts["verify report"] = str(report) + repr(report.problems)
        with pytest.raises(CheckpointException) as info:
            dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
        assert any(isinstance(f, IntegrityError) for f, _ in info.value.failures.values())
        texts["load error"] = _messages(info.value) + "".join(
            _messages(f) for f, _ in info.value.failures.values())
    texts["log"] = capture.text
    assert "DEBUG" in capture.text and "tierstore" in capture.text  # the capture worked
    texts["events"] = repr([(e.kind, e.tier, e.detail) for e in rec.events])
    texts["phases"] = repr(rec.phases)
    texts["manifests"] = "".join(
        fs.cat_file(p).decode() for p in fs.find(bare(url)) if p.endswith(MANIFEST))
    assert texts["manifests"]
    for where, text in texts.items():
        assert secret not in text, f"the secret appears in the {where}"
        for piece in pieces:
            assert piece not in text, f"part of the secret ({piece!r}) appears in the {where}"


# ----------------------------------------------------------------------------- f.

@pytest.mark.parametrize("codec", ["zstd", {"name": "zstd", "level": 9}], ids=["default", "level 9"])
def test_a_zstd_checkpoint_on_a_local_tier_loads_with_stock_dcp(tmp_path, codec):
    config = {"tier": [local_tier(tmp_path, codecs=[codec])]}
    sd = compressible_state(5)
    want = copy.deepcopy(sd)
    with tierstore.open(config) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-5")
    directory = tmp_path / "local" / "step-5"
    raw_bytes = sum(t.numel() * t.element_size() for t in want.values()
                    if isinstance(t, torch.Tensor))
    stored = sum(p.stat().st_size for p in directory.glob("*.distcp"))
    assert stored * 4 < raw_bytes, (stored, raw_bytes)  # really compressed
    loaded = empty_like(want)
    dcp.load(loaded, checkpoint_id=str(directory))  # stock FileSystemReader, no tierstore
    assert_state_dicts_equal(loaded, want)
