"""Restore at another world size from the fast tiers: a checkpoint saved by 2 simulated nodes x 2
ranks (FSDP2 model and Adam state, a DDP-style replicated tensor, an unevenly sharded DTensor,
non-tensor values) in node-local RAM with peer replicas, loaded bit for bit by jobs of other
shapes, one after the other on the same tiers (as a job that comes back in another shape does):
2 x 1, 2 x 3, 3 x 2 (node 2 new and empty: its ranks get everything from peers; then again with a
rank dying as the peers send), then 1 x 2 after node 1 is lost. With a shared tier configured
too, a load reads from it only what no node holds. ``tierstore plan`` says beforehand where the
bytes will come from (and what the load then read from is what it said).
(tests/scripts/reshard_worker.py compares every tensor's full value with the saved one.)"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from helpers import run_torchrun

from tierstore.cli import main as tierstore_cli

#: the store's collective timeout in the worker's "load-then-kill" phase
KILL_TIMEOUT_S = 6
#: the sources of a load that are fast tiers: a node's RAM, replicas it holds, other ranks
FAST = re.compile(r"ram|peer:rank-\d+|\(peers\)")


def _sources(out: str) -> dict[int, dict[str, int]]:
    """Per rank, the bytes it loaded per source (its ``loaded`` event's ``bytes_from``)."""
    found = {}
    for rank, pairs in re.findall(r"^RANK (\d+) BYTES (.*)$", out, re.M):
        found[int(rank)] = {k: int(v) for k, v in (p.split("=") for p in pairs.split())}
    return found


def _plan(tmp_path, capsys, world: int, per_node: int, shared: bool = False) -> tuple[int, dict]:
    """``tierstore plan --json`` of step-2 at that shape, for the worker's tiers: (exit
    status, document)."""
    config = tmp_path / "tiers.toml"
    config.write_text(
        f'[[tier]]\nname = "ram"\nbackend = "memory"\npath = "{tmp_path}/ram/{{node}}"\n'
        f'[[tier]]\nname = "peer"\nbackend = "peer"\npath = "{tmp_path}/peer/{{node}}"\n'
        f'replication = {{ strategy = "clique", factor = 2, jump = 2 }}\n'
        + (f'[[tier]]\nname = "objects"\nbackend = "fsspec"\n'
           f'url = "file://{tmp_path}/objects"\n' if shared else ""))
    capsys.readouterr()
    code = tierstore_cli(["plan", str(config), "step-2", "--world-size", str(world),
                          "--ranks-per-node", str(per_node), "--json"])
    return code, json.loads(capsys.readouterr().out)


def _load(root, nnodes: int, nproc: int, *extra: str) -> dict[int, dict[str, int]]:
    out = run_torchrun("reshard_worker.py", root, "load", *extra, nproc=nproc, nnodes=nnodes,
                       timeout=240)
    sources = _sources(out)
    assert sorted(sources) == list(range(nnodes * nproc)), out[-6000:]
    # Each rank's restore_planned event said, before reading, what it then read from.
    planned = {int(r): (said, int(slow)) for r, said, slow in
               re.findall(r"^RANK (\d+) PLANNED (.*) SLOW (\d+)$", out, re.M)}
    for rank, got in sources.items():
        said = " ".join(f"{k}={v}" for k, v in sorted(got.items()))
        slow = sum(v for k, v in got.items() if not FAST.fullmatch(k))
        assert planned.get(rank) == (said, slow), (rank, planned, got)
    return sources


@pytest.mark.timeout(900)
def test_a_2x2_checkpoint_restores_bitwise_at_other_shapes_from_ram_and_replicas(tmp_path,
                                                                                  capsys):
    root = str(tmp_path)
    # Saved with the object-store tier too; the loads below leave it out of their config until
    # the last one, so they show that the fast tiers alone restore.
    run_torchrun("reshard_worker.py", root, "save", "shared", nproc=2, nnodes=2, timeout=240)
    # Before any restart, the plan of each shape: every byte from the nodes' RAM.
    for world, per_node in ((4, 2), (2, 1), (6, 3), (6, 2)):
        code, plan = _plan(tmp_path, capsys, world, per_node)
        assert code == 0 and plan["missing"] == [], plan
        assert [s["tier"] for s in plan["sources"]] == ["ram"], plan
        assert plan["from_slow_tiers_bytes"] == 0 and plan["saved_world_size"] == 4, plan

    for nnodes, nproc in ((2, 1), (2, 3)):
        sources = _load(root, nnodes, nproc)
        # Every node holds its own ranks' files and replicas of the other node's: nothing
        # moves between nodes.
        for rank, got in sources.items():
            assert got and all(FAST.fullmatch(k) for k in got), (nnodes, nproc, rank, got)
            assert "(peers)" not in got, (nnodes, nproc, rank, got)

    # Node 2 is a new machine: its ranks 4 and 5 hold nothing. Then the same job loads again,
    # and rank 1 dies as the peers begin sending: nobody waits for it. Every other rank's load
    # fails within the collective timeout (plus, where a collective of the store's failed, the
    # roll call naming the lost rank: at most one timeout more), and ranks 4 and 5, which were
    # to get files from it, log that rank 1 did not answer (DCP's own collective fails next,
    # and its error is the one dcp.load raises).
    out = run_torchrun("reshard_worker.py", root, "load-then-kill", nproc=2, nnodes=3,
                       timeout=240)
    sources = _sources(out)
    assert sorted(sources) == list(range(6)), out[-6000:]
    for rank in (4, 5):
        assert set(sources[rank]) == {"(peers)"}, sources
        # Peers sent the blocks of the files that hold the rows it loads, not whole files.
        fetched = [tuple(map(int, m)) for m in re.findall(
            rf"^RANK {rank} FETCHED \S+ FROM RANK \d+ BYTES (\d+) OF (\d+)$", out, re.M)]
        assert fetched and any(n < size for n, size in fetched), (rank, fetched)
        assert sources[rank]["(peers)"] == sum(n for n, _ in fetched), (rank, fetched)
    assert all("(peers)" not in sources[r] for r in range(4)), sources
    for rank in (0, 2, 3, 4, 5):
        assert re.search(rf"^RANK {rank} RAISED ", out, re.M), out[-6000:]
        after = float(re.search(rf"^RANK {rank} AFTER ([\d.]+)$", out, re.M)[1])
        # One timeout in the load's closing agreement (every rank learns the load's outcome
        # before any keeps what it read), the roll call that names the lost rank at most one
        # more, and the load's own work before it.
        assert after < 2 * KILL_TIMEOUT_S + 3, (rank, after, out[-6000:])
    for rank in (4, 5):
        assert re.search(rf"^RANK {rank} LOGGED .*the files peers were to send did not arrive"
                         rf".*rank\(s\) \[1\] did not answer", out, re.M), out[-6000:]
    assert not re.search(r"^RANK 1 (RAISED|AFTER|LOGGED)", out, re.M), out[-6000:]

    # Node 1 is lost (its RAM and replicas with it) and the job comes back on node 0 alone:
    # node 0's RAM and the replicas it holds of node 1's ranks are the whole checkpoint. The
    # peer tier opens although its strategy cannot place copies for 2 ranks.
    for name in ("ram", "peer"):
        for node in (1, 2):
            shutil.rmtree(tmp_path / name / str(node), ignore_errors=True)
    code, plan = _plan(tmp_path, capsys, 2, 2)
    assert code == 0 and plan["from_slow_tiers_bytes"] == 0, plan
    planned = {s["tier"] for s in plan["sources"]}
    assert planned == {"ram", "peer:rank-2", "peer:rank-3"}, plan
    sources = _load(root, 1, 2)
    for rank, got in sources.items():
        assert {"peer:rank-2", "peer:rank-3"} <= set(got), (rank, got)
        assert all(FAST.fullmatch(k) for k in got) and "(peers)" not in got, (rank, got)
    # What the load read from is what the plan said.
    assert set().union(*sources.values()) == planned, (sources, plan)

    # Node 0's replica of rank 2's files is gone too: without the object-store tier, the plan
    # says the restore would fail, and why; with it, only those files come from there.
    shutil.rmtree(tmp_path / "peer/0/.replicas/2-held-by-0")
    code, plan = _plan(tmp_path, capsys, 2, 2)
    assert code == 1 and plan["missing"] == ["(the files of rank 2)"], plan
    lost_file = (tmp_path / "objects/step-2/__2_0.distcp").stat().st_size
    code, plan = _plan(tmp_path, capsys, 2, 2, shared=True)
    assert code == 0 and plan["from_slow_tiers_bytes"] == lost_file, plan
    assert {"tier": "objects", "bytes": lost_file} in plan["sources"], plan
    sources = _load(root, 1, 2, "shared")
    for rank, got in sources.items():
        assert 0 < got.get("objects", 0) <= lost_file, (rank, got, lost_file)
        assert got.get("peer:rank-3"), (rank, got)
    # Rank 0 needs none of the wide tensor's rows in that file (rank 1 needs them all): it
    # reads only the blocks holding the items it loads.
    assert sources[0]["objects"] < sources[1]["objects"], sources
