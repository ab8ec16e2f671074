"""Node-local tiers: 2 simulated nodes x 2 ranks (two torchrun invocations on a localhost
rendezvous, GROUP_RANK 0 and 1), a RAM tier per node and a shared disk tier behind it."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from helpers import run_torchrun


def run_two_nodes(*args) -> str:
    """two_node_worker.py on 2 simulated nodes x 2 ranks; every rank's output (fails unless
    every rank is OK)."""
    return run_torchrun("two_node_worker.py", *args, nnodes=2, timeout=180)


def hidden(path: Path) -> list[str]:
    return [n for n in os.listdir(path) if n.startswith(".")]


@pytest.mark.timeout(600)
def test_node_local_ram_tier_with_a_shared_tier_behind_it(tmp_path):
    out = run_two_nodes(str(tmp_path), "save")
    assert "RANK 2 NODE 1 RAM PART 1 OF 2" in out and "RANK 1 NODE 0 RAM PART 0 OF 2" in out

    # Each node's RAM holds its own ranks' files; only the coordinator's node has .metadata.
    node0 = json.loads((tmp_path / "ram/0/step-2/tierstore.json").read_text())
    node1 = json.loads((tmp_path / "ram/1/step-2/tierstore.json").read_text())
    assert (node0["part"], node0["parts"], node0["ranks"]) == (0, 2, [0, 1])
    assert (node1["part"], node1["parts"], node1["ranks"]) == (1, 2, [2, 3])
    assert ".metadata" in node0["files"] and ".metadata" not in node1["files"]
    assert {e["rank"] for k, e in node1["files"].items()} == {2, 3}
    assert node0["save_token"] == node1["save_token"]
    # The shared tier holds the whole checkpoint, gathered from both nodes, as one commit.
    shared = json.loads((tmp_path / "shared/step-2/tierstore.json").read_text())
    assert (shared["parts"], shared["ranks"]) == (1, [0, 1, 2, 3])
    assert set(shared["files"]) == set(node0["files"]) | set(node1["files"])
    assert sorted(os.listdir(tmp_path / "shared/step-2")) == sorted(
        list(shared["files"]) + ["tierstore.json"])
    for path in (tmp_path / "ram/0", tmp_path / "ram/1", tmp_path / "shared"):
        assert hidden(path) == [], path
    # Every rank copied the files it wrote to the shared tier itself (the ranks of a node side
    # by side, not one rank per node), and rank 0 also .metadata; no rank copied another's.
    drained = re.findall(r"^RANK (\d) DRAINED (\S+) TO shared$", out, re.M)
    assert sorted(file for _, file in drained) == sorted(
        set(node0["files"]) | set(node1["files"])), out
    for rank, file in drained:
        assert file == ".metadata" and rank == "0" or file.startswith(f"__{rank}_"), drained
    assert {rank for rank, _ in drained} == {"0", "1", "2", "3"}, drained

    # Both nodes intact: each rank reads its own files from its node's RAM; files written on
    # the other node come from the shared tier.
    out = run_two_nodes(str(tmp_path), "load", "step-2")
    assert "RANK 0 READ .metadata" not in out
    assert "RANK 2 READ __2_0.distcp FROM ram" in out
    assert "RANK 0 READ __0_0.distcp FROM ram" in out

    # Node 1 is replaced: its RAM tier is empty. Its ranks load everything from the shared tier.
    shutil.rmtree(tmp_path / "ram/1")
    out = run_two_nodes(str(tmp_path), "load", "step-2")
    assert "RANK 2 READ __2_0.distcp FROM shared" in out
    assert "RANK 3 READ __3_0.distcp FROM shared" in out
    assert "RANK 0 READ __0_0.distcp FROM ram" in out

    # With step-2 also gone from the shared tier, no node can give ranks 2 and 3 their step-2
    # files: latest() agrees on step-1 on every rank (node 0's RAM + the shared tier).
    shutil.rmtree(tmp_path / "shared/step-2")
    out = run_two_nodes(str(tmp_path), "load", "step-1")
    for rank in range(4):
        assert f"RANK {rank} LATEST step-1" in out


@pytest.mark.timeout(300)
def test_a_node_local_drain_to_a_tier_with_other_codecs_reencodes_every_nodes_part(tmp_path):
    """2 nodes x 1 rank: a node-local memory tier, and behind it a node-local tier with
    ``codecs = ["zstd"]``. Only the coordinator's part holds DCP's ``.metadata``, yet every
    node re-encodes its own part: ``store.wait()`` raises on no rank, and with the memory tier
    gone both checkpoints load bitwise from the zstd tier alone."""
    out = run_torchrun("node_codecs_worker.py", str(tmp_path), nproc=1, nnodes=2, timeout=240)
    for rank in (0, 1):
        assert f"RANK {rank} WAITED" in out
    for cid in ("step-1", "step-2"):
        assert f"RANK 0 PART {cid} CODECS zstd METADATA yes" in out
        assert f"RANK 1 PART {cid} CODECS zstd METADATA no" in out
