"""A commit protocol chosen with ``[store] commit`` works on any backend it supports, eviction
included (the protocol, not the backend, says how a checkpoint is deleted)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

import tierstore


def test_manifest_last_on_a_local_tier_applies_keep(tmp_path):
    config = {"store": {"commit": "manifest-last"},
              "tier": [{"name": "disk", "backend": "local", "path": str(tmp_path), "keep": 1}]}
    with tierstore.open(config) as store:
        for step in (1, 2, 3):
            dcp.save({"w": torch.full((4,), float(step))}, storage_writer=store.writer(),
                     checkpoint_id=f"step-{step}")
        assert [c.id for c in store.list()] == ["step-3"]
        out = {"w": torch.zeros(4)}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-3")
    assert torch.equal(out["w"], torch.full((4,), 3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]
