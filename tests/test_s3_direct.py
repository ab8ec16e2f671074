"""Every rank of a job saving straight into one shared S3 prefix (no node-local tier in front),
on both object-store backends, at 4 ranks: each rank begins the save on the same prefix, in
any order, while faster ranks already write their objects there. No rank's begin may delete
another's part of the same save (a begin that emptied the prefix did, one save in a few), and
a checkpoint overwritten in place keeps none of the old one's objects.
"""

from __future__ import annotations

import json

import pytest

from helpers import run_torchrun

SAVES = 4


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["fsspec", "obstore"])
def test_four_ranks_save_straight_to_s3_and_load_every_step_bitwise(seaweed, s3_bucket, backend):
    url = f"{s3_bucket}/ckpt"
    # Every save commits (a lost part is "objects not confirmed (missing)" at the commit) and
    # every step loads bitwise on every rank.
    run_torchrun("s3_direct_worker.py", backend, url, json.dumps(seaweed.storage_options()),
                 SAVES, nproc=4, timeout=300)

    # What is stored is what the manifests name: no save's marker left, and the overwritten
    # step-1 (written one file per rank, where its first version had several) holds exactly
    # its new files: the old ones it did not replace are gone.
    fs = seaweed.filesystem()
    stored = {}
    for n in range(1, SAVES + 1):
        prefix = f"{url.split('://', 1)[1]}/step-{n}"
        names = sorted(p.rsplit("/", 1)[1] for p in fs.find(prefix))
        manifest = json.loads(fs.cat(f"{prefix}/tierstore.json"))
        assert names == sorted([*manifest["files"], "tierstore.json"]), (n, names)
        stored[n] = [name for name in names if name.endswith(".distcp")]
    assert len(stored[1]) == 4 < len(stored[2]), stored
