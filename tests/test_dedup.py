"""Deduplicated tiers (``dedup = true``) in one process: what is written, what keep and gc
remove, what a damaged recipe or chunk does, and the errors a user sees.

The multi-rank round trip (a frozen base with adapters, RAM, disk and S3) is in
``test_dedup_multirank.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore.errors import ConfigError
from tierstore.tiers.chunks import CHUNKS_DIR

MiB = 1 << 20


def _config(tmp_path, *, ram: dict | None = None, disk: dict | None = None) -> dict:
    return {"tier": [
        {"name": "ram", "backend": "memory", "path": str(tmp_path / "ram"), "dedup": True,
         **(ram or {})},
        {"name": "disk", "backend": "local", "path": str(tmp_path / "disk"), "dedup": True,
         **(disk or {})}]}


def _base() -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"base.{i}": torch.randn(256, 1024, generator=g) for i in range(4)}  # 4 x 1 MiB


def _state(step: int, base: dict) -> dict:
    return {**base, "adapter": torch.full((64, 1024), float(step)),  # 256 KiB, changes
            "step": step}


def _chunk_files(root) -> dict[str, int]:
    out = {}
    for dirpath, _, names in os.walk(root / CHUNKS_DIR):
        for name in names:
            if not name.startswith("."):
                path = os.path.join(dirpath, name)
                out[path] = os.path.getsize(path)
    return out


def _load(store, cid: str, base: dict) -> dict:
    out = {**{k: torch.empty_like(v) for k, v in base.items()},
           "adapter": torch.empty(64, 1024), "step": -1}
    dcp.load(out, storage_reader=store.reader(), checkpoint_id=cid)
    return out


def _assert_step(out: dict, step: int, base: dict) -> None:
    for k, v in base.items():
        assert torch.equal(out[k], v), k
    assert torch.equal(out["adapter"], torch.full((64, 1024), float(step)))
    assert out["step"] == step


def test_a_save_writes_only_the_chunks_the_tier_lacks_and_loads_bitwise(tmp_path):
    base = _base()
    written = []
    with tierstore.open(_config(tmp_path)) as store:
        for step in (1, 2, 3):
            before = {t: _chunk_files(tmp_path / t) for t in ("ram", "disk")}
            dcp.save(_state(step, base), storage_writer=store.writer(),
                     checkpoint_id=f"step-{step}")
            store.wait()
            after = {t: _chunk_files(tmp_path / t) for t in ("ram", "disk")}
            written.append({t: sum(s for p, s in after[t].items() if p not in before[t])
                            for t in after})
        for step in (1, 2, 3):
            _assert_step(_load(store, f"step-{step}", base), step, base)
    # The first save writes everything; the next ones the adapter (256 KiB) and its record.
    assert all(w > 4 * MiB for w in written[0].values()), written
    for w in written[1:]:
        for tier, nbytes in w.items():
            assert 256 << 10 <= nbytes <= 1.1 * (256 << 10), (tier, nbytes)
    # The checkpoint directory holds recipes, not data files.
    names = os.listdir(tmp_path / "disk" / "step-3")
    assert not [n for n in names if n.endswith(".distcp")], names
    assert [n for n in names if ".distcp.tierstore-chunked." in n], names


def test_keep_removes_the_chunks_only_evicted_checkpoints_named(tmp_path):
    base = _base()
    with tierstore.open(_config(tmp_path, ram={"keep": 2}, disk={"keep": 2})) as store:
        sizes = []
        for step in range(1, 6):
            dcp.save(_state(step, base), storage_writer=store.writer(),
                     checkpoint_id=f"step-{step}")
            store.wait()
            sizes.append(sum(_chunk_files(tmp_path / "disk").values()))
        assert [c.id for c in store.list()] == ["step-5", "step-4"]
        # Two checkpoints' worth: the shared base once, two adapters, the small items.
        assert sizes[-1] == sizes[2] == sizes[3], sizes
        assert sizes[-1] < 5 * MiB, sizes
        for step in (4, 5):
            _assert_step(_load(store, f"step-{step}", base), step, base)


def test_a_collection_while_a_writer_holds_the_chunk_store_removes_nothing(tmp_path):
    base = _base()
    with tierstore.open(_config(tmp_path, disk={"keep": 1})) as store:
        dcp.save(_state(1, base), storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
        disk = store._ctx.tiers.named("disk")
        # Another process writing to this tier holds its chunk store shared.
        holder = subprocess.Popen(
            [sys.executable, "-c",
             "import fcntl, os, sys, time\n"
             f"fd = os.open({str(tmp_path / 'disk' / CHUNKS_DIR)!r}, os.O_RDONLY)\n"
             "fcntl.flock(fd, fcntl.LOCK_SH)\nprint('held', flush=True)\ntime.sleep(60)\n"],
            stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            disk.delete("step-1")  # its chunks are now named by nothing
            before = _chunk_files(tmp_path / "disk")
            done = disk.collect_chunks()
            assert done is not None and not done.ran
            assert _chunk_files(tmp_path / "disk") == before
        finally:
            holder.kill()
            holder.wait()
        done = disk.collect_chunks()
        assert done.ran and done.chunks > 0
        assert not _chunk_files(tmp_path / "disk")


def test_a_missing_chunk_is_found_by_verify_and_the_load_falls_back(tmp_path):
    base = _base()
    with tierstore.open(_config(tmp_path)) as store:
        dcp.save(_state(1, base), storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
        victim = max(_chunk_files(tmp_path / "ram").items(), key=lambda kv: kv[1])[0]
        os.unlink(victim)
        report = store.verify("step-1")
        assert not report.ok
        problems = [(p.tier, p.what) for p in report.problems]
        assert any(t == "ram" and "chunk" in why and "missing" in why for t, why in problems), \
            problems
        # The load reads that file from the disk tier instead, bitwise.
        _assert_step(_load(store, "step-1", base), 1, base)
        # scrub --repair writes the file again on 'ram', chunks and all.
        store.scrub(repair=True)
        assert store.verify("step-1").ok


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_a_chunk_with_a_flipped_bit_is_found_and_scrub_repair_rewrites_it(tmp_path, tier):
    base = _base()
    with tierstore.open(_config(tmp_path)) as store:
        dcp.save(_state(1, base), storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
        victim = max(_chunk_files(tmp_path / tier).items(), key=lambda kv: kv[1])[0]
        with open(victim, "r+b") as f:
            f.seek(1000)
            byte = f.read(1)
            f.seek(1000)
            f.write(bytes([byte[0] ^ 1]))
        report = store.verify("step-1")
        assert [p.tier for p in report.problems] == [tier], report.problems
        _assert_step(_load(store, "step-1", base), 1, base)  # from the other tier
        store.scrub(repair=True)
        assert store.verify("step-1").ok
        with open(victim, "rb") as f:
            f.seek(1000)
            assert f.read(1) == byte


def test_a_tampered_recipe_is_a_corrupt_copy_never_wrong_bytes(tmp_path):
    base = _base()
    with tierstore.open(_config(tmp_path)) as store:
        dcp.save(_state(1, base), storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
        directory = tmp_path / "ram" / "step-1"
        recipe = next(p for p in directory.iterdir() if ".tierstore-chunked." in p.name)
        data = json.loads(recipe.read_text())
        data["chunks"][0], data["chunks"][-1] = data["chunks"][-1], data["chunks"][0]
        # Two chunks swapped: the sizes still add up, so the recipe parses, and the file it
        # puts together fails its checksum: the load reads the disk tier instead.
        recipe.write_text(json.dumps(data))
        _assert_step(_load(store, "step-1", base), 1, base)
        recipe.write_text("{not json")
        report = store.verify("step-1")
        assert any(p.tier == "ram" and "recipe" in p.what for p in report.problems), \
            report.problems
        _assert_step(_load(store, "step-1", base), 1, base)


def test_turning_dedup_on_keeps_the_whole_files_already_there_readable(tmp_path):
    base = _base()
    plain = {"tier": [{"name": "disk", "backend": "local", "path": str(tmp_path / "disk")}]}
    with tierstore.open(plain) as store:
        dcp.save(_state(1, base), storage_writer=store.writer(), checkpoint_id="step-1")
    deduped = {"tier": [{**plain["tier"][0], "dedup": True}]}
    with tierstore.open(deduped) as store:
        assert [c.id for c in store.list()] == ["step-1"]
        _assert_step(_load(store, "step-1", base), 1, base)
        dcp.save(_state(2, base), storage_writer=store.writer(), checkpoint_id="step-2")
        _assert_step(_load(store, "step-2", base), 2, base)


def test_export_dcp_gives_a_checkpoint_stock_dcp_loads_without_tierstore(tmp_path):
    base = _base()
    with tierstore.open(_config(tmp_path)) as store:
        dcp.save(_state(3, base), storage_writer=store.writer(), checkpoint_id="step-3")
        result = store.export("step-3", "dcp", str(tmp_path / "stock"))
    assert result.tensors == 5
    code = (
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        "assert 'tierstore' not in sys.modules\n"
        "sd = {f'base.{i}': torch.empty(256, 1024) for i in range(4)}\n"
        "sd.update(adapter=torch.empty(64, 1024), step=-1)\n"
        f"dcp.load(sd, checkpoint_id={str(tmp_path / 'stock')!r}, no_dist=True)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "assert all(torch.equal(sd[f'base.{i}'], torch.randn(256, 1024, generator=g)) "
        "for i in range(4))\n"
        "assert torch.equal(sd['adapter'], torch.full((64, 1024), 3.0)) and sd['step'] == 3\n"
        "print('STOCK OK')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0 and "STOCK OK" in out.stdout, out.stderr[-2000:]


def test_dedup_with_parity_is_a_config_error_that_says_what_to_do_instead(tmp_path):
    config = {"tier": [
        {"name": "ram", "backend": "memory", "path": str(tmp_path / "ram")},
        {"name": "peer", "backend": "peer", "path": str(tmp_path / "peer" / "{node}"),
         "dedup": True, "replication": {"strategy": "erasure", "data": 2, "parity": 1}}]}
    with pytest.raises(ConfigError) as err:
        tierstore.open(config)
    assert "dedup = true is not available with the erasure strategy" in str(err.value)
    assert "tier 'peer'" in str(err.value) and "clique, ring" in str(err.value)


def test_a_signing_store_names_chunks_by_keyed_digests_nobody_else_can_make(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("DEDUP_KEY", "c4e2a9107d3b5f6e8a0b2c4d6e8f1a3b")
    base = _base()
    config = {"store": {"signing_key": {"env": "DEDUP_KEY"}}, **_config(tmp_path)}
    with tierstore.open(config) as store:
        for step in (1, 2):
            dcp.save(_state(step, base), storage_writer=store.writer(),
                     checkpoint_id=f"step-{step}")
        store.wait()
        _assert_step(_load(store, "step-2", base), 2, base)
    kinds = set(os.listdir(tmp_path / "disk" / CHUNKS_DIR)) - {".generation"}
    assert len(kinds) == 1 and next(iter(kinds)).startswith("blake3k_"), kinds
    # A chunk planted under the name of one the next save needs, by someone without the key:
    # the save that relies on it is refused as a bad copy, never loaded as the adapter.
    victim = max(_chunk_files(tmp_path / "disk").items(), key=lambda kv: kv[1])[0]
    with open(victim, "r+b") as f:
        f.write(b"\0" * 64)
    with tierstore.open(config) as store:
        report = store.verify("step-2", tier="disk")
        assert not report.ok
        _assert_step(_load(store, "step-2", base), 2, base)  # from 'ram'


def _recipe(root, cid: str) -> tuple[str, dict]:
    name = next(n for n in os.listdir(root / cid) if ".distcp.tierstore-chunked." in n)
    return name.split(".tierstore-chunked.")[0], json.loads((root / cid / name).read_text())


def test_a_deduplicated_file_loads_through_its_chunks_own_pages(tmp_path):
    """Each large item starts on a page of the file, so its chunks start on pages too and a
    load maps the chunks' files side by side (no copy of their bytes); a chunk another user
    could change is read instead of mapped, a short one is a damaged chunk store."""
    import mmap

    from tierstore.tiers.chunks import MissingChunk, chunk_path

    base = _base()
    # one data file per rank: the large items follow small ones in it
    with tierstore.open({"store": {"io_threads": 1}, **_config(tmp_path)}) as store:
        dcp.save(_state(1, base), storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
        root = tmp_path / "disk"
        data_file, recipe = _recipe(root, "step-1")
        chunks = recipe["chunks"]
        starts = [sum(length for length, _ in chunks[:i]) for i in range(len(chunks))]
        # the four 1 MiB base tensors each start a chunk on a page, after the small items
        large = [s for s, (length, _) in zip(starts, chunks) if length == MiB]
        assert len(large) == 4 and max(large) > 0, (starts, chunks)
        assert all(s % mmap.PAGESIZE == 0 for s in large), large
        whole = b"".join((root / chunk_path(d)).read_bytes() for _, d in chunks)
        backend = store._ctx.tiers.named("disk").backend

        def mapped() -> bytes:
            with backend.open_read(f"step-1/{data_file}") as f:
                pages = f.mapped()
                assert pages is not None
                try:
                    return bytes(pages)
                finally:
                    pages.close()

        assert mapped() == whole
        big = next(d for (length, d), s in zip(chunks, starts)
                   if length == MiB and s % mmap.PAGESIZE == 0)
        os.chmod(root / chunk_path(big), 0o664)  # another user could write it: read, not mapped
        assert mapped() == whole
        _assert_step(_load(store, "step-1", base), 1, base)
        with open(root / chunk_path(big), "r+b") as f:
            f.truncate(MiB - 1)
        with backend.open_read(f"step-1/{data_file}") as f:
            with pytest.raises(MissingChunk, match=f"chunk {big}"):
                f.mapped()
        assert not store.verify("step-1", "disk").ok
        # the load takes the RAM tier's copy instead, bitwise
        _assert_step(_load(store, "step-1", base), 1, base)
