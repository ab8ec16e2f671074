"""Signed checkpoints: with ``[store] signing_key``, a copy re-written by someone without the key
(data changed, every checksum and the seal recomputed, as anyone who can write the tier can) is
refused like a corrupt one on every tier, the next tier's good copy loads, and ``verify`` and
``scrub`` name it. Keys rotate, and never appear in a message, an event, a log or a repr.
Without a key nothing changes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from recording import Recorder

import tierstore
from tierstore import ConfigError, EventKind
from tierstore.format.checksum import Hasher, checksum_of
from tierstore.format.manifest_check import SEAL_KEY, seal_of
from tierstore.format.signing import SigningKey

KEY_A = "a3f1c9e07b2d4e6f8a1b3c5d7e9f0a2b"  # what `openssl rand -hex 16` prints
KEY_B = "0f9e8d7c6b5a49382716f5e4d3c2b1a0"
BIG = 1 << 16


def state(seed: int = 7) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(BIG, generator=gen), "b": torch.arange(10), "step": seed}


def empty() -> dict:
    return {"w": torch.zeros(BIG), "b": torch.zeros(10, dtype=torch.int64), "step": 0}


def same(a: dict, b: dict) -> bool:
    return (torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])
            and a["step"] == b["step"])


def config(tmp_path: Path, tiers=("fast", "slow"), codecs=(), **store) -> dict:
    out = {"store": store, "tier": [
        {"name": name, "backend": "local", "path": str(tmp_path / name)} for name in tiers]}
    if codecs:
        out["tier"][-1]["codecs"] = list(codecs)
    return out


@pytest.fixture
def keys(monkeypatch):
    monkeypatch.setenv("KEY_A", KEY_A)
    monkeypatch.setenv("KEY_B", KEY_B)


def save(cfg: dict, cid: str = "step-7", seed: int = 7) -> None:
    with tierstore.open(cfg) as store:
        dcp.save(state(seed), storage_writer=store.writer(), checkpoint_id=cid)
        store.wait()


def load(store, cid: str = "step-7") -> dict:
    out = empty()
    dcp.load(out, storage_reader=store.reader(), checkpoint_id=cid)
    return out


def manifest(tmp_path: Path, tier: str, cid: str = "step-7") -> dict:
    return json.loads((tmp_path / tier / cid / "tierstore.json").read_text())


def forge(tmp_path: Path, tier: str, cid: str = "step-7") -> None:
    """Change the weights of the copy on ``tier`` as someone without the key would: flip bytes
    in the middle of the largest data file, then make every checksum and the seal match again
    with what can be computed without the key (XXH3, unkeyed)."""
    root = tmp_path / tier / cid
    data = json.loads((root / "tierstore.json").read_text())
    name = max((n for n in data["files"] if n.endswith(".distcp")),
               key=lambda n: data["files"][n]["size"])
    raw = bytearray((root / name).read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 64] = bytes(64)
    (root / name).write_bytes(raw)
    for rel, entry in data["files"].items():
        whole = (root / rel).read_bytes()
        h = Hasher()
        h.update(whole)
        entry["checksum"] = h.hexdigest()
        if entry.get("blocks"):
            size = entry["block_bytes"]
            entry["blocks"] = [checksum_of(whole[i:i + size]) for i in range(0, len(whole), size)]
    data["checksum_algorithm"], data["signed_by"] = "xxh3_128", ""
    data.pop(SEAL_KEY)
    data[SEAL_KEY] = seal_of(data)
    (root / "tierstore.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def test_without_a_key_nothing_changes(tmp_path):
    save(config(tmp_path, tiers=("fast",)))
    data = manifest(tmp_path, "fast")
    assert data["signed_by"] == "" and data["checksum_algorithm"] == "xxh3_128"
    assert all(e["checksum"].startswith("xxh3_128:") for e in data["files"].values())
    with tierstore.open(config(tmp_path, tiers=("fast",))) as store:
        assert store.latest() == "step-7" and same(load(store), state())


def test_a_signed_checkpoint_round_trips_and_says_it_is_signed(tmp_path, keys):
    cfg = config(tmp_path, signing_key={"env": "KEY_A"})
    save(cfg)
    for tier in ("fast", "slow"):  # the drained copy is signed too
        data = manifest(tmp_path, tier)
        assert data["checksum_algorithm"] == "blake3_keyed" and len(data["signed_by"]) == 16
        assert data[SEAL_KEY].startswith("blake3_mac:")
        assert all(e["checksum"].startswith(f"blake3k_{data['signed_by']}:")
                   for e in data["files"].values())
    with tierstore.open(cfg) as store:
        assert store.latest() == "step-7" and same(load(store), state())
        assert store.verify("step-7").ok


@pytest.mark.parametrize("codecs", [(), ("zstd",)], ids=["same codecs", "zstd on slow tier"])
def test_a_copy_forged_without_the_key_is_refused_and_the_next_tier_loads(tmp_path, keys,
                                                                         codecs):
    cfg = config(tmp_path, codecs=codecs, signing_key={"env": "KEY_A"})
    save(cfg)
    forge(tmp_path, "fast")
    events = Recorder()
    with tierstore.open(cfg, plugins=[events]) as store:
        assert store.latest() == "step-7"  # the slow tier's copy is good
        assert same(load(store), state())
        report = store.verify("step-7")
        assert not report.ok
        assert [(p.tier, p.file) for p in report.problems] == [("fast", "tierstore.json")]
        assert "not signed" in report.problems[0].what
        scrub = store.scrub()
        assert [(b.tier, b.checkpoint_id, b.file) for b in scrub.bad] == [
            ("fast", "step-7", "tierstore.json")]
    rejected = [e for e in events.events if e.kind == EventKind.REJECTED]
    assert [(e.tier, e.detail["file"]) for e in rejected] == [("fast", "tierstore.json")]
    # An unsigned store would have taken the forged weights: the forgery is a good one.
    with tierstore.open(config(tmp_path, tiers=("fast",))) as plain:
        assert not torch.equal(load(plain)["w"], state()["w"])


def test_a_forgery_on_every_tier_loads_nothing(tmp_path, keys):
    cfg = config(tmp_path, signing_key={"env": "KEY_A"})
    save(cfg)
    forge(tmp_path, "fast")
    forge(tmp_path, "slow")
    with tierstore.open(cfg) as store:
        assert store.latest() is None
        out = empty()
        with pytest.raises(Exception, match="not signed"):
            dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-7")
        assert same(out, empty())


def test_a_mac_made_with_another_key_is_refused(tmp_path, keys):
    save(config(tmp_path, tiers=("fast",), signing_key={"env": "KEY_B"}))
    with tierstore.open(config(tmp_path, tiers=("fast",), signing_key={"env": "KEY_A"})) as s:
        assert s.latest() is None
        report = s.verify("step-7")
        assert "not among this store's signing keys" in report.problems[0].what


def test_a_resealed_mac_field_is_refused(tmp_path, keys):
    """The manifest keeps its MAC form but a field changes: the MAC no longer matches."""
    cfg = config(tmp_path, tiers=("fast",), signing_key={"env": "KEY_A"})
    save(cfg)
    path = tmp_path / "fast/step-7/tierstore.json"
    data = json.loads(path.read_text())
    data["step"] = 8
    path.write_text(json.dumps(data))
    with tierstore.open(cfg) as store:
        assert store.latest() is None
        assert "MAC" in store.verify("step-7").problems[0].what


def test_keys_rotate_the_first_signs_and_all_verify(tmp_path, keys):
    save(config(tmp_path, tiers=("fast",), signing_key={"env": "KEY_A"}), "step-1", seed=1)
    rotated = config(tmp_path, tiers=("fast",),
                     signing_keys=[{"env": "KEY_B"}, {"env": "KEY_A"}])
    with tierstore.open(rotated) as store:
        assert same(load(store, "step-1"), state(1))
        dcp.save(state(2), storage_writer=store.writer(), checkpoint_id="step-2")
        store.pin("step-1")  # rewriting an old manifest re-signs it with the first key
    id_a, id_b = (SigningKey.from_secret(k.encode()).key_id for k in (KEY_A, KEY_B))
    assert manifest(tmp_path, "fast", "step-2")["signed_by"] == id_b
    step_1 = manifest(tmp_path, "fast", "step-1")
    assert step_1["signed_by"] == id_b and step_1["pinned"]
    assert all(e["checksum"].startswith(f"blake3k_{id_a}:") for e in step_1["files"].values())
    only_b = config(tmp_path, tiers=("fast",), signing_key={"env": "KEY_B"})
    with tierstore.open(only_b) as store:
        assert store.latest() == "step-2" and same(load(store, "step-2"), state(2))
        # step-1's files carry digests keyed with A, which this store no longer holds
        assert not store.verify("step-1").ok


def test_unsigned_checkpoints_need_accept_unsigned_once_a_key_is_set(tmp_path, keys):
    save(config(tmp_path, tiers=("fast",)))
    with tierstore.open(config(tmp_path, tiers=("fast",), signing_key={"env": "KEY_A"})) as s:
        assert s.latest() is None
        assert "accept_unsigned" in s.verify("step-7").problems[0].what
    migrating = config(tmp_path, tiers=("fast",), signing_key={"env": "KEY_A"},
                       accept_unsigned=True)
    with tierstore.open(migrating) as store:
        assert store.latest() == "step-7" and same(load(store), state())


def test_a_signed_checkpoint_without_the_key_is_refused_saying_so(tmp_path, keys):
    save(config(tmp_path, tiers=("fast",), signing_key={"env": "KEY_A"}))
    with tierstore.open(config(tmp_path, tiers=("fast",))) as store:
        assert store.latest() is None
        assert "signing_key" in store.verify("step-7").problems[0].what


def test_a_key_file_works_like_a_variable(tmp_path, keys):
    (tmp_path / "key").write_text(KEY_A + "\n")
    (tmp_path / "key").chmod(0o600)  # a key file others can read is refused
    save(config(tmp_path, tiers=("fast",), signing_key={"file": str(tmp_path / "key")}))
    with tierstore.open(config(tmp_path, tiers=("fast",), signing_key={"env": "KEY_A"})) as s:
        assert same(load(s), state())


@pytest.mark.parametrize("store_table,words", [
    ({"signing_key": KEY_A}, "must not be written in the config"),
    ({"signing_key": {"env": "NOT_SET_ANYWHERE"}}, "$NOT_SET_ANYWHERE named for the signing key "
                                                   "is not set"),
    ({"signing_key": {"env": "SHORT"}}, "is 5 bytes long; a key needs at least 16"),
    ({"signing_key": {"env": "KEY_A"}, "signing_keys": [{"env": "KEY_B"}]}, "sets both"),
    ({"signing_keys": [{"path": "x"}]}, "one key, 'env' or 'file'"),
    ({"signing_key": {"file": "/nonexistent/key"}}, "cannot be read"),
])
def test_key_mistakes_are_config_errors_that_never_show_the_key(tmp_path, keys, monkeypatch,
                                                                store_table, words):
    monkeypatch.setenv("SHORT", "12345")
    with pytest.raises(ConfigError) as err:
        tierstore.open(config(tmp_path, tiers=("fast",), **store_table))
    assert words in str(err.value)
    for secret in (KEY_A, KEY_B, "12345"):
        assert secret not in str(err.value)


def test_keys_appear_in_no_message_event_log_or_repr(tmp_path, keys, caplog):
    caplog.set_level(logging.DEBUG)
    cfg = config(tmp_path, signing_keys=[{"env": "KEY_A"}, {"env": "KEY_B"}])
    events = Recorder()
    save(config(tmp_path, tiers=("fast",), signing_key={"env": "KEY_B"}), "step-3", seed=3)
    forge(tmp_path, "fast", "step-3")
    with tierstore.open(cfg, plugins=[events]) as store:
        dcp.save(state(), storage_writer=store.writer(), checkpoint_id="step-7")
        store.wait()
        same(load(store), state())
        with pytest.raises(Exception) as err:
            load(store, "step-3")
        seen = [repr(store), repr(store._ctx.config), repr(store._ctx.tiers),
                str(err.value), caplog.text, str(store.verify("step-3")),
                *(repr(e) for e in events.events)]
    files = [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()]
    for secret in (KEY_A, KEY_B):
        assert not any(secret in text for text in seen)
        assert not any(secret.encode() in raw for raw in files)
