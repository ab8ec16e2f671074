"""Peer replica tier: 2 simulated nodes x 2 ranks (two torchrun invocations on a localhost
rendezvous, GROUP_RANK 0 and 1, ``{node}`` in the tier paths). With ``clique`` factor 2 jump 2
(or ``ring`` offset 2) every rank's files have a replica on the other node; losing node 1
entirely, its ranks get their shards back from node 0 over torch.distributed, not from the
object-store tier."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import run_torchrun

import tierstore


def run(*args) -> str:
    """peer_worker.py on 2 simulated nodes x 2 ranks; every rank's output (fails unless every
    rank is OK)."""
    return run_torchrun("peer_worker.py", *args, nnodes=2, timeout=180)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["clique", "ring"])
def test_a_lost_node_comes_back_from_its_peers(tmp_path, strategy):
    root = str(tmp_path)
    out = run(root, strategy, "obj", "save")
    # Every rank sent its files to the rank on the other node and kept that rank's files.
    for rank, peer in ((0, 2), (1, 3), (2, 0), (3, 1)):
        assert f"RANK {rank} REPLICATED step-3 TO [{peer}] FROM [{peer}]" in out, out[-5000:]
    assert (tmp_path / "peer/0/.replicas/2-held-by-0/step-3/tierstore.json").exists()
    assert (tmp_path / "peer/1/.replicas/0-held-by-2/step-3/tierstore.json").exists()
    # A replica keeps its save's commit time, as a drained copy does: received later (a slow or
    # resumed replication) it must not make an older save look newer than one committed since
    # (latest() and keep order saves by it; a restarted job then re-saved an existing id).
    replica = json.loads((tmp_path / "peer/0/.replicas/2-held-by-0/step-3/tierstore.json")
                         .read_text())
    source = json.loads((tmp_path / "ram/1/step-3/tierstore.json").read_text())
    assert (replica["committed"], replica["created"]) == \
        (source["committed"], source["created"]), (replica, source)
    # keep = 1: step-3's replicas were received into the files of step-1's, which keep
    # dropped (recycled pages); the store's close freed what was left in the bins.
    for rank in range(4):
        assert re.search(rf"RANK {rank} RECYCLED ([1-9]\d*) OF \1\b", out), out[-5000:]
    assert not (tmp_path / "peer/0/.replicas/2-held-by-0/step-1").exists()
    assert not list(tmp_path.glob("peer/*/.replicas/*/.recycle/*/*"))
    assert not list(tmp_path.glob("peer/*/.recycle/*/*"))

    # Node 1 is replaced: nothing of its RAM or peer tier is left.
    shutil.rmtree(tmp_path / "ram/1")
    shutil.rmtree(tmp_path / "peer/1")
    out = run(root, strategy, "obj", "load", "step-3")
    for rank in range(4):
        assert f"RANK {rank} LATEST step-3" in out
    # What every rank gathers from every rank as a load starts: the entries of a node's files
    # come from the lowest of its ranks only (rank 0); rank 1 names the same files.
    served = {int(r): (int(n), int(e)) for r, n, e in
              re.findall(r"RANK (\d) SERVES (\d+) FILES WITH (\d+) ENTRIES", out)}
    assert served[0][0] == served[0][1] > 0 and served[1] == (served[0][0], 0), served
    # Ranks 2 and 3 got their own shards from their peers on node 0 (either rank there serves
    # both: each reads the replica sets its node's other rank keeps), and nobody read the
    # object store.
    assert re.search(r"RANK 2 FETCHED __2_0.distcp FROM RANK [01]\b", out), out[-8000:]
    assert re.search(r"RANK 3 FETCHED __3_0.distcp FROM RANK [01]\b", out), out[-8000:]
    assert "FROM objects" not in out, out[-8000:]
    assert "RANK 0 READ __0_0.distcp FROM ram" in out
    # Loaded again through a planner whose global plans drop what the reader carried in them:
    # the ranks ask each other themselves, and the same files come from the same node.
    assert re.search(r"RANK 2 REPLANNED FETCHED __2_0.distcp FROM RANK [01]\b", out), out[-8000:]
    if strategy == "clique":
        # Rank 0 keeps rank 2's replicas; rank 1, on the same node, reads from them what its
        # plan needs of rank 2's file instead of asking rank 0 for it over the network.
        assert "RANK 1 READ __2_0.distcp FROM peer:rank-2" in out, out[-8000:]
        assert "RANK 1 FETCHED" not in out, out[-8000:]

    if strategy == "ring":
        return  # the fallback below does not depend on the strategy; clique covers it

    # Both copies of rank 2's files gone (node 1 and the replica on node 0), and no
    # object-store tier: the load names the rank whose files are nowhere. (With one, only
    # those files come from it: tests/test_reshard.py.)
    for held in (tmp_path / "peer/0/.replicas").glob("2-held-by-*"):
        shutil.rmtree(held / "step-3")
    out = run(root, strategy, "noobj", "load-missing", "step-3")
    for rank in range(4):
        assert f"RANK {rank} NOTFOUND" in out, out[-8000:]
    assert "the files of rank(s) [2] are on no tier of any rank" in out


@pytest.mark.timeout(600)
def test_signed_replicas_and_peer_fetches_check_keyed_digests(tmp_path, monkeypatch):
    """With a signing key, replicas are received and committed with keyed digests and a MAC,
    and a lost node's shards come back from its peers checked against them. Each node's
    recycle bin was made a link to a directory outside the tier beforehand (another user's
    doing): opening the store, saving, evicting and replicating delete and write nothing
    there."""
    monkeypatch.setenv("TIERSTORE_TEST_KEY", "5d41402abc4b2a76b9719d911017c592")
    outside = tmp_path / "outside"
    for sub in ("ckpt-a", "ckpt-b"):
        (outside / sub).mkdir(parents=True)
        (outside / sub / "weights.bin").write_bytes(bytes(range(256)) * 16)
    for node in (0, 1):
        (tmp_path / f"peer/{node}").mkdir(parents=True)
        (tmp_path / f"peer/{node}/.recycle").symlink_to(outside, target_is_directory=True)
    before = _tree(outside)
    root = str(tmp_path)
    run(root, "clique", "obj-signed", "save")
    assert _tree(outside) == before
    for replica in tmp_path.glob("peer/*/.replicas/*/step-3/tierstore.json"):
        data = json.loads(replica.read_text())
        assert data["seal"].startswith("blake3_mac:") and data["signed_by"], replica
        assert all(e["checksum"].startswith("blake3k_") for e in data["files"].values())
    shutil.rmtree(tmp_path / "ram/1")
    shutil.rmtree(tmp_path / "peer/1")
    out = run(root, "clique", "obj-signed", "load", "step-3")
    assert re.search(r"RANK 2 FETCHED __2_0.distcp FROM RANK [01]\b", out), out[-8000:]
    assert "FROM objects" not in out, out[-8000:]


def _tree(top):
    """Every entry below ``top``: its kind, size, bytes and modification time."""
    return {str(p.relative_to(top)): (p.is_dir(), p.lstat().st_size, p.lstat().st_mtime_ns,
                                      None if p.is_dir() else p.read_bytes())
            for p in sorted(top.rglob("*"))}


def test_a_world_size_the_strategy_cannot_serve_opens_and_saves_unreplicated(tmp_path, caplog):
    # A job back on one node (here: one process) with a strategy that needs 4 ranks: the open
    # warns that new saves are not replicated, and everything else works.
    config = {"tier": [{"name": "peer", "backend": "peer", "path": str(tmp_path / "peer"),
                        "replication": {"strategy": "clique", "factor": 2, "jump": 2}}]}
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 7}
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        with tierstore.open(config) as store:
            dcp.save(state, storage_writer=store.writer(), checkpoint_id="step-7")
            assert store.latest() == "step-7"
            dest = {"w": torch.zeros(1000), "step": 0}
            dcp.load(dest, storage_reader=store.reader(), checkpoint_id="step-7")
    assert torch.equal(dest["w"], state["w"]) and dest["step"] == 7
    message = "\n".join(r.getMessage() for r in caplog.records)
    assert "tier 'peer'" in message and "multiple of 4 (4, 8, 12" in message, message
    assert "this job has 1 ranks" in message, message
    assert "New saves are not replicated until the job has a world size" in message, message
    assert not (tmp_path / "peer/.replicas").exists()


def test_replication_table_errors_name_the_strategies(tmp_path):
    config = {"tier": [{"name": "peer", "backend": "peer", "path": str(tmp_path / "peer"),
                        "replication": {"strategy": "cliq"}}]}
    with pytest.raises(tierstore.ConfigError, match="clique, erasure, ring"):
        tierstore.open(config)
    config["tier"][0]["replication"] = {"strategy": "ring", "ofset": 1}
    with pytest.raises(tierstore.ConfigError, match="Did you mean 'offset'"):
        tierstore.open(config)


def test_replica_sets_found_are_directories_named_as_replicas_and_never_through_a_link(tmp_path):
    from tierstore_plugins.peer import PeerBackend

    root = tmp_path / "peer"
    for name in ("2-held-by-0", "13-held-by-1", "02-held-by-0", "x-held-by-1", "3-held-by-"):
        (root / ".replicas" / name).mkdir(parents=True)
    (root / ".replicas" / "4-held-by-0").write_text("a file, not a replica set")
    (tmp_path / "elsewhere").mkdir()
    (root / ".replicas" / "5-held-by-0").symlink_to(tmp_path / "elsewhere")
    replication = {"strategy": "clique"}
    assert PeerBackend(str(root), replication=replication).replica_sets() == [(2, 0), (13, 1)]

    # A .replicas that is a link: another user's directory is not served from.
    other = tmp_path / "other"
    (other / "7-held-by-0").mkdir(parents=True)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / ".replicas").symlink_to(other)
    assert PeerBackend(str(linked), replication=replication).replica_sets() == []
    assert PeerBackend(str(tmp_path / "empty"), replication=replication).replica_sets() == []
