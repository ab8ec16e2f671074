"""A full tier never aborts the process: the save fails with a TierFullError naming the tier,
the path and the bytes, whichever write found no room (a data file, ``.metadata``, the manifest),
what it wrote is gone at once, the previous checkpoint loads, and once space is freed the next
save succeeds. The tier lives on a small tmpfs mounted for the test."""

from __future__ import annotations

import os
import shutil
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
    assert "GC []" in out.stdout  # the failed save removed what it wrote itself
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


def _state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4096, generator=gen), "b": torch.randn(300, generator=gen),
            "step": step}


def _causes(exc: BaseException) -> list[BaseException]:
    """What failed a save (DCP wraps a rank's failure in a CheckpointException)."""
    return [f[0] for f in getattr(exc, "failures", {}).values()] or [exc]


def _pages(directory) -> int:
    """The tmpfs pages the files under ``directory`` take."""
    return sum(os.stat(os.path.join(d, n)).st_blocks * 512 // 4096
               for d, _, names in os.walk(directory) for n in names)


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_a_first_tier_without_room_for_the_next_checkpoint_fails_each_write_with_tier_full_error(
        small_fs, backend):
    """The operator's case: the first tier's filesystem has a little less room than the next
    checkpoint takes. At each point from no room to one page short, the write that finds no
    room (a data file, then ``.metadata``, then the manifest) fails the save with a
    TierFullError naming the tier, the path and the bytes; nothing of the failed save stays
    on the tier, the checkpoint before it loads, and with room the same save commits."""
    def config(root):
        return {"tier": [{"name": "fast", "backend": backend, "path": str(root)}]}

    probe = small_fs / "probe"
    with tierstore.open(config(probe)) as store:
        dcp.save(_state(2), storage_writer=store.writer(), checkpoint_id="step-2")
    pages = _pages(probe / "step-2")  # what step-2 takes on this filesystem
    shutil.rmtree(probe)
    assert pages >= 4, pages

    root, ballast = small_fs / "fast", small_fs / "ballast"
    seen = {}  # pages short -> (what failed the save, what the tier holds after it)
    for short in range(pages, 0, -1):
        with tierstore.open(config(root)) as store:
            dcp.save(_state(1), storage_writer=store.writer(), checkpoint_id="step-1")
            with open(ballast, "wb") as f:  # leave room for all of step-2 but `short` pages
                os.posix_fallocate(f.fileno(), 0,
                                   shutil.disk_usage(small_fs).free - (pages - short) * 4096)
            with pytest.raises(BaseException) as info:
                dcp.save(_state(2), storage_writer=store.writer(), checkpoint_id="step-2")
            seen[short] = (_causes(info.value), sorted(p.name for p in root.iterdir()))
            assert store.latest() == "step-1"
            got = {"w": torch.zeros(4096), "b": torch.zeros(300), "step": None}
            dcp.load(got, storage_reader=store.reader(), checkpoint_id="step-1")
            assert torch.equal(got["w"], _state(1)["w"]) and got["step"] == 1
            if short == 1:  # room again: the same save commits
                ballast.unlink()
                dcp.save(_state(2), storage_writer=store.writer(), checkpoint_id="step-2")
                assert store.latest() == "step-2"
        ballast.unlink(missing_ok=True)
        shutil.rmtree(root)

    bare = {short: [f"{type(c).__name__}: {c}" for c in causes]
            for short, (causes, _) in seen.items()
            if not all(isinstance(c, tierstore.TierFullError) for c in causes)}
    assert not bare, f"pages short -> not a TierFullError: {bare}"
    named = set()
    for short, (causes, left) in seen.items():
        message = str(causes[0])
        assert "tier 'fast' is full (No space left on device)" in message, message
        assert f"writing {root}/" in message and "needed about" in message, message
        assert "bytes are free" in message, message
        named.add(message.split(f"writing {root}/", 1)[1].split(" ", 1)[0].split("/")[-1])
        assert left == ["step-1"], f"{short} page(s) short, the tier holds {left}"
    assert {".metadata", "tierstore.json"} <= named and any(n.endswith(".distcp") for n in named), \
        named
