"""DCP save modes that change who plans and commits: ``use_collectives=False`` is refused
before anything is written, and plan caching keeps each save's identity its own."""

from __future__ import annotations

import json

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from helpers import run_torchrun


def test_multi_rank_modes_under_torchrun(tmp_path):
    out = run_torchrun("save_modes_worker.py", str(tmp_path), nproc=2)
    assert "RANK 0 OK" in out and "RANK 1 OK" in out


def test_plan_caching_gives_every_save_its_own_token(store, tmp_path):
    tokens = []
    for step in (1, 2, 3):
        sd = {"w": torch.full((8,), float(step)), "step": step}
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id=f"step-{step}",
                 planner=DefaultSavePlanner(enable_plan_caching=True))
        manifest = json.loads((tmp_path / "nvme" / f"step-{step}" / "tierstore.json").read_text())
        tokens.append(manifest["save_token"])
    assert len(set(tokens)) == 3, tokens
    for step in (1, 2, 3):
        out = {"w": torch.zeros(8), "step": 0}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id=f"step-{step}")
        assert torch.equal(out["w"], torch.full((8,), float(step))) and out["step"] == step
