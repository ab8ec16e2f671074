"""What a restart asks of a shared object store, counted at the server, at 2 and 4 ranks.

A restart is paid by every rank of a job at once: whatever each rank asks of an object store
there is multiplied by the rank count, and at a thousand ranks S3 answers a storm of LISTs and
GETs with 503 SlowDown. So the count must not grow with the ranks. A node-local RAM tier in
front of an S3 tier (SeaweedFS, which counts the requests it answers), one node of 2 and of 4
ranks, and 2 nodes of 2 (where a load consults S3 only for what no node holds):

- a restart whose checkpoint RAM holds asks S3 for at most one listing and the manifests of
  the checkpoints it considers, whatever the rank count, and writes nothing;
- a restart from S3 (the node's RAM lost) lists once too, and reads ``.metadata`` once, plus
  the byte ranges each rank's plan reads; it writes nothing either.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from helpers import run_torchrun

WORKER = "restart_requests_worker.py"


def _calls(out: str) -> dict[int, list[list[str]]]:
    return {int(r): json.loads(rest) for r, rest in re.findall(r"^RANK (\d+) CALLS (.*)$", out,
                                                              re.M)}


def _restart(seaweed, tmp_path, url: str, nproc: int, nnodes: int
             ) -> tuple[dict[str, int], dict]:
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    before = seaweed.request_counts(bucket)
    out = run_torchrun(WORKER, str(tmp_path), url, json.dumps(seaweed.storage_options()),
                       "restart", nproc=nproc, nnodes=nnodes, timeout=180)
    after = seaweed.request_counts(bucket)
    made = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    return {k: v for k, v in made.items() if v}, _calls(out)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc, nnodes", [(2, 1), (4, 1), (2, 2)],
                         ids=["2-ranks", "4-ranks", "2-nodes-x-2-ranks"])
def test_a_restart_asks_the_object_store_the_same_few_things_at_any_rank_count(
        tmp_path, seaweed, s3_bucket, nproc, nnodes):
    url = f"{s3_bucket}/ckpt"
    run_torchrun(WORKER, str(tmp_path), url, json.dumps(seaweed.storage_options()), "save",
                 nproc=nproc, nnodes=nnodes, timeout=180)

    # Served from RAM: one listing and the manifests of the checkpoints it considers.
    made, calls = _restart(seaweed, tmp_path, url, nproc, nnodes)
    detail = f"{made}; per rank: {json.dumps(calls)}"
    assert made.get("PUT", 0) == 0 and made.get("DELETE", 0) == 0, detail
    assert made.get("LIST", 0) <= 1, detail
    assert made.get("GET", 0) <= 4, detail  # two manifests (and a HEAD or two), not per rank
    assert all(not c for r, c in calls.items() if r != 0), detail  # only rank 0 asks

    # From S3 (every node lost its RAM): still one listing, `.metadata` read once.
    shutil.rmtree(tmp_path / "ram")
    made, calls = _restart(seaweed, tmp_path, url, nproc, nnodes)
    detail = f"{made}; per rank: {json.dumps(calls)}"
    assert made.get("PUT", 0) == 0 and made.get("DELETE", 0) == 0, detail
    assert made.get("LIST", 0) <= 1, detail
    made_by = [(r, op, key) for r, ops in calls.items() for op, key in ops]
    assert [r for r, op, key in made_by if key.endswith("/.metadata")] == [0], detail
    # The manifests: read by one rank, once each; no per-file HEAD before a read.
    assert [r for r, op, key in made_by if key.endswith("tierstore.json")] == [0, 0], detail
    assert not [c for c in made_by if c[1] == "HeadObject" and c[2].endswith(".distcp")], detail
    # The rest are the data each rank's plan reads, a GET each: its own file and those of the
    # ranks DCP gave the replicated items (``replicated``, ``step``) to write, once each.
    for rank, ops in calls.items():
        data = [(op, key) for op, key in ops if key.endswith(".distcp")]
        assert {op for op, _ in data} == {"GetObject"}, detail
        assert len(data) == len(set(data)) <= 3, detail
        assert ("GetObject", f"ckpt/step-2/__{rank}_0.distcp") in data, detail
