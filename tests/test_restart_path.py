"""What a restart costs with an object store behind node-local tiers: 2 simulated nodes x 2
ranks, a node-local RAM tier and an S3 tier (SeaweedFS) every rank shares.

The S3 tier is one location for the whole job, so one rank checks it at open and lists it for
``latest()``; a load reads its manifest only where the nodes' copies do not cover the
checkpoint. The other ranks never make an S3 client on a restart whose checkpoint the nodes
hold, and still load from S3 when the nodes lost it. A location that cannot be used fails the
open on every rank with the same error (no rank left waiting for the others).
"""

import json
import re
import shutil

import pytest

from helpers import run_torchrun
from tierstore.events import FROM_PEERS

WORKER = "restart_path_worker.py"


def run_nodes(root, url: str, options: dict, phase: str, expect_ok: bool = True) -> str:
    return run_torchrun(WORKER, str(root), url, json.dumps(options), phase, nnodes=2,
                        timeout=180, expect_ok=expect_ok)


def per_rank(out: str, what: str) -> dict[int, str]:
    return {int(r): rest.strip() for r, rest in re.findall(rf"^RANK (\d+) {what}(.*)$", out,
                                                          re.M)}


@pytest.mark.timeout(600)
def test_a_restart_makes_one_s3_client_while_the_nodes_hold_the_checkpoint_and_all_when_not(
        tmp_path, seaweed, s3_bucket):
    options = seaweed.storage_options()
    url = f"{s3_bucket}/ckpt"
    run_nodes(tmp_path, url, options, "save")

    out = run_nodes(tmp_path, url, options, "restart")
    clients = per_rank(out, "S3CLIENT")
    # Rank 0 leads the S3 tier's single location: it checks it at open and lists it.
    assert clients.get(0, "").split()[:1] == ["True"], out
    # The others: no S3 client after open, latest() or the load (which read RAM only).
    assert {r: clients.get(r) for r in (1, 2, 3)} == {r: "False False False" for r in (1, 2, 3)}, out
    # From their node's RAM, and the file of the replicated items (DCP writes them once, in
    # one rank's file) from the other node: never from S3.
    reads = per_rank(out, "READ")
    assert len(reads) == 4 and all(set(v.split()) <= {"ram", FROM_PEERS} for v in reads.values()), out

    # A damaged copy on node 1 (one flipped byte in rank 2's file, a single copy: no peer
    # tier): the ranks that need that file (rank 2, and those that read the replicated items
    # DCP wrote into it) read it from S3 instead, and the load is bitwise.
    damaged = tmp_path / "ram" / "1" / "step-1" / "__2_0.distcp"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    out = run_nodes(tmp_path, url, options, "restart")
    reads = per_rank(out, "READ")
    assert len(reads) == 4 and "s3" in reads[2].split(), out

    # Both nodes lost their RAM: latest() still finds step-1 (rank 0 lists S3) and every rank
    # loads it from S3, bitwise.
    shutil.rmtree(tmp_path / "ram")
    out = run_nodes(tmp_path, url, options, "restart")
    assert per_rank(out, "READ") == {r: "s3" for r in range(4)}, out


@pytest.mark.timeout(300)
def test_an_unusable_directory_on_one_node_fails_the_open_on_every_rank(tmp_path, seaweed,
                                                                       s3_bucket):
    (tmp_path / "ram").mkdir()
    (tmp_path / "ram" / "1").write_text("a file where node 1's RAM directory should be")
    out = run_nodes(tmp_path, f"{s3_bucket}/ckpt", seaweed.storage_options(), "bad-path")
    errors = per_rank(out, "CONFIGERROR")
    assert sorted(errors) == [0, 1, 2, 3], out
    # The same message everywhere, naming the tier and node 1's path.
    assert len(set(errors.values())) == 1, out
    message = errors[0]
    assert "tier 'ram'" in message and str(tmp_path / "ram" / "1") in message, message
