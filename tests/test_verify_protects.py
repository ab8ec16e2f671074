"""``store.verify`` protects what it reads, like a load: ``keep`` cannot evict a checkpoint while
it is being verified, and an id that is on no tier is CheckpointNotFound, never an unexplained
"not ok"."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore import CheckpointNotFound, Phase


class HoldVerify:
    """Holds the first file of a verify until released."""

    def __init__(self):
        self.reached = threading.Event()
        self.release = threading.Event()

    @tierstore.hookimpl
    def tierstore_phase(self, phase):
        if phase == Phase.VERIFY_FILE and not self.reached.is_set():
            self.reached.set()
            assert self.release.wait(60)


def _config(tmp_path, keep=1):
    return {"tier": [{"name": "disk", "backend": "local", "path": str(tmp_path / "disk"),
                      **({} if keep is None else {"keep": keep})}]}


def test_keep_spares_a_checkpoint_while_it_is_verified(tmp_path):
    hold = HoldVerify()
    reports = []
    with tierstore.open(_config(tmp_path), plugins=[hold]) as store:
        dcp.save({"w": torch.ones(1000)}, storage_writer=store.writer(), checkpoint_id="step-1")
        thread = threading.Thread(target=lambda: reports.append(store.verify("step-1")))
        thread.start()
        assert hold.reached.wait(60)
        # keep = 1: this save's retention would evict step-1 under the running verify
        dcp.save({"w": torch.zeros(1000)}, storage_writer=store.writer(), checkpoint_id="step-2")
        hold.release.set()
        thread.join(60)
        assert reports[0].ok and reports[0].tiers == ["disk"], str(reports[0])
        assert {c.id for c in store.list()} == {"step-1", "step-2"}  # spared while verified
        dcp.save({"w": torch.ones(1000)}, storage_writer=store.writer(), checkpoint_id="step-3")
        assert [c.id for c in store.list()] == ["step-3"]  # evicted once the verify was over


def test_verifying_an_id_no_tier_holds_is_checkpoint_not_found(tmp_path):
    with tierstore.open(_config(tmp_path, keep=None)) as store:
        with pytest.raises(CheckpointNotFound, match=r"cannot verify 'step-9': no tier holds it"):
            store.verify("step-9")
    config = tmp_path / "tiers.toml"
    config.write_text(f'[[tier]]\nname = "disk"\nbackend = "local"\npath = "{tmp_path}/disk"\n')
    out = subprocess.run([sys.executable, "-m", "tierstore.cli", "verify", str(config), "step-9"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no tier holds it" in out.stderr
    assert f"`tierstore ls {config}` shows what is stored" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
