"""Signed stores under attack: what someone who can write a tier, but does not hold the key,
can and cannot make a job load.

- A copy never gains trust its source did not have: while ``accept_unsigned = true`` (the
  migration switch) an unsigned checkpoint planted on a tier, made of a signed checkpoint's
  files and keyed digests, is drained, promoted, pinned and repaired as an unsigned one; once
  the migration ends it is refused, and ``latest()`` does not name it.
- With a key, every byte a load hands to the model is checked: ``verify_on_load = false`` is
  refused with the key set.
- A key written in the config by mistake, in any shape, is never echoed by the message that
  says it is wrong, nor by the ``tierstore`` command.
- A key file others can read is refused, as ssh refuses such a private key.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore import ConfigError
from tierstore.format.manifest_check import SEAL_KEY, seal_of

KEY_A = "a3f1c9e07b2d4e6f8a1b3c5d7e9f0a2b"  # what `openssl rand -hex 16` prints
BIG = 1 << 14
TIERSTORE = os.path.join(os.path.dirname(sys.executable), "tierstore")


def state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(BIG, generator=gen), "step": seed}


def empty() -> dict:
    return {"w": torch.zeros(BIG), "step": 0}


def config(tmp_path: Path, tiers=("fast", "slow"), **store) -> dict:
    return {"store": store, "tier": [
        {"name": name, "backend": "local", "path": str(tmp_path / name)} for name in tiers]}


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv("KEY_A", KEY_A)


def migrating(tmp_path: Path, **store) -> dict:
    return config(tmp_path, signing_key={"env": "KEY_A"}, accept_unsigned=True, **store)


def strict(tmp_path: Path) -> dict:
    return config(tmp_path, signing_key={"env": "KEY_A"})


def signed_by(tmp_path: Path, tier: str, cid: str) -> str:
    return json.loads((tmp_path / tier / cid / "tierstore.json").read_text())["signed_by"]


def plant(tmp_path: Path, tier: str, source: str = "step-100", cid: str = "step-300") -> None:
    """What someone without the key can write: a copy of ``source``'s files (their keyed digests
    still match them) under a newer id, with an unsigned manifest naming step 300."""
    shutil.copytree(tmp_path / tier / source, tmp_path / tier / cid)
    path = tmp_path / tier / cid / "tierstore.json"
    data = json.loads(path.read_text())
    data.update(checkpoint_id=cid, step=300, committed=time.time(), created=time.time(),
                checksum_algorithm="xxh3_128", signed_by="")
    data.pop(SEAL_KEY)
    data[SEAL_KEY] = seal_of(data)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def save_step_100(tmp_path: Path) -> None:
    with tierstore.open(strict(tmp_path)) as store:
        dcp.save(state(100), storage_writer=store.writer(), checkpoint_id="step-100")
        store.wait()
    assert signed_by(tmp_path, "slow", "step-100")


def assert_step_300_is_refused_once_the_migration_ends(tmp_path: Path) -> None:
    with tierstore.open(strict(tmp_path)) as store:
        assert store.latest() == "step-100"
        out = empty()
        with pytest.raises(Exception, match="not signed") as err:
            dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-300")
        assert "accept_unsigned" in str(err.value)
        assert torch.equal(out["w"], empty()["w"])


def test_an_unsigned_checkpoint_copied_by_a_drain_stays_unsigned(tmp_path, key):
    save_step_100(tmp_path)
    plant(tmp_path, "fast")
    with tierstore.open(migrating(tmp_path)) as store:  # the open resumes the missing drain
        store.wait()
        assert store.latest() == "step-300"  # (as accept_unsigned allows, while it lasts)
    assert signed_by(tmp_path, "slow", "step-300") == ""
    shutil.rmtree(tmp_path / "fast" / "step-300")  # only the drained copy is left
    assert_step_300_is_refused_once_the_migration_ends(tmp_path)


def test_an_unsigned_checkpoint_promoted_or_pinned_stays_unsigned(tmp_path, key):
    save_step_100(tmp_path)
    plant(tmp_path, "fast")
    (tmp_path / "slow").rename(tmp_path / "slow-away")  # no drain resumes: promote copies
    with tierstore.open(migrating(tmp_path, tiers=("fast",))) as store:
        store.pin("step-300")
    assert signed_by(tmp_path, "fast", "step-300") == ""
    (tmp_path / "slow-away").rename(tmp_path / "slow")
    with tierstore.open(migrating(tmp_path)) as store:
        store.wait()
        shutil.rmtree(tmp_path / "slow" / "step-300", ignore_errors=True)
        store.promote("step-300", "slow", pin=True)
    assert signed_by(tmp_path, "slow", "step-300") == ""
    assert_step_300_is_refused_once_the_migration_ends(tmp_path)


def test_an_unsigned_checkpoint_repaired_by_scrub_stays_unsigned(tmp_path, key):
    save_step_100(tmp_path)
    plant(tmp_path, "fast")
    plant(tmp_path, "slow")
    data = tmp_path / "slow" / "step-300" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[100:104] = b"\xff\xff\xff\xff"
    data.write_bytes(raw)
    with tierstore.open(migrating(tmp_path)) as store:
        report = store.scrub(repair=True)
        assert [(r.tier, r.checkpoint_id) for r in report.repaired] == [("slow", "step-300")]
    assert signed_by(tmp_path, "slow", "step-300") == ""
    shutil.rmtree(tmp_path / "fast" / "step-300")
    assert_step_300_is_refused_once_the_migration_ends(tmp_path)


# -- verify_on_load ---------------------------------------------------------------------------

def test_verify_on_load_false_with_a_signing_key_is_a_config_error(tmp_path, key):
    with pytest.raises(ConfigError) as err:
        tierstore.open(config(tmp_path, signing_key={"env": "KEY_A"}, verify_on_load=False))
    text = str(err.value)
    assert "verify_on_load = false" in text and "signing key" in text
    assert "every byte a load hands to the model" in text
    assert "remove verify_on_load" in text


def test_verify_on_load_false_without_a_key_still_opens(tmp_path):
    with tierstore.open(config(tmp_path, verify_on_load=False)) as store:
        assert store.latest() is None


# -- a key written in the config --------------------------------------------------------------

SHAPES = {
    "signing_keys as a string": (f'signing_keys = "{KEY_A}"', "signing_keys", "an array"),
    "signing_key as an array": (f'signing_key = ["{KEY_A}"]', "signing_key", "a table"),
    "the key as a variable name": (f'signing_key = {{ env = "{KEY_A}" }}', "signing_key",
                                   "environment variable"),
}


def toml(tmp_path: Path, line: str) -> Path:
    path = tmp_path / "tiers.toml"
    path.write_text(f'[store]\n{line}\n\n[[tier]]\nname = "fast"\nbackend = "local"\n'
                    f'path = "{tmp_path / "fast"}"\n')
    return path


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_key_written_in_the_config_is_never_echoed(tmp_path, shape):
    line, option, wants = SHAPES[shape]
    path = toml(tmp_path, line)
    with pytest.raises(ConfigError) as err:
        tierstore.open(path)
    text = str(err.value)
    assert KEY_A not in text and KEY_A[:12] not in text
    assert f"'{option}'" in text or f"[store] {option}" in text
    assert wants in text
    out = subprocess.run([TIERSTORE, "ls", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert KEY_A not in out.stderr and KEY_A not in out.stdout
    assert option in out.stderr and wants in out.stderr


def test_a_secret_key_written_bare_is_not_echoed_by_the_toml_error(tmp_path):
    """Not even TOML's own error (an unquoted key is no TOML value) shows the line."""
    path = toml(tmp_path, f"signing_key = {KEY_A}")
    with pytest.raises(ConfigError) as err:
        tierstore.open(path)
    assert KEY_A not in str(err.value) and "not valid TOML" in str(err.value)


def test_type_errors_say_an_array(tmp_path):
    with pytest.raises(ConfigError, match="must be an array, got"):
        tierstore.open(config(tmp_path, plugins="x"))


# -- key files --------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_key_file_others_can_read_is_refused(tmp_path, mode):
    path = tmp_path / "key"
    path.write_text(KEY_A + "\n")
    path.chmod(mode)
    with pytest.raises(ConfigError) as err:
        tierstore.open(config(tmp_path, signing_key={"file": str(path)}))
    text = str(err.value)
    assert str(path) in text and f"{mode:04o}" in text and f"chmod 600 {path}" in text
    assert KEY_A not in text


def test_a_key_file_only_its_owner_reads_opens(tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY_A + "\n")
    path.chmod(0o600)
    with tierstore.open(config(tmp_path, signing_key={"file": str(path)})) as store:
        assert store.latest() is None



@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_key_file_owned_by_another_user_is_refused(tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY_A + "\n")
    path.chmod(0o600)
    os.chown(path, 12345, -1)
    with pytest.raises(ConfigError) as err:
        tierstore.open(config(tmp_path, signing_key={"file": str(path)}))
    assert str(path) in str(err.value) and "owned by user id 12345" in str(err.value)
    assert KEY_A not in str(err.value)
