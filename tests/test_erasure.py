"""Parity instead of replicas (``erasure`` strategy on a ``peer`` tier), under torchrun on
simulated nodes (one torchrun per node, ``{node}`` in the tier paths, gloo): each set of
``data + 1`` ranks on different nodes keeps XOR parity of its members' files, 1/data of a
checkpoint per rank; after a node is lost (its directories deleted) every rank loads bitwise
from the fast tiers, the lost ranks' files rebuilt from their sets. Two lost nodes of one set
cannot be rebuilt: the load names what is missing (the lost ranks only, even when .metadata
went with them), or reads it from a shared tier. A load that fails on one member (a flipped
byte) fails on every rank and leaves every rank's state as it was. A job killed
while encoding leaves the previous save's parity whole, and the half-encoded save is never
decoded. Plus the strategy's placement, config errors and the set's layout, in one process."""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest
import torch
from helpers import SCRIPTS, run_torchrun

from tierstore.format.manifest import FileEntry
from tierstore.format.parity import common_length
from tierstore_conformance import ParityStrategyTests
from tierstore_plugins.replication import ErasureStrategy

import tierstore
from tierstore.tiers.parity_sets import ParitySet, read_members

sys.path.insert(0, str(SCRIPTS))
from faults_node_worker import check_parity  # noqa: E402  (the fault matrix's decoder)


def run(root, data: int, nodes: int, per_node: int, *args, killed: bool = False) -> str:
    return run_torchrun("erasure_worker.py", root, data, *args, nproc=per_node, nnodes=nodes,
                        timeout=240, killed=killed)


def lose_node(root, node: int) -> None:
    """The node is replaced: nothing of its RAM or peer tier is left."""
    shutil.rmtree(root / f"ram/{node}")
    shutil.rmtree(root / f"peer/{node}")


def checkpoint_bytes(path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.name.endswith(".distcp")
               or p.name == ".metadata")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("nodes,per_node,data,lost", [(4, 1, 3, 2), (4, 2, 3, 3), (3, 1, 2, 0)],
                         ids=["3+1-4x1-node2", "3+1-4x2-node3", "2+1-3x1-node0"])
def test_a_lost_node_is_rebuilt_from_its_sets_parity(tmp_path, nodes, per_node, data, lost):
    # One launch: save step-1..3, close, delete node LOST's directories, open again, plan,
    # load step-3 bitwise (the worker's check) with no shared tier configured.
    out = run(tmp_path, data, nodes, per_node, "noobj", "save-lose-load", lost)
    world = nodes * per_node
    for rank in range(world):
        members = list(range(rank % per_node, world, per_node))
        assert f"RANK {rank} PROTECTED step-3 SET {members}" in out, out[-5000:]
    # Each rank keeps 1/data of a checkpoint of parity, and no replicas (the surviving nodes;
    # the replaced node holds what was rebuilt).
    for node in set(range(nodes)) - {lost}:
        peer = tmp_path / f"peer/{node}"
        assert not (peer / ".replicas").exists()
        own = checkpoint_bytes(peer / "step-3")
        parity = sum((peer / f".parity/held-by-{r}/step-3/parity").stat().st_size
                     for r in range(node * per_node, (node + 1) * per_node))
        assert parity <= own / data + 8 * per_node * data + 4096, (parity, own)
        assert not (peer / f".parity/held-by-{node * per_node}/step-1").exists()  # keep = 2
    # Decoded in one process by the fault matrix's reference decoder (packed streams and
    # tierstore.format.parity): the lost members, from what the survivors hold, give the bytes
    # each header records.
    assert check_parity(str(tmp_path)) == []
    # store.plan (`tierstore plan`) said before the load that the lost ranks' files come back
    # from parity, on their node of the new job, and nothing from a slower tier.
    planned = json.loads(re.search(r"^PLAN (.*)$", out, re.M)[1])
    assert planned["missing"] == [] and planned["from_slow_tiers_bytes"] == 0, planned
    rebuilt = {f["name"] for f in planned["files"] if f["tier"] == "peer:rebuilt-from-parity"}
    assert rebuilt >= {f"__{r}_0.distcp" for r in range(lost * per_node, (lost + 1) * per_node)}
    assert all(f["node"] == lost for f in planned["files"] if f["name"] in rebuilt), planned
    for rank in range(world):
        assert f"RANK {rank} LATEST step-3" in out, out[-5000:]
    for rank in range(lost * per_node, (lost + 1) * per_node):
        rebuilt = tmp_path / f"peer/{lost}/.replicas/{rank}-held-by-{rank}/step-3"
        manifest = json.loads((rebuilt / "tierstore.json").read_text())
        assert manifest["ranks"] == [rank] and manifest["plugins"]["replication"] == \
            "rebuilt from parity"
        assert f"RANK {rank} READ __{rank}_0.distcp FROM peer:rank-{rank}" in out, out[-8000:]
        assert re.search(rf"RANK {rank} REBUILT step-3 INTO peer:rank-{rank} FILES \[.*"
                         rf"'__{rank}_0.distcp'", out), out[-8000:]
    assert len(re.findall(r"REBUILT", out)) == per_node, out[-8000:]  # the lost ranks only
    if lost == 0:  # the coordinator's .metadata came back with its files
        assert (tmp_path / "peer/0/.replicas/0-held-by-0/step-3/.metadata").exists()


@pytest.mark.timeout(900)
def test_two_lost_nodes_of_a_set_are_named_or_read_from_a_shared_tier(tmp_path):
    run(tmp_path, 3, 4, 1, "obj", "save")
    # One flipped bit of one member's parity: the reference decoder notices it, and so does
    # store.verify_parity (on that member only), which repairs it from the members' files.
    parity = tmp_path / "peer/3/.parity/held-by-3/step-3/parity"
    kept = parity.read_bytes()
    parity.write_bytes(kept[:100] + bytes([kept[100] ^ 1]) + kept[101:])
    assert any("decodes rank 0's __0_0.distcp to wrong bytes" in p
               for p in check_parity(str(tmp_path)))
    out = run(tmp_path, 3, 4, 1, "obj", "verify-parity", "step-3")
    assert "RANK 3 VERIFY mismatch (0, 1, 2, 3) its parity chunk" in out, out[-5000:]
    assert all(f"RANK {r} VERIFY ok (0, 1, 2, 3)" in out for r in range(3)), out[-5000:]
    assert "RANK 3 REPAIR repaired" in out, out[-5000:]
    assert all(f"RANK {r} REPAIR ok" in out for r in range(3)), out[-5000:]
    assert parity.read_bytes() == kept and check_parity(str(tmp_path)) == []
    # A members.json changed after its save (still a set, not the one its manifest seals) is
    # never re-encoded nor repaired from: every member of the set leaves it unchecked.
    assert "RANK 3 TAMPERED unchecked (0, 1, 2, 3) the files of rank(s) [3] are not all " \
           "here with the digests of their save (members.json" in out, out[-5000:]
    assert all(f"RANK {r} TAMPERED unchecked (0, 1, 2, 3) the files of rank(s) [3]" in out
               for r in range(3)), out[-5000:]
    assert parity.read_bytes() == kept
    # A parity chunk that does not match its digest is never decoded: with node 1 lost and
    # rank 3's chunk flipped, rank 1's files are missing, not rebuilt wrong.
    parity.write_bytes(kept[:100] + bytes([kept[100] ^ 1]) + kept[101:])
    lose_node(tmp_path, 1)
    out = run(tmp_path, 3, 4, 1, "noobj", "load-missing", "step-3")
    assert "RANK 1 NOTFOUND checkpoint 'step-3' cannot be loaded by this job: the files of " \
           "rank(s) [1] are on no tier" in out, out[-5000:]
    assert not (tmp_path / "peer/1/.replicas").exists()
    parity.write_bytes(kept)
    # A survivor that fails inside the rebuild (its set's description unreadable) says so to
    # its set, which gives up the rebuild on every rank alike (before, the others waited for
    # it until the collective timeout): rank 1's files are missing, on every rank.
    out = run(tmp_path, 3, 4, 1, "noobj", "load-survivor-fails", "step-3")
    for rank in range(4):
        assert f"RANK {rank} NOTFOUND checkpoint 'step-3' cannot be loaded by this job: the " \
               f"files of rank(s) [1] are on no tier" in out, out[-5000:]
    assert not (tmp_path / "peer/1/.replicas/1-held-by-1/step-3").exists()
    lose_node(tmp_path, 2)
    # Without the shared tier, every rank names the two ranks; with it configured, their files
    # come from it.
    out = run(tmp_path, 3, 4, 1, "noobj", "missing-then-shared", "step-3")
    for rank in range(4):
        assert re.search(rf"RANK {rank} NOTFOUND checkpoint 'step-3' cannot be loaded by this "
                         rf"job: the files of rank\(s\) \[1, 2\] are on no tier", out), out[-5000:]
    assert not (tmp_path / "peer/1/.replicas").exists()  # nothing half rebuilt
    assert "RANK 1 READ __1_0.distcp FROM objects" in out, out[-8000:]
    assert "RANK 0 READ __0_0.distcp FROM ram" in out, out[-8000:]


@pytest.mark.timeout(900)
def test_a_job_killed_while_encoding_leaves_the_previous_parity_whole(tmp_path):
    out = run(tmp_path, 3, 4, 1, "noobj", "save-killed", killed=True)
    assert "RANK 1 KILLED PUBLISHING ITS PARITY" in out, out[-5000:]
    assert "RANK 0 KILLED WITH ITS PARITY COMMITTED" in out, out[-5000:]
    # A mix: ranks 0 and 3 hold step-3's parity, ranks 1 and 2 do not.
    held = {r: (tmp_path / f"peer/{r}/.parity/held-by-{r}/step-3/tierstore.json").exists()
            for r in range(4)}
    assert held == {0: True, 1: False, 2: False, 3: True}, held
    lose_node(tmp_path, 2)
    # step-3 cannot be rebuilt (rank 1 has no parity of it): the newest loadable checkpoint is
    # step-2, rebuilt from its complete parity, bitwise.
    out = run(tmp_path, 3, 4, 1, "noobj", "load", "step-2", "step-3")
    assert "RANK 2 READ __2_0.distcp FROM peer:rank-2" in out, out[-8000:]
    assert "RANK 0 NOTFOUND checkpoint 'step-3' cannot be loaded by this job: the files of " \
           "rank(s) [2]" in out, out[-5000:]


@pytest.mark.timeout(900)
def test_a_load_that_fails_on_one_member_leaves_every_rank_as_it_was_and_names_what_is_gone(
        tmp_path):
    # One launch: save step-1, lose node 2, flip a byte of rank 1's data file on both of its
    # tiers where only rank 1's load and not rank 2's rebuild reads (the rebuild succeeds),
    # load; then lose node 0 too and load again.
    out = run(tmp_path, 3, 4, 1, "noobj", "flipped-survivor")
    bad = re.search(r"^FLIPPED FILE (\S+)$", out, re.M)[1]
    assert re.fullmatch(r"__1_\d+\.distcp", bad), out[-5000:]  # None: no byte fits
    # Rank 2's files came back from parity, so every rank read: rank 1 found no good copy of
    # its file, and the others, whose reads were good, left their state as it was too (the
    # worker compares it bitwise), each saying why.
    assert re.search(r"RANK 2 REBUILT step-1 INTO peer:rank-2 FILES", out), out[-8000:]
    assert f"RANK 1 FLIPPED IntegrityError: checkpoint 'step-1': no tier has a good copy of " \
           f"{bad}" in out, out[-8000:]
    for rank in (0, 2, 3):
        line = next(s for s in out.splitlines() if s.startswith(f"RANK {rank} FLIPPED "))
        assert line.startswith(f"RANK {rank} FLIPPED IntegrityError: checkpoint 'step-1': the "
                               f"load failed on rank(s) [1]") and bad in line, line
    # Node 0 lost as well, with node 2's parity gone: rank 0's files (.metadata among them)
    # are nowhere; every rank names rank 0 only (before: every rank of the save).
    for rank in range(4):
        line = next(s for s in out.splitlines() if s.startswith(f"RANK {rank} NOTFOUND "))
        assert "the files of rank(s) [0] are on no tier of any rank" in line, line
        assert "no rank has a good copy of .metadata" in line, line


# -- one process ------------------------------------------------------------------------------

class TestErasureStrategy(ParityStrategyTests):
    """The kit's checks, a parity strategy's included: every rank in exactly one set, its
    members on different nodes (``jump`` apart), any one lost member decoded bitwise."""

    @pytest.fixture
    def strategy(self):
        return ErasureStrategy(data=3, parity=1, jump=2)

    @pytest.fixture
    def world_sizes(self):
        return [8, 16, 24]

    @pytest.fixture
    def bad_world_sizes(self):
        return [1, 2, 4, 6, 12]

    @pytest.fixture
    def ranks_per_node(self):
        return 2


def test_a_config_with_parity_above_one_or_a_world_size_that_fits_no_set_is_refused(tmp_path):
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.open({"tier": [{"name": "peer", "backend": "peer", "path": str(tmp_path),
                                  "replication": {"strategy": "erasure", "data": 4,
                                                  "parity": 2}}]})
    assert "parity" in str(info.value) and "Reed-Solomon" in str(info.value), info.value
    assert "clique replication with factor = 3" in str(info.value), info.value
    problem = ErasureStrategy(data=3, jump=2).check_world_size(12)
    assert "multiple of 8 (8, 16, 24, ...); this job has 12 ranks" in problem, problem


def _entry(size: int) -> FileEntry:
    return FileEntry(size, "xxh3_128:0")


def test_every_byte_of_every_member_is_in_exactly_one_other_members_parity():
    headers = {r: {"files": {f"__{r}_{i}.distcp": _entry(size)
                             for i, size in enumerate(sizes)}}
               for r, sizes in {0: [100, 7], 2: [1000], 4: [3, 5, 999], 6: []}.items()}
    found = ParitySet.of([0, 2, 4, 6], headers)
    assert found.chunk * 3 == common_length([107, 1000, 1007, 0], 4)
    for member in found.ranks:
        seen = torch.zeros(found.chunk * 3, dtype=torch.int64)
        at = {}
        pos = 0
        for rel, entry in found.files(member):
            at[rel] = pos
            pos += entry.size
        for holder in found.ranks:
            if holder == member:
                continue
            for rel, offset, size, in_chunk in found.pieces(member, holder):
                assert 0 <= in_chunk and in_chunk + size <= found.chunk
                seen[at[rel] + offset:at[rel] + offset + size] += 1
        assert seen[:pos].eq(1).all() and seen[pos:].eq(0).all(), member
    assert read_members(found.to_json()) == found


def test_a_members_description_that_is_not_one_is_refused():
    with pytest.raises(tierstore.IntegrityError, match="members.json is not a parity set"):
        read_members(b'{"format": 1, "ranks": [0], "chunk": 8, "headers": {}}')
    with pytest.raises(tierstore.IntegrityError, match="chunk length does not match"):
        found = ParitySet.of([0, 1], {0: {"files": {"a": _entry(16)}}, 1: {"files": {}}})
        doc = json.loads(found.to_json())
        doc["chunk"] = 4
        read_members(json.dumps(doc).encode())
