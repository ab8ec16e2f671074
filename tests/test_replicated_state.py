"""DDP-style replicated state (the most common training setup) on node-local tiers: DCP writes
each replicated item once, in one rank's file, and every rank loads it from there."""

from __future__ import annotations

import shutil

from helpers import run_torchrun


def test_replicated_state_on_a_tier_per_rank_loads_on_every_rank(tmp_path):
    out = run_torchrun("replicated_state_worker.py", str(tmp_path), nproc=2)
    assert "RANK 0 OK" in out and "RANK 1 OK" in out


def test_budgeted_lazy_staging_of_replicated_state_loads_on_every_rank(tmp_path):
    """Each rank spills all of its (replicated) state; DCP's plan has each replicated item
    written by one rank, from that rank's spill."""
    out = run_torchrun("replicated_state_worker.py", str(tmp_path), "budget", nproc=2)
    assert "RANK 0 OK" in out and "RANK 1 OK" in out
    for rank in (0, 1):
        assert not [p for p in (tmp_path / "ram" / str(rank)).iterdir()
                    if p.name.startswith(".")], rank


def test_replicated_state_loads_after_a_node_is_lost(tmp_path):
    """2 simulated nodes x 2 ranks, RAM and a peer tier: node 1 is replaced (its RAM and peer
    directories are gone); every rank loads its own tensor and the replicated step from the
    replicas node 0 holds."""
    root = str(tmp_path)
    run_torchrun("lost_node_worker.py", root, "save", nnodes=2, timeout=180)
    shutil.rmtree(tmp_path / "ram/1")
    shutil.rmtree(tmp_path / "peer/1")
    out = run_torchrun("lost_node_worker.py", root, "load", nnodes=2, timeout=180)
    for rank in range(4):
        assert f"RANK {rank} OK" in out
