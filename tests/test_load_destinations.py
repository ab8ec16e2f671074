"""Loading into destinations that cannot take a file's raw bytes in place: tensors on a GPU
(the ``cuda`` cases run in ``make gpu-test`` and are skipped where CUDA is not available, as in
CI), and on the CPU a transposed view. Their bytes come from the same checked blocks (straight
from a checked copy's mapped pages, else through a buffer of the load's own) and are copied in
only once the whole load has been checked: every tier kind loads bitwise, a load that fails
leaves the destinations as they were, and a load that needs part of a file from an object store
reads that part only."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from recording import Recorder

import tierstore
from tierstore import EventKind
from tierstore.format.item_io import BLOCK_MIN_BYTES

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def saved_state() -> dict:
    """Large and small tensors of several dtypes, a scalar and values that are not tensors."""
    gen = torch.Generator().manual_seed(3)
    return {"w": torch.randn(1024, 768, generator=gen),
            "bf16": torch.randn(4096, 257, generator=gen).to(torch.bfloat16),
            "small": torch.randn(33, generator=gen),
            "ids": torch.randint(0, 1 << 40, (1000,), generator=gen),
            "scalar": torch.tensor(2.5),
            "step": 11, "extra": {"lr": 0.1}}


def on_device(sd: dict, device: str) -> dict:
    """Destinations on ``device``, filled with a marker; ``w`` is a transposed (not contiguous)
    view, as a resharded or fused parameter can be."""
    out = {k: torch.full_like(v, 7, device=device) for k, v in sd.items()
           if isinstance(v, torch.Tensor)}
    out["w"] = torch.full((768, 1024), 7.0, device=device).t()
    out.update(step=0, extra={"lr": 0.0})
    return out


def tier(kind: str, root: Path) -> dict:
    if kind == "fsspec":
        return {"name": "t", "backend": "fsspec", "url": f"file://{root}/objects"}
    return {"name": "t", "backend": kind, "path": str(root / kind)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["memory", "local", "fsspec"])
def test_a_load_into_such_destinations_is_bitwise_from_every_tier_kind(tmp_path, kind, device):
    config = {"tier": [tier(kind, tmp_path)]}
    sd = saved_state()
    with tierstore.open(config) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
    out = on_device(sd, device)
    with tierstore.open(config) as store:
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    for key, want in sd.items():
        if isinstance(want, torch.Tensor):
            assert out[key].device.type == device, key
            assert out[key].dtype == want.dtype and out[key].shape == want.shape, key
            assert torch.equal(out[key].cpu(), want), key
        else:
            assert out[key] == want, key


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_load_leaves_such_destinations_as_they_were(tmp_path, device):
    config = {"store": {"io_threads": 1}, "tier": [tier("local", tmp_path)]}
    sd = saved_state()
    with tierstore.open(config) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
    data, = sorted((tmp_path / "local" / "step-1").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte, size and manifest unchanged
    data.write_bytes(bytes(raw))
    out = on_device(sd, device)
    before = {k: v.clone() for k, v in out.items() if isinstance(v, torch.Tensor)}
    with tierstore.open(config) as store, pytest.raises(CheckpointException) as info:
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    assert f"no tier has a good copy of {data.name}" in str(info.value), info.value
    for key, was in before.items():
        assert torch.equal(out[key], was), f"{key} was changed by a load that failed"
    assert out["step"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_part_of_a_file_on_an_object_store_lands_from_its_checked_blocks(tmp_path, device):
    config = {"store": {"io_threads": 1}, "tier": [tier("fsspec", tmp_path)]}
    gen = torch.Generator().manual_seed(5)
    saved = {k: torch.rand(768, 1024, generator=gen) for k in "abc"}  # one file of 9 MiB
    with tierstore.open(config) as store:
        dcp.save(saved, storage_writer=store.writer(), checkpoint_id="step-1")
    out = {"b": torch.zeros(1024, 768, device=device).t()}
    recorder = Recorder()
    with tierstore.open(config, plugins=[recorder]) as store:
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    assert torch.equal(out["b"].cpu(), saved["b"])
    loaded, = [e for e in recorder.events if e.kind == EventKind.LOADED]
    read = loaded.detail["bytes_from"]["t"]
    assert 3 << 20 <= read <= (3 << 20) + 2 * BLOCK_MIN_BYTES, read
