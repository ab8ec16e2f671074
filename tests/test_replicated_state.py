"""DDP-style replicated state (the most common training setup) on node-local tiers: DCP writes
each replicated item once, in one rank's file, and every rank loads it from there."""

from __future__ import annotations

from helpers import run_torchrun


def test_replicated_state_on_a_tier_per_rank_loads_on_every_rank(tmp_path):
    out = run_torchrun("replicated_state_worker.py", str(tmp_path), nproc=2)
    assert "RANK 0 OK" in out and "RANK 1 OK" in out
