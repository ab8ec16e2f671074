"""A file that no longer matches its manifest is explained: changed in place, replaced, grown,
or intact on the tier (the first read saw other bytes).

A drain checks every byte it reads from its source against the manifest and refuses to copy a
file that differs. The refusal says what the file holds now, read again block by block against
the digests its writer recorded, because each cause calls for another fix: bytes written over in
place after the file was closed, a file of other bytes put in its place, bytes appended, or a
first read that saw what the tier does not hold.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore import DrainError
from tierstore.engine.mismatch import explain_mismatch
from tierstore.events import Phase

#: four 1 MiB tensors: one data file of a little over 4 MiB in blocks of 128 KiB (33 blocks)
_TENSOR_BYTES = 1 << 20


def _state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {f"t{i}": torch.randn(_TENSOR_BYTES // 4, generator=gen) for i in range(4)}


def _config(tmp_path) -> dict:
    return {"store": {"io_threads": 1}, "tier": [
        {"name": "ram", "backend": "memory", "path": str(tmp_path / "ram")},
        {"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")}]}


def _flip_block(path: str, block: int, block_bytes: int) -> None:
    """Write over one byte of block ``block`` in place (the file keeps its size)."""
    with open(path, "r+b") as f:
        f.seek(block * block_bytes + 100)
        old = f.read(1)
        f.seek(block * block_bytes + 100)
        f.write(bytes([old[0] ^ 0xFF]))


def _replace_with_other_bytes(path: str, _block: int, _block_bytes: int) -> None:
    """Put a file of the same size and other bytes in its place."""
    size = os.path.getsize(path)
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(os.urandom(size))


def _append(path: str, _block: int, _block_bytes: int) -> None:
    with open(path, "ab") as f:
        f.write(b"late bytes")


class ChangeSourceBeforeDrain:
    """Changes the RAM copy's data file as the drain starts on it: a fault on the tier."""

    def __init__(self, root, change):
        self.root, self.change, self.done = root, change, False

    @tierstore.hookimpl
    def tierstore_phase(self, phase, tier):
        if phase == Phase.DRAIN_FILE and not self.done:
            self.done = True
            self.change(os.path.join(self.root, "step-1", "__0_0.distcp"), 3, 128 << 10)


@pytest.mark.parametrize("change, said", [
    (_flip_block, "1 of its 33 blocks differ (3 (bytes 393,216-524,288)), the others match: "
                  "it was written over in place after it was written"),
    (_replace_with_other_bytes, "all 33 of its blocks differ: it holds other bytes than "
                                "those written"),
    (_append, "bytes where 4,"),
], ids=["written-over-in-place", "replaced", "grown"])
def test_a_drain_refusing_its_source_says_how_the_file_differs(tmp_path, change, said):
    fault = ChangeSourceBeforeDrain(str(tmp_path / "ram"), change)
    with tierstore.open(_config(tmp_path), plugins=[fault]) as store:
        dcp.save(_state(1), storage_writer=store.writer(), checkpoint_id="step-1")
        with pytest.raises(DrainError) as info:
            store.wait()
    message = str(info.value)
    assert "__0_0.distcp on tier 'ram' does not match its manifest" in message
    assert said in message
    assert not os.path.exists(tmp_path / "nvme" / "step-1")  # nothing bad was copied


def test_a_file_intact_on_its_tier_is_said_to_be_intact(tmp_path):
    """The explanation of a mismatch the first read alone saw: the tier's bytes match."""
    with tierstore.open(_config(tmp_path)) as store:
        dcp.save(_state(1), storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
        tier = store._ctx.tiers.named("ram")
        entry = tier.complete_manifest("step-1").files["__0_0.distcp"]
        assert explain_mismatch(tier, "step-1/__0_0.distcp", entry).startswith(
            "read again, it matches its manifest: the first read saw other bytes than the tier "
            "holds")
        os.unlink(tmp_path / "ram" / "step-1" / "__0_0.distcp")
        assert explain_mismatch(tier, "step-1/__0_0.distcp", entry).startswith(
            "read again, it could not be read (FileNotFoundError")
