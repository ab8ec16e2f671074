"""A 2-rank job (torchrun, gloo, CPU) saving into and loading from one shared tier root.

The worker (tests/scripts/multirank_worker.py) checks, on every rank: a DTensor sharded over a
2-rank mesh (several dtypes, float8 included), a ShardedTensor (ChunkShardingSpec on
rank:0/cpu, rank:1/cpu), a replicated tensor, per-rank tensors of many dtypes and non-tensor items
come back bitwise equal through ``store.reader()`` and through stock ``dcp.load`` on the checkpoint
directory; ``store.latest()`` is the same on both ranks.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import run_torchrun

import tierstore


@pytest.mark.timeout(200)
def test_two_ranks_save_and_load_bitwise(tmp_path):
    root = tmp_path / "shared-tier"
    run_torchrun("multirank_worker.py", root)  # every rank OK, no MISMATCH

    # Seen afterwards from a plain (non-distributed) process: both checkpoints are there,
    # verified, written by a world of 2, with data files from both ranks, and nothing hidden left.
    with tierstore.open({"tier": [{"name": "disk", "backend": "local", "path": str(root)}]}) as s:
        assert [c.id for c in s.list()] == ["step-2", "step-1"]
        assert s.latest() == "step-2"
        report = s.verify("step-2")
        assert report.ok, report
    manifest = json.loads((root / "step-2" / "tierstore.json").read_text())
    assert manifest["world_size"] == 2
    names = set(os.listdir(root / "step-2"))
    assert any(n.startswith("__0_") for n in names) and any(n.startswith("__1_") for n in names)
    assert not [n for n in os.listdir(root) if n.startswith(".tierstore")]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("phase,failing_rank",
                         [("write_file", 1), ("publish", 0), ("mismatch", 1)],
                         ids=["rank1-write_file", "rank0-publish", "rank1-another-id"])
def test_save_failing_on_one_rank(tmp_path, phase, failing_rank):
    """One rank's save of step-2 fails: every rank gets the error, latest() stays step-1 on both,
    step-3 then saves and loads, and no hidden leftover of step-2 stays in the shared root."""
    root = tmp_path / "shared-tier"
    run_torchrun("multirank_fail_worker.py", root, phase, failing_rank)  # OK, no PROBLEM
    assert sorted(os.listdir(root)) == ["step-1", "step-3"]


@pytest.mark.timeout(120)
def test_layouts_a_job_cannot_use_are_refused_before_anything_is_written(tmp_path):
    out = run_torchrun("per_rank_root_worker.py", tmp_path / "t", expect_ok=False)
    for rank in range(2):
        assert f"RANK {rank} SHARED CONFIGERROR" in out and f"RANK {rank} ORDER CONFIGERROR" in out
        assert f"RANK {rank} GOOD OPENED" in out
    assert "tier 'nvme' says shared = true but its path differs between ranks" in out
    assert "tier 'slow' has a directory per group of ranks [[0], [1]], but the faster tier " \
           "'fast' is shared by every rank" in out and "list node-local tiers first" in out
    assert not (tmp_path / "t").exists(), "opening a store must not write anything"


def test_latest_during_an_async_save_waits_for_it_instead_of_deadlocking(tmp_path):
    """``store.latest()`` right after ``dcp.async_save(process_group=store.process_group)``:
    both use the store's group (the save in DCP's thread); latest waits for the save and names
    it, on every rank, every time."""
    run_torchrun("latest_during_save_worker.py", tmp_path / "t", timeout=90)
