"""``dedup = true`` under torchrun (2 ranks, gloo), as a fine-tuning job uses it: a frozen base
with trainable adapters (and Adam's state for them), replicated on both ranks, saved every step
for 10 steps to RAM (``memory``), disk (``local``) and S3 (``fsspec`` on SeaweedFS) tiers, all
deduplicating (tests/scripts/dedup_worker.py).

What it shows: every step restores bit for bit from every tier alone; each save after the first
adds to each tier, counted on the tier's own listing, at most 1.1x the bytes of the items that
changed since the previous save, plus its manifests (``.metadata``, ``tierstore.json``, the
recipes); and stock ``dcp.load`` reads the disk tier's checkpoints once exported with
``store.export(id, "dcp", dir)`` and with ``tierstore export --format dcp``.
"""

from __future__ import annotations

import json
import shutil
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_trees_equal, empty_like, run_torchrun

TIERS = ("ram", "disk", "s3")
STEPS = 10
TIERSTORE_CLI = [sys.executable, "-m", "tierstore.cli"]
_BYTES = re.compile(r"^BYTES tier=(\w+) step=(\d+) changed=(\d+) chunks=(\d+) other=(\d+) "
                    r"manifests=(\d+) recipes=(\d+) distcp=(\d+)$", re.M)


def _figures(out: str) -> dict[tuple[str, int], dict[str, int]]:
    found = {}
    for m in _BYTES.finditer(out):
        found[(m[1], int(m[2]))] = dict(zip(
            ("changed", "chunks", "other", "manifests", "recipes", "distcp"),
            map(int, m.groups()[2:])))
    return found


def _table(figures, total: int) -> str:
    lines = [f"whole state: {total} bytes",
             "tier  step  changed   written (chunks+other)  ratio   manifests"]
    for (tier, step), f in sorted(figures.items(), key=lambda kv: (TIERS.index(kv[0][0]),
                                                                   kv[0][1])):
        written = f["chunks"] + f["other"]
        ratio = written / f["changed"] if f["changed"] else float("inf")
        lines.append(f"{tier:<5} {step:>4}  {f['changed']:>8}  {written:>10} "
                     f"({f['chunks']}+{f['other']})  {ratio:5.3f}  {f['manifests']:>8}")
    return "\n".join(lines)


def test_adapter_training_saves_only_what_changed_to_every_deduplicating_tier(
        seaweed, s3_bucket, tmp_path):
    url = f"{s3_bucket}/run"
    out = run_torchrun("dedup_worker.py", str(tmp_path), url,
                       json.dumps(seaweed.storage_options()), nproc=2, timeout=240)
    # Every rank restored every step from every tier alone, and rank 0 loaded every step's
    # export with stock DCP, bit for bit (run_torchrun: "RANK r OK", no MISMATCH / PROBLEM).
    for tier in TIERS:
        assert f"RESTORED tier={tier} steps={STEPS}" in out, out
    assert f"EXPORTED steps={STEPS}" in out, out

    total = int(re.search(r"^TOTAL bytes=(\d+)$", out, re.M)[1])
    figures = _figures(out)
    table = _table(figures, total)
    print("\n" + table)
    print("\n".join(line for line in out.splitlines()
                    if line.startswith(("OTHER", "SAVES", "RESTORES"))))
    assert sorted(figures) == sorted((t, s) for t in TIERS for s in range(1, STEPS + 1)), out

    for tier in TIERS:
        first = figures[(tier, 1)]
        # The first save writes the whole state (the frozen base too), as chunks, and every
        # data file of each checkpoint on the tier is a recipe, none a plain .distcp file.
        assert first["changed"] == total
        assert first["chunks"] >= total, (tier, table)
        for step in range(1, STEPS + 1):
            f = figures[(tier, step)]
            assert f["recipes"] >= 1 and f["distcp"] == 0, (tier, step, f)
            assert f["manifests"] > 0, (tier, step, f)
        for step in range(2, STEPS + 1):
            f = figures[(tier, step)]
            # The adapters and their Adam state change every step, the frozen base never: what
            # changed is a small part of the state (else the bound below would prove nothing).
            assert 0 < f["changed"] < total / 4, (tier, step, table)
            # What the save added to the tier beyond its manifests: new chunks (and any other
            # file, e.g. a whole .distcp file a tier that does not deduplicate would write).
            # No slack: each item's chunk is its record, a torch.save archive around its bytes
            # (1577 bytes of it around an adapter's 32 KiB, 4.8 %), inside the 10 %.
            written = f["chunks"] + f["other"]
            assert written <= 1.1 * f["changed"], (tier, step, table)
            # The manifests and recipes hide no data: a few dozen KiB, not the state's MiB.
            assert f["manifests"] < total / 20, (tier, step, table)

    # The operator's way: `tierstore export CONFIG ID --format dcp --out DIR` on the disk tier
    # alone, read back by stock dcp.load in this process (no tierstore reader, no process
    # group), bit for bit against the state the job saved at that step.
    config = tmp_path / "disk.toml"
    config.write_text(f'[[tier]]\nname = "disk"\nbackend = "local"\n'
                      f'path = {json.dumps(str(tmp_path / "disk"))}\ndedup = true\n')
    exported = tmp_path / "cli-export"
    proc = subprocess.run([*TIERSTORE_CLI, "export", str(config), "step-7", "--format", "dcp",
                           "--out", str(exported)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not [p.name for p in exported.iterdir() if ".tierstore-chunked." in p.name]
    want = torch.load(tmp_path / "expected-step-7.pt", weights_only=False)
    got = empty_like(want)
    dcp.load(got, checkpoint_id=str(exported))
    assert_trees_equal(got, want, "tierstore export step-7")


@pytest.mark.timeout(600)
def test_peer_replicas_of_a_deduplicated_save_move_only_the_changed_chunks(tmp_path):
    """2 simulated nodes x 1 rank, RAM and a peer tier both with dedup = true: after the first
    save, a replication moves each rank's adapter (64 KiB and its record), not its 4 MiB
    frozen part; after node 1 is lost, its rank loads step-3 from its replicas on node 0."""
    root = str(tmp_path)
    out = run_torchrun("dedup_peer_worker.py", root, "save", nproc=1, nnodes=2, timeout=240)
    moved = {(int(r), cid): (int(s), int(g)) for r, cid, s, g in
             re.findall(r"RANK (\d) REPLICATED (step-\d) SENT (\d+) RECEIVED (\d+)", out)}
    assert len(moved) == 6, out[-4000:]
    frozen, adapter = 4 << 20, 64 << 10
    for rank in (0, 1):
        assert moved[(rank, "step-1")][0] > frozen, moved
        for cid in ("step-2", "step-3"):
            sent, received = moved[(rank, cid)]
            # the adapter's record (64 KiB and about 1.5 KiB around it) and the small items
            assert adapter <= sent <= 1.1 * adapter + (8 << 10), (rank, cid, moved)
            assert adapter <= received <= 1.1 * adapter + (8 << 10), (rank, cid, moved)
    assert list((tmp_path / "peer/0/.replicas/1-held-by-0/.tierstore-chunks").rglob("*"))
    # Node 1 is replaced: nothing of its RAM or peer tier is left.
    shutil.rmtree(tmp_path / "ram/1")
    shutil.rmtree(tmp_path / "peer/1")
    out = run_torchrun("dedup_peer_worker.py", root, "load", nproc=1, nnodes=2, timeout=240)
    assert "RANK 0 LOADED step-3" in out and "RANK 1 LOADED step-3" in out, out[-4000:]
