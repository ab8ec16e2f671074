"""One malformed manifest never hides a tier: a ``tierstore.json`` with a value a parser or a
check would trip on (NaN, a seal that is not ASCII, a string for an integer, a number of 400
digits, not an object, not UTF-8, ...) is that one checkpoint refused, with a warning naming
it; the tier and every other checkpoint on it stay listed, ``latest()`` still finds the newest
good one and it loads bit for bit, so a restarted job never starts again from step 0. The same
for DCP's ``.metadata``: values of the wrong type refuse that checkpoint's load with an
IntegrityError naming the field.
"""

from __future__ import annotations

import json
import logging
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_hostile_metadata import _replace_metadata

import tierstore
from tierstore.errors import IntegrityError
from tierstore.format.manifest import MANIFEST_NAME, METADATA_NAME
from tierstore.format.manifest_check import seal_of

KEY = "a3f1c9e07b2d4e6f8a1b3c5d7e9f0a2b"  # what `openssl rand -hex 16` prints


@pytest.fixture(autouse=True)
def key(monkeypatch):
    monkeypatch.setenv("TIERSTORE_TEST_KEY", KEY)


def config(tmp_path: Path, signed: bool) -> dict:
    store = {"signing_key": {"env": "TIERSTORE_TEST_KEY"}} if signed else {}
    return {"store": store, "tier": [{"name": "fast", "backend": "local",
                                      "path": str(tmp_path / "fast")}]}


def state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, generator=generator), "b": torch.randn(3, 5, generator=generator),
            "progress": {"step": seed, "epoch": 2}}


def save_two(tmp_path: Path, signed: bool) -> Path:
    """A good ``step-1`` and a ``junk-0`` beside it, on the tier ``fast``; junk-0's manifest."""
    with tierstore.open(config(tmp_path, signed)) as store:
        dcp.save(state(1), storage_writer=store.writer(), checkpoint_id="step-1")
        dcp.save(state(0), storage_writer=store.writer(), checkpoint_id="junk-0")
    return tmp_path / "fast" / "junk-0" / MANIFEST_NAME


def _fields(change: Callable[[dict], Any]) -> Callable[[dict], bytes]:
    """A manifest with ``change`` made to its fields, written as someone who can write the tier
    but holds no key would: a signed manifest keeps its MAC, an unsigned one gets its seal
    recomputed (when the change leaves one computable), so that the check of the fields is
    what stands in the way."""
    def forge(data: dict) -> bytes:
        change(data)
        if not data.get("signed_by"):
            try:
                data["seal"] = seal_of({k: v for k, v in data.items() if k != "seal"})
            except ValueError:  # NaN: no seal can cover it
                pass
        return json.dumps(data, indent=1).encode()
    return forge


def _first_file(data: dict) -> dict:
    return next(iter(data["files"].values()))


def _twice(data: dict) -> bytes:
    """The key "step" given twice: the second (a later step) hidden from a reader keeping the
    first."""
    text = _fields(lambda d: None)(data).decode()
    return text.replace("{", '{\n "step": 99,', 1).encode()


MALFORMED: dict[str, Callable[[dict], bytes]] = {
    "NaN created": _fields(lambda d: d.update(created=float("nan"))),
    "Infinity committed": _fields(lambda d: d.update(committed=float("inf"))),
    "seal not ASCII": lambda d: json.dumps({**d, "seal": d["seal"][:-1] + "é"}).encode(),
    "string for an int": _fields(lambda d: d.update(world_size="2")),
    "list for a table": _fields(lambda d: d.update(plugins=["a"])),
    "negative size": _fields(lambda d: _first_file(d).update(size=-1)),
    "10**400": _fields(lambda d: d.update(step=10 ** 400)),
    "time past year 5138": _fields(lambda d: d.update(created=1e300)),
    "lone surrogate": _fields(lambda d: d.update(codecs=["\ud800"])),
    "extra nesting": _fields(lambda d: _first_file(d).update(rank=[[0]])),
    "key given twice": _twice,
    "empty object": lambda d: b"{}",
    "top-level array": lambda d: b"[]",
    "invalid UTF-8": lambda d: b'{"format": 1, "checkpoint_id": "junk-0\xff\xfe"}',
}


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_manifest_hides_only_its_own_checkpoint(tmp_path, caplog, signed, case):
    manifest = save_two(tmp_path, signed)
    manifest.write_bytes(MALFORMED[case](json.loads(manifest.read_bytes())))
    caplog.set_level(logging.WARNING)
    with tierstore.open(config(tmp_path, signed)) as store:
        assert [c.id for c in store.list()] == ["step-1"]
        assert store.latest() == "step-1"
        out = {"w": torch.zeros(64), "b": torch.zeros(3, 5), "progress": {"step": 0, "epoch": 0}}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    want = state(1)
    for name in ("w", "b"):
        assert out[name].view(torch.int32).tolist() == want[name].view(torch.int32).tolist()
    assert out["progress"] == want["progress"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("junk-0" in w and MANIFEST_NAME in w for w in warnings), warnings
    assert not any("did not answer" in w for w in warnings), warnings


def test_the_command_line_still_lists_the_good_checkpoint(tmp_path):
    manifest = save_two(tmp_path, signed=False)
    manifest.write_bytes(MALFORMED["NaN created"](json.loads(manifest.read_bytes())))
    toml = tmp_path / "tiers.toml"
    toml.write_text(f'[[tier]]\nname = "fast"\nbackend = "local"\npath = "{tmp_path / "fast"}"\n')
    proc = subprocess.run([sys.executable, "-m", "tierstore.cli", "ls", str(toml)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "step-1" in proc.stdout and "junk-0" not in proc.stdout, proc.stdout
    assert "junk-0" in proc.stderr and "did not answer" not in proc.stderr, proc.stderr


def _tensor_properties(metadata):
    return metadata.state_dict_metadata["w"].properties


METADATA_CASES = {
    "requires_grad": (lambda md: setattr(_tensor_properties(md), "requires_grad", "yes"),
                      "properties.requires_grad' must be a bool"),
    "layout": (lambda md: setattr(_tensor_properties(md), "layout", 5),
               "properties.layout' must be a layout"),
    "pin_memory": (lambda md: setattr(_tensor_properties(md), "pin_memory", []),
                   "properties.pin_memory' must be a bool"),
    "planner_data": (lambda md: setattr(md, "planner_data", {"w": 5}),
                     "field 'planner_data' must map str keys to tuples of str and int"),
    "storage_meta.checkpoint_id": (lambda md: setattr(md.storage_meta, "checkpoint_id", 5),
                                   "field 'storage_meta.checkpoint_id' must be a str"),
    "storage_meta.modules": (lambda md: setattr(md.storage_meta, "modules", {"m": 1}),
                             "field 'storage_meta.modules' must be a list of str"),
}


@pytest.mark.parametrize("case", list(METADATA_CASES))
def test_metadata_values_of_the_wrong_type_refuse_that_checkpoint_only(tmp_path, case):
    mutate, message = METADATA_CASES[case]
    save_two(tmp_path, signed=False)
    ckpt = tmp_path / "fast" / "junk-0"
    metadata = pickle.loads((ckpt / METADATA_NAME).read_bytes())
    mutate(metadata)
    _replace_metadata(ckpt, pickle.dumps(metadata))
    with tierstore.open(config(tmp_path, signed=False)) as store:
        assert sorted(c.id for c in store.list()) == ["junk-0", "step-1"]
        with pytest.raises(IntegrityError) as info:
            dcp.load(state(0), storage_reader=store.reader(), checkpoint_id="junk-0")
        out = {"w": torch.zeros(64), "b": torch.zeros(3, 5), "progress": {"step": 0, "epoch": 0}}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    assert f"junk-0/{METADATA_NAME}" in str(info.value) and message in str(info.value), \
        str(info.value)
    assert torch.equal(out["w"], state(1)["w"]) and out["progress"] == state(1)["progress"]
