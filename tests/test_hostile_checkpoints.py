"""Checkpoints read from a tier are untrusted: a changed manifest, a path that climbs out of the
tier, a symbolic link out of it, or a field of the wrong shape is refused with an
``IntegrityError`` naming the file and field, and the load falls back to another tier's copy;
nothing outside a tier root is read or written."""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torch.distributed.checkpoint.api import CheckpointException

import tierstore
from tierstore import EventKind, IntegrityError
from tierstore.format.manifest_check import SEAL_KEY, seal_of

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

BIG = 1 << 18  # floats: large enough to be stored (and read) as one raw span


def state() -> dict:
    gen = torch.Generator().manual_seed(7)
    return {"big": torch.randn(BIG, generator=gen), "small": torch.arange(10), "step": 3}


def empty() -> dict:
    return {"big": torch.zeros(BIG), "small": torch.zeros(10, dtype=torch.int64), "step": 0}


def assert_loaded_right(out: dict) -> None:
    want = state()
    assert torch.equal(out["big"], want["big"]) and torch.equal(out["small"], want["small"])
    assert out["step"] == want["step"]


class Events:
    def __init__(self):
        self.events = []

    @tierstore.hookimpl
    def tierstore_event(self, event):
        self.events.append(event)


def config(tmp_path: Path, tiers: int = 1) -> dict:
    return {"tier": [{"name": name, "backend": "local", "path": str(tmp_path / name)}
                     for name in ("fast", "slow")[:tiers]]}


def save(tmp_path: Path, tiers: int = 1) -> None:
    with tierstore.open(config(tmp_path, tiers)) as store:
        dcp.save(state(), storage_writer=store.writer(), checkpoint_id="step-3")


def load(store) -> dict:
    out = empty()
    dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-3")
    return out


def rewrite_manifest(path: Path, mutate, *, reseal: bool) -> None:
    """Change a stored manifest; ``reseal``: as someone who knows the format would (the seal
    matches again), else as a bit flip or a careless edit would (it does not)."""
    data = json.loads(path.read_text())
    mutate(data)
    if reseal:
        data.pop(SEAL_KEY, None)
        data[SEAL_KEY] = seal_of(data)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def span_file(manifest: dict) -> str:
    return next(name for name, e in manifest["files"].items() if e["spans"])


def test_a_span_moved_by_one_byte_is_refused_not_loaded_wrong(tmp_path):
    save(tmp_path)
    path = tmp_path / "fast/step-3/tierstore.json"

    def shift(data):
        data["files"][span_file(data)]["spans"][0][1] += 1
    rewrite_manifest(path, shift, reseal=False)
    with tierstore.open(config(tmp_path)) as store:
        with pytest.raises(IntegrityError, match="seal does not match"):
            load(store)
        report = store.verify("step-3")
        assert not report.ok and "seal does not match" in str(report)
        assert store.latest() is None


def test_a_changed_manifest_falls_back_to_the_next_tier(tmp_path):
    save(tmp_path, tiers=2)
    with tierstore.open(config(tmp_path, 2)) as store:
        store.wait()
    rewrite_manifest(tmp_path / "fast/step-3/tierstore.json",
                     lambda d: d["files"][span_file(d)]["spans"][0].__setitem__(1, 705),
                     reseal=False)
    events = Events()
    with tierstore.open(config(tmp_path, 2), plugins=[events]) as store:
        assert_loaded_right(load(store))
    rejected = [e for e in events.events if e.kind == EventKind.REJECTED]
    assert [(e.tier, e.detail["file"]) for e in rejected] == [("fast", "tierstore.json")]


@pytest.mark.parametrize("name,mutate,words", [
    ("traversal", lambda d: d["files"].__setitem__("../../../evil.distcp",
                                                    d["files"].pop(span_file(d))),
     "names a file outside the checkpoint directory"),
    ("absolute", lambda d: d["files"].__setitem__("/etc/passwd", d["files"].pop(span_file(d))),
     "names a file outside the checkpoint directory"),
    ("spans of the wrong shape", lambda d: d["files"][span_file(d)].__setitem__("spans", [5]),
     "field 'files.__0_0.distcp.spans'"),
    ("size as a string", lambda d: d["files"][span_file(d)].__setitem__("size", "2838"),
     "field 'files.__0_0.distcp.size' must be an integer"),
    ("span past the end", lambda d: d["files"][span_file(d)]["spans"][0].__setitem__(2, 1 << 40),
     "reach past the file's"),
    ("a block digest too few", lambda d: d["files"][span_file(d)]["blocks"].pop(),
     "field 'files.__0_0.distcp.blocks' must list 1 digests"),
    ("a block digest of another kind", lambda d: d["files"][span_file(d)]["blocks"].__setitem__(
        0, "blake3k_0123456789abcdef:" + "0" * 64), "of the file checksum's kind"),
    ("a block digest with a newline after it", lambda d: d["files"][span_file(d)]["blocks"]
     .__setitem__(0, d["files"][span_file(d)]["blocks"][0] + "\n"), "of the file checksum's kind"),
    ("two block digests in one", lambda d: d["files"][span_file(d)]["blocks"].__setitem__(
        0, d["files"][span_file(d)]["blocks"][0] + "\n" + d["files"][span_file(d)]["checksum"]),
     "of the file checksum's kind"),
    ("blocks without a block size", lambda d: d["files"][span_file(d)].__setitem__(
        "block_bytes", 0), "field 'files.__0_0.distcp.block_bytes' must be above 0"),
    ("rank out of range", lambda d: d.__setitem__("ranks", [5]), "field 'ranks'"),
    ("unknown checksum algorithm", lambda d: d.__setitem__("checksum_algorithm", "md5"),
     "field 'checksum_algorithm'"),
    ("another id", lambda d: d.__setitem__("checkpoint_id", "step-9"),
     "is the manifest of checkpoint 'step-9'"),
])
def test_hostile_manifests_are_refused_naming_the_field(tmp_path, name, mutate, words):
    """Even resealed (written by someone who knows the format), a manifest whose fields are out
    of shape or reach out of the tier is refused by loads, verify, latest() and drains; nothing
    outside the tier roots is read or written."""
    save(tmp_path)
    rewrite_manifest(tmp_path / "fast/step-3/tierstore.json", mutate, reseal=True)
    outside = tmp_path / "evil.distcp"
    outside.write_bytes(b"not for tierstore")
    before = _snapshot(tmp_path.parent)
    with tierstore.open(config(tmp_path, 2)) as store:  # a slower tier: a drain would copy
        store.wait()
        with pytest.raises(IntegrityError, match="no copy to trust") as info:
            load(store)
        assert words in str(info.value)
        report = store.verify("step-3")
        assert not report.ok and words in str(report)
        assert store.latest() is None and store.list() == []
    after = _snapshot(tmp_path.parent)
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert all(p.startswith(str(tmp_path / "slow")) for p in changed), changed
    assert not list((tmp_path / "slow").glob("step-3/*"))


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time (not following links)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            st = os.lstat(p)
            out[p] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("which", ["data", "metadata"])
def test_a_symbolic_link_out_of_the_tier_is_not_followed(tmp_path, which):
    save(tmp_path, tiers=2)
    with tierstore.open(config(tmp_path, 2)) as store:
        store.wait()
    directory = tmp_path / "fast/step-3"
    name = ".metadata" if which == "metadata" else span_file(
        json.loads((directory / "tierstore.json").read_text()))
    # The same bytes, outside the tier: the checksum would match, the path must not.
    outside = tmp_path / f"outside-{which}"
    os.replace(directory / name, outside)
    os.symlink(outside, directory / name)
    events = Events()
    with tierstore.open(config(tmp_path, 2), plugins=[events]) as store:
        assert_loaded_right(load(store))  # from 'slow'
        report = store.verify("step-3", tier="fast")
        assert not report.ok and "symbolic link" in str(report)
    with tierstore.open(config(tmp_path, 1)) as store:
        # DCP wraps what read_data raises (a CheckpointException carrying our message).
        with pytest.raises((tierstore.TierstoreError, CheckpointException),
                           match="a symbolic link leads it out of the tier's root"):
            load(store)


def test_every_bit_of_a_manifest_and_a_data_file_flipped_is_loaded_right_or_refused(
        tmp_path, caplog):
    """A single-bit change anywhere in the manifest (every bit of it) or a data file (2,000
    bits spread over it) is refused with a TierstoreError or loads bitwise right; never wrong
    values, never another exception."""
    # ~14,000 loads: their warnings (and DCP's debug records of every call) are not the point
    caplog.set_level(logging.ERROR)
    caplog.set_level(logging.ERROR, logger="c10d-NullHandler-dcp_logger")
    save(tmp_path)
    directory = tmp_path / "fast/step-3"
    manifest = directory / "tierstore.json"
    data_file = directory / span_file(json.loads(manifest.read_text()))
    flips = {manifest: [(i // 8, i % 8) for i in range(manifest.stat().st_size * 8)]}
    size = data_file.stat().st_size
    flips[data_file] = [((k * 7919) % size, k % 8) for k in range(2000)]
    refused = right = 0
    with tierstore.open(config(tmp_path)) as store:
        for path, positions in flips.items():
            original = path.read_bytes()
            for byte, bit in positions:
                flipped = bytearray(original)
                flipped[byte] ^= 1 << bit
                path.write_bytes(flipped)
                try:
                    out = load(store)
                except tierstore.TierstoreError:
                    refused += 1
                except CheckpointException as exc:  # DCP wraps what read_data raises
                    # failures: rank -> (exception, traceback)
                    assert all(isinstance(f[0], tierstore.TierstoreError)
                               for f in exc.failures.values()), exc
                    refused += 1
                else:
                    assert_loaded_right(out)
                    right += 1
            path.write_bytes(original)
    assert refused + right == len(flips[manifest]) + 2000
    assert refused > 0.9 * (refused + right)


class FailReadsOn:
    """An I/O error at every read of a data file from one tier (tierstore_phase hook)."""

    def __init__(self, tier: str):
        self.tier = tier

    @tierstore.hookimpl
    def tierstore_phase(self, phase, tier, detail):
        if phase == tierstore.Phase.READ_FILE and tier == self.tier:
            raise OSError(5, "Input/output error (injected)")


def test_a_read_error_on_one_tier_falls_back_to_the_next(tmp_path):
    save(tmp_path, tiers=2)
    events = Events()
    with tierstore.open(config(tmp_path, 2), plugins=[FailReadsOn("fast"), events]) as store:
        store.wait()
        assert_loaded_right(load(store))
    assert any(e.kind == EventKind.FELL_BACK and e.tier == "slow" for e in events.events)
