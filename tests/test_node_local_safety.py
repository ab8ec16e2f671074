"""Node-local tiers when a save or a drain goes wrong part-way: 2 simulated nodes x 2 ranks
(tests/scripts/node_safety_worker.py), a RAM tier per node with ``keep = 1``.

What a user checks afterwards: the previous checkpoint still loads bitwise from the RAM tier
after the coordinator died in ``finish``; the id can be saved again; two saves of one id are
never mixed in a load; a shared copy gathered from the nodes is never committed with a part
that failed its check; and no node's drain starts writing the shared copy before the node that
commits it has prepared it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import free_port, run_torchrun, script_env, torchrun_command

WORKER = "node_safety_worker.py"


def run_nodes(root, action: str) -> str:
    """The worker on 2 simulated nodes x 2 ranks; every rank must end OK."""
    return run_torchrun(WORKER, str(root), action, nnodes=2, timeout=150)


def run_nodes_failing(root, action: str, timeout: float = 150) -> str:
    """The worker on 2 nodes where a rank dies: the nodes' stdout, whatever their exit
    statuses (a node that does not end in time fails the test: a hang)."""
    port = free_port()
    procs = [subprocess.Popen(torchrun_command(WORKER, str(root), action, nproc=2, nnodes=2,
                                               node_rank=node, port=port),
                              env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for node in range(2)]
    outs = []
    try:
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the job ({action}) did not end in {timeout} s")
            outs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return "\n".join(outs)


#: The actions whose job ends normally, run in one launch (tests/scripts/node_safety_worker.py
#: runs them one after the other, each in a directory and with a store of its own).
SHARED_LAUNCH = ("stale", "corrupt", "order", "torn", "overwrite", "damage")


@pytest.fixture(scope="module")
def shared_launch(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """For each action of :data:`SHARED_LAUNCH`: its root and the lines it printed (untagged),
    from one launch of the worker on 2 nodes x 2 ranks (every rank must end OK)."""
    root = tmp_path_factory.mktemp("node-safety")
    out = run_nodes(root, ",".join(SHARED_LAUNCH))
    return {action: (root / action, "\n".join(line[len(action) + 3:]
                                               for line in out.splitlines()
                                               if line.startswith(f"[{action}] ")))
            for action in SHARED_LAUNCH}


def manifest(path) -> dict:
    return json.loads((path / "tierstore.json").read_text())


@pytest.mark.timeout(600)
def test_coordinator_killed_in_finish_leaves_the_previous_checkpoint_loadable(tmp_path):
    run_nodes_failing(tmp_path, "crash")
    ram0, ram1 = tmp_path / "ram/0", tmp_path / "ram/1"
    # Node 1 published its part of step-2 before the coordinator died: with keep = 1 it must
    # still hold its part of step-1, the only checkpoint that exists.
    assert (ram1 / "step-1/tierstore.json").exists()
    assert (ram0 / "step-1/tierstore.json").exists()
    assert not (ram0 / "step-2/tierstore.json").exists()
    orphan_token = manifest(ram1 / "step-2")["save_token"]
    # Node 1 drained its pending part to its disk tier before the coordinator died: the copy
    # there is pending too (a part of a checkpoint that may never exist, not a committed one).
    disk1 = tmp_path / "disk/1"
    assert (disk1 / "step-2/tierstore.json").exists()
    assert (disk1 / "step-2/.tierstore-part-pending").read_text() == orphan_token

    # A fresh job loads step-1 bitwise from RAM, collects the orphan part and saves step-2
    # again (on every rank: no rank refuses the id while the others go on).
    out = run_nodes(tmp_path, "recover")
    for rank in range(4):
        assert f"RANK {rank} LATEST step-1" in out
    assert "RANK 2 COLLECTED ORPHAN step-2" in out
    part0, part1 = manifest(ram0 / "step-2"), manifest(ram1 / "step-2")
    assert part1["save_token"] == part0["save_token"] != orphan_token
    # The orphan on node 1's disk tier was collected, and the new save drained there.
    assert manifest(disk1 / "step-2")["save_token"] == part0["save_token"]


@pytest.mark.timeout(600)
def test_two_saves_of_one_id_are_never_mixed_in_a_load(shared_launch):
    tmp_path, out = shared_launch["stale"]
    # Node 1's part of ck is the second (failed) save's, node 0's the first's.
    part0 = manifest(tmp_path / "ram/0/ck")
    part1 = manifest(tmp_path / "ram/1/ck")
    assert part0["save_token"] != part1["save_token"]
    assert "LOADED MIXED" not in out
    loaded = re.findall(r"RANK \d LOADED (\d)", out)
    failed = re.findall(r"RANK (\d) LOAD FAILED CheckpointNotFound", out)
    # Either every rank loaded the same save, or every rank got the same clear error.
    assert (len(loaded) == 4 and len(set(loaded)) == 1) or sorted(failed) == list("0123"), out
    assert "LATEST ck" not in out, out


@pytest.mark.timeout(600)
def test_a_gathered_drain_never_commits_a_part_that_failed_its_check(shared_launch):
    tmp_path, out = shared_launch["corrupt"]
    errors = dict(re.findall(r"RANK (\d) DRAIN ERROR: (.*)", out))
    assert "__2_0.distcp" in errors.get("2", ""), out  # the node that read the bad copy
    assert "__2_0.distcp" in errors.get("0", ""), out  # the rank that would have committed
    shared = tmp_path / "shared"
    # Nothing of step-1 is left on the shared tier: no manifest, no uploaded object.
    assert not (shared / "step-1").exists() or os.listdir(shared / "step-1") == [], \
        os.listdir(shared / "step-1")


@pytest.mark.timeout(600)
def test_a_node_never_writes_a_gathered_copy_before_the_committing_rank_began_it(
        shared_launch):
    # The committing rank (rank 0) begins 3 s after node 1's leader is ready: beginning on its
    # own, node 1 could find the shared prefix unprepared, like rank 0 a moment later, and each
    # would clear what the other uploaded. Node 1 must wait for rank 0's begin.
    tmp_path, out = shared_launch["order"]
    starts = float(re.search(r"RANK 0 DRAIN STARTS ([\d.]+)", out).group(1))
    first = float(re.search(r"RANK 2 FIRST FILE ([\d.]+)", out).group(1))
    assert first >= starts, out
    for rank in range(4):
        assert f"RANK {rank} DRAINED" in out
    copy = manifest(tmp_path / "shared/step-1")
    assert copy["ranks"] == [0, 1, 2, 3]
    # Only the checkpoint's files (no part reports, no marker) are left in the copy.
    assert sorted(os.listdir(tmp_path / "shared/step-1")) == sorted(
        [*copy["files"], "tierstore.json"])


@pytest.mark.timeout(600)
def test_a_part_report_read_before_it_is_whole_is_waited_for(shared_launch):
    # Rank 0 finds node 1's part report cut short (as when it reads while node 1 writes it):
    # that part is not reported yet, and the copy commits once the whole report is there.
    tmp_path, out = shared_launch["torn"]
    for rank in range(4):
        assert f"RANK {rank} DRAINED" in out, out
    copy = manifest(tmp_path / "shared/step-1")
    assert copy["ranks"] == [0, 1, 2, 3]
    assert sorted(os.listdir(tmp_path / "shared/step-1")) == sorted(
        [*copy["files"], "tierstore.json"])


@pytest.mark.timeout(600)
def test_an_overwrite_reaches_the_shared_tier_from_every_rank_while_the_old_part_is_there(
        shared_launch):
    # Each rank copies its own files of the second save of "ck" while its node's part of the
    # first save may still be in the RAM tier (the leader replaces it a moment later): a rank
    # must copy the new save's files, never refuse or take the old part. The shared tier
    # alone then restores the second save, bitwise, on every rank.
    tmp_path, out = shared_launch["overwrite"]
    for rank in range(4):
        assert f"RANK {rank} OVERWRITTEN" in out, out
    copy = manifest(tmp_path / "shared/ck")
    assert copy["ranks"] == [0, 1, 2, 3]
    assert sorted(os.listdir(tmp_path / "shared/ck")) == sorted(
        [*copy["files"], "tierstore.json"])


@pytest.mark.timeout(600)
def test_an_id_whose_copy_lost_a_file_or_a_node_part_can_be_saved_again(shared_launch):
    # step-2 lost a file of node 0's part; step-3 lost node 1's whole part (a node replaced
    # with its RAM tier empty). Neither loads, so latest() is step-1, and a restarted job that
    # saves step-2 and step-3 again must replace what is left, not stop at "already exists".
    tmp_path, _ = shared_launch["damage"]
    old_token = manifest(tmp_path / "ram/1/step-2")["save_token"]
    out = run_nodes(tmp_path, "resave")
    for rank in range(4):
        assert f"RANK {rank} LATEST step-1" in out, out
        # A whole copy is still refused, on every rank alike, with the documented message.
        assert re.search(rf"RANK {rank} REFUSED checkpoint 'step-1' already exists on tier "
                         r"'ram' \(every node's part\); save under a new id, or set \[store\] "
                         r"overwrite = true", out), out
        assert f"RANK {rank} RESAVED step-2" in out and f"RANK {rank} RESAVED step-3" in out
    for step in ("step-2", "step-3"):
        part0, part1 = (manifest(tmp_path / f"ram/{n}/{step}") for n in (0, 1))
        assert part0["save_token"] == part1["save_token"] != old_token
    # Nothing of the damaged copies is left beside the new ones (no staging or trash entry).
    for node in (0, 1):
        assert sorted(os.listdir(tmp_path / f"ram/{node}")) == ["step-1", "step-2", "step-3"]


@pytest.mark.timeout(600)
def test_back_to_back_saves_keep_every_node_part_on_the_slower_node_local_tier(tmp_path):
    # No fault at all: eight saves back to back over a RAM and a disk tier per node. Each node's
    # part of a save is pending until the next save settles it; the disk copy of node 1's part
    # was once judged by rank 0's disk copy, which its drain had often not committed yet, and
    # collected as an orphan. With the RAM tiers gone, every checkpoint must load from disk.
    out = run_torchrun(WORKER, str(tmp_path), "backtoback", nproc=1, nnodes=2, timeout=300)
    assert "COLLECTED ORPHAN" not in out, out
    for node in (0, 1):
        for step in range(1, 9):
            part = tmp_path / "disk" / str(node) / f"step-{step}"
            assert (part / "tierstore.json").exists(), \
                f"node {node} lost its disk copy of step-{step}"
