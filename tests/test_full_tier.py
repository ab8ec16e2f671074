"""A full tier never aborts the process: the save fails with an error naming the tier, the path
and the bytes, gc collects what it wrote, the previous checkpoint loads, and once space is freed
the next save succeeds. The tier lives on a small tmpfs mounted for the test."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import run_script

import tierstore

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="mounting a small tmpfs needs root")


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_tier_fails_the_save_clearly_and_the_process_lives(small_fs):
    root = small_fs / "nvme"
    big = 896 * 1024  # 3.5 MiB of fp32: more than is left beside step-1 on 4 MiB
    out = run_script("full_tier_save.py", str(root), str(big), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert "terminate called" not in out.stderr
    assert "IS TIER FULL True" in out.stdout, out.stdout
    failed = next(line for line in out.stdout.splitlines() if line.startswith("FAILED"))
    assert "tier 'nvme' is full" in failed and str(root) in failed
    assert f"needed about {big * 4:,} bytes" in failed and "bytes are free" in failed
    assert "LATEST step-1" in out.stdout and "LOADED True" in out.stdout
    assert "GC ['nvme:.tierstore-tmp.step-2." in out.stdout
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]
    # The operator frees space (removes step-1): the same save now fits and commits.
    with tierstore.open({"tier": [{"name": "nvme", "backend": "local",
                                   "path": str(root)}]}) as store:
        subprocess.run(["rm", "-r", str(root / "step-1")], check=True)
        dcp.save({"w": torch.full((big,), 2.0)}, storage_writer=store.writer(),
                 checkpoint_id="step-2")
        assert store.latest() == "step-2"
        got = {"w": torch.zeros(big)}
        dcp.load(got, storage_reader=store.reader(), checkpoint_id="step-2")
    assert torch.equal(got["w"], torch.full((big,), 2.0))


def test_a_budgeted_spill_that_fills_the_first_tier_fails_clearly_and_loses_nothing(small_fs):
    """A budgeted save spills its waves to the first tier; when they do not fit there the save
    fails with the tier, the cause and the fix, the checkpoint before still loads, nothing of
    the spill stays behind, and the process goes on saving."""
    root = small_fs / "nvme"
    config = {"store": {"staging": {"name": "cpu", "lazy": True, "max_staging_bytes": 1 << 20}},
              "tier": [{"name": "nvme", "backend": "local", "path": str(root)}]}
    small = {"w": torch.full((1 << 16,), 1.0)}
    with tierstore.open(config) as store:
        dcp.async_save(small, storage_writer=store.writer(),
                       checkpoint_id="step-1").upload_completion.result()
        big = {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(6)}  # 6 MiB on 4 MiB
        resp = dcp.async_save(big, storage_writer=store.writer(), checkpoint_id="step-2")
        with pytest.raises(tierstore.StagingError) as info:
            resp.staging_completion.result()
        message = str(info.value)
        assert "budgeted staging to tier 'nvme'" in message and "No space left" in message
        assert "free space there or raise max_staging_bytes" in message
        with pytest.raises(tierstore.StagingError):
            resp.upload_completion.result()
        assert store.latest() == "step-1"
        got = {"w": torch.zeros(1 << 16)}
        dcp.load(got, storage_reader=store.reader(), checkpoint_id="step-1")
        assert torch.equal(got["w"], small["w"])
        # The failed save's spill is gone at once, and the next save that fits commits.
        assert sorted(p.name for p in root.iterdir()) == ["step-1"]
        dcp.async_save(small, storage_writer=store.writer(),
                       checkpoint_id="step-3").upload_completion.result()
        assert store.latest() == "step-3"
