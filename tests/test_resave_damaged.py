"""Saving an id again whose copy can no longer load: what is left of it (a file removed or cut
short) is no checkpoint, so ``latest()`` skips it and a restarted job that saves the id again
replaces it instead of failing with "already exists" at every restart. A whole copy, on the
first tier or on a slower tier of this machine alone, is still refused."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore import CommitError


def two_tiers(tmp_path):
    return {"tier": [
        {"name": "ram", "backend": "memory", "path": str(tmp_path / "ram")},
        {"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")},
    ]}


def state(value: float) -> dict:
    return {"w": torch.full((4096,), value), "b": torch.arange(100) * value, "step": int(value)}


def save(store, cid: str, value: float) -> None:
    dcp.save(state(value), storage_writer=store.writer(), checkpoint_id=cid)


def load(store, cid: str) -> dict:
    out = {"w": torch.zeros(4096), "b": torch.zeros(100), "step": 0}
    dcp.load(out, storage_reader=store.reader(), checkpoint_id=cid)
    return out


def damage(copy, how: str) -> None:
    """Remove one data file of ``copy`` or cut it short (its manifest is left as it was)."""
    data = sorted(p for p in os.listdir(copy) if p.endswith(".distcp"))[0]
    path = copy / data
    if how == "vanish":
        os.remove(path)
    else:
        os.truncate(path, os.path.getsize(path) // 2)


@pytest.mark.parametrize("how", ["vanish", "short"])
@pytest.mark.parametrize("where", ["ram", "nvme"])
def test_a_damaged_copy_is_replaced_by_the_next_save_of_its_id(tmp_path, where, how):
    with tierstore.open(two_tiers(tmp_path)) as store:
        save(store, "step-1", 1.0)
        save(store, "step-2", 2.0)
        store.wait()
    # Both tiers lose step-2 (the fast one, or the slow one with the fast one gone): it can no
    # longer load from anywhere, so the job restarts from step-1.
    damage(tmp_path / where / "step-2", how)
    other = "nvme" if where == "ram" else "ram"
    for entry in os.listdir(tmp_path / other / "step-2"):
        os.remove(tmp_path / other / "step-2" / entry)
    os.rmdir(tmp_path / other / "step-2")
    with tierstore.open(two_tiers(tmp_path)) as store:
        assert store.latest() == "step-1"
        save(store, "step-2", 20.0)
        store.wait()  # the drain to nvme replaces a damaged copy there too
        assert store.latest() == "step-2"
        got = load(store, "step-2")
        assert torch.equal(got["w"], torch.full((4096,), 20.0)) and got["step"] == 20
        for tier in ("ram", "nvme"):
            assert not store.verify("step-2", tier=tier).problems
            # Nothing of the damaged copy is left beside the new one.
            assert sorted(os.listdir(tmp_path / tier)) == ["step-1", "step-2"]


def test_a_whole_copy_on_a_slower_tier_alone_still_refuses_its_id(tmp_path):
    with tierstore.open(two_tiers(tmp_path)) as store:
        save(store, "step-1", 1.0)
        store.wait()
    damage(tmp_path / "ram" / "step-1", "vanish")  # the fast copy is gone, nvme's is whole
    with tierstore.open(two_tiers(tmp_path)) as store:
        with pytest.raises(CommitError, match="checkpoint 'step-1' already exists on tier "
                                              "'nvme'.*overwrite = true"):
            save(store, "step-1", 5.0)
        got = load(store, "step-1")  # the refused save lost nothing
        assert torch.equal(got["w"], torch.full((4096,), 1.0))
