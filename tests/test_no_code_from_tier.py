"""No code runs from a tier: a non-tensor value of a checkpoint (DCP pickles each one) is loaded
only when it builds nothing beyond ``weights_only``'s allow-list, numpy arrays, ``io.BytesIO``
and ``[store] trusted_pickles``. Anyone able to write a tier can write a checkpoint whose value
pickles ``os.system(...)`` (tierstore itself writes one, with a manifest that checks out): loads,
unverified loads, files read as a peer sent them and ``tierstore export`` refuse it, naming the
key and the global, and the command never runs. Messages between ranks are not pickles."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import tierstore
from tierstore import IntegrityError, TierstoreError
from tierstore.format.item_io import read_items
from tierstore.format.manifest import FileEntry
from tierstore.format.metadata import load_metadata
from tierstore.format.values import UntrustedValue, check_trusted_names
from tierstore.transport.transfer import MessageError, decode_message, encode_message


class RunsCommand:
    """Pickles as a call of ``os.system``: what a hostile checkpoint holds."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@dataclasses.dataclass
class LoaderState:
    """A training job's own class, saved as a non-tensor value."""

    epoch: int
    order: list


LOADER_STATE = f"{LoaderState.__module__}.{LoaderState.__qualname__}"


def config(tmp_path: Path, **store) -> dict:
    return {"store": store, "tier": [{"name": "fast", "backend": "local",
                                      "path": str(tmp_path / "fast")}]}


def hostile_state(marker: Path) -> dict:
    return {"w": torch.arange(8, dtype=torch.float32),
            "trainer": {"step": 7, "hook": RunsCommand(f"touch {marker}")}}


def save(tmp_path: Path, state: dict, cid: str = "step-7", **store) -> None:
    with tierstore.open(config(tmp_path, **store)) as s:
        dcp.save(state, storage_writer=s.writer(), checkpoint_id=cid)


@pytest.mark.parametrize("verify_on_load", [True, False])
def test_a_value_that_runs_a_command_is_refused_and_nothing_runs(tmp_path, verify_on_load):
    marker = tmp_path / "pwned"
    save(tmp_path, hostile_state(marker))
    out = {"w": torch.zeros(8), "trainer": {"step": 0, "hook": None}}
    with tierstore.open(config(tmp_path, verify_on_load=verify_on_load)) as store:
        # DCP wraps what read_data raises (a CheckpointException carrying our message).
        with pytest.raises((TierstoreError, CheckpointException)) as info:
            dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-7")
    message = str(info.value)
    assert "non-tensor value 'trainer.hook'" in message and "posix.system" in message
    assert "cannot be allowed" in message
    assert not marker.exists()
    # Not even the harmless value beside it in the same file was loaded.
    assert out["trainer"] == {"step": 0, "hook": None}


def test_a_file_read_as_a_peer_sent_it_is_checked_too(tmp_path):
    """The reader reads a file a peer sent from memory, unverified (its checksum was checked on
    arrival): the same read of the data file refuses the value."""
    marker = tmp_path / "pwned"
    save(tmp_path, hostile_state(marker))
    directory = tmp_path / "fast/step-7"
    metadata = load_metadata((directory / ".metadata").read_bytes(), "test")
    planner = DefaultLoadPlanner()
    planner.set_up_planner({"w": torch.zeros(8), "trainer": {"step": 0, "hook": None}},
                           metadata)
    reqs = planner.create_local_plan().items
    (name,) = {metadata.storage_data[r.storage_index].relative_path for r in reqs}
    entry = FileEntry(**json.loads((directory / "tierstore.json").read_text())["files"][name])
    with pytest.raises(UntrustedValue, match=r"'trainer\.hook' would call posix\.system") as info:
        read_items(io.BytesIO((directory / name).read_bytes()), entry, reqs,
                   metadata.storage_data, metadata, planner, None)
    assert info.value.key == "trainer.hook" and info.value.global_name == "posix.system"
    assert isinstance(info.value, IntegrityError)
    assert not marker.exists()


def test_a_class_of_the_job_loads_once_trusted(tmp_path):
    state = {"loader": LoaderState(3, [2, 0, 1]), "w": torch.ones(4)}
    save(tmp_path, state)

    def load(**store) -> dict:
        out = {"loader": None, "w": torch.zeros(4)}
        with tierstore.open(config(tmp_path, **store)) as s:
            dcp.load(out, storage_reader=s.reader(), checkpoint_id="step-7")
        return out

    with pytest.raises((TierstoreError, CheckpointException)) as info:
        load()
    message = str(info.value)
    assert f"non-tensor value 'loader' would build {LOADER_STATE}" in message
    assert f'[store] trusted_pickles = ["{LOADER_STATE}"]' in message
    out = load(trusted_pickles=[LOADER_STATE])
    assert out["loader"] == LoaderState(3, [2, 0, 1]) and torch.equal(out["w"], torch.ones(4))


def test_a_blocked_module_cannot_be_trusted():
    with pytest.raises(ValueError, match="'posix.system' cannot be trusted"):
        check_trusted_names(["posix.system"])
    with pytest.raises(ValueError, match="is not a global's full name"):
        check_trusted_names(["LoaderState"])


def test_what_training_saves_beside_tensors_round_trips(tmp_path):
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    state = {"w": torch.randn(16), "progress": {"step": 1200, "epoch": 3},
             "tokens": io.BytesIO(b"\x00raw bytes of a tokenizer\xff"),
             "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
             "numpy_rng": np.random.get_state(), "losses": [2.5, 1.25, 0.625]}
    save(tmp_path, state)
    out = {"w": torch.zeros(16), "progress": {"step": 0, "epoch": 0}, "tokens": io.BytesIO(),
           "torch_rng": torch.zeros_like(state["torch_rng"]), "python_rng": None,
           "numpy_rng": None, "losses": [0.0, 0.0, 0.0]}
    with tierstore.open(config(tmp_path)) as store:
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-7")
    assert torch.equal(out["w"], state["w"]) and out["progress"] == state["progress"]
    assert out["tokens"].getvalue() == state["tokens"].getvalue()
    assert torch.equal(out["torch_rng"], state["torch_rng"])
    assert out["python_rng"] == state["python_rng"]
    got, want = out["numpy_rng"], state["numpy_rng"]
    assert got[0] == want[0] and np.array_equal(got[1], want[1]) and got[2:] == want[2:]
    assert out["losses"] == state["losses"]


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierstore.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=180)


def test_export_runs_nothing_from_a_hostile_checkpoint(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    marker = tmp_path / "pwned"
    toml = tmp_path / "tiers.toml"
    toml.write_text(f'[[tier]]\nname = "fast"\nbackend = "local"\npath = '
                    f'"{tmp_path / "fast"}"\n')
    with tierstore.open(str(toml)) as store:
        dcp.save(hostile_state(marker), storage_writer=store.writer(), checkpoint_id="step-7")

    safe = tmp_path / "out.safetensors"
    proc = _cli("export", toml, "step-7", "--format", "safetensors", "--out", safe)
    assert proc.returncode == 0, proc.stderr
    assert "left out (not tensors): trainer.hook, trainer.step" in proc.stdout
    assert torch.equal(load_file(str(safe))["w"], torch.arange(8, dtype=torch.float32))
    assert not marker.exists()

    pickled = tmp_path / "out.pt"
    proc = _cli("export", toml, "step-7", "--format", "torch", "--out", pickled)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("tierstore: error:")]
    assert "non-tensor value 'trainer.hook' would call posix.system" in error
    assert not marker.exists() and not pickled.exists()
    assert not list(tmp_path.glob(".out.pt.*"))  # nor a half-written temporary file


def test_messages_between_ranks_are_plain_data_and_a_bad_one_is_a_clear_error(tmp_path):
    # What replication sends to its peers: a header with the manifest entries of its files,
    # as their fields.
    entry = dataclasses.asdict(FileEntry(96, "xxh3_128:00ff", 0, [[0, 64, 32]]))
    header = {"files": {"__0_0.distcp": entry},
              "step": 7, "token": "a1b2", "codecs": [], "created": 1.5, "world_size": 2}
    assert decode_message(encode_message(header), "rank 1") == header
    assert decode_message(encode_message({1: (b"\x00", None, True)})) == {1: (b"\x00", None,
                                                                              True)}
    with pytest.raises(TypeError, match="cannot travel between ranks"):
        encode_message({"hook": RunsCommand("true")})
    with pytest.raises(TypeError, match="cannot travel between ranks"):
        encode_message(FileEntry(96, "xxh3_128:00ff"))

    marker = tmp_path / "pwned"
    hostile = pickle.dumps({"files": RunsCommand(f"touch {marker}")})
    with pytest.raises(MessageError, match="rank 3 sent a message of encoding version 128"):
        decode_message(hostile, "rank 3")
    assert not marker.exists()
    with pytest.raises(MessageError, match="rank 3 sent a message of encoding version 2"):
        decode_message(b"\x02" + encode_message(header)[1:], "rank 3")
    with pytest.raises(MessageError, match="rank 3 sent a malformed message"):
        decode_message(b'\x01{"r":"posix.system","f":{}}', "rank 3")
    with pytest.raises(MessageError, match="rank 3 sent a malformed message"):
        decode_message(encode_message(header)[:-5], "rank 3")
