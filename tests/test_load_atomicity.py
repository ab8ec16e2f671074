"""A load is all or nothing: when some file of the checkpoint has no good copy on any tier,
``dcp.load`` raises and the state dict holds exactly what it held before, tensors (read in place
or copied from read windows) and other values alike, whatever mix of tier kinds served the
files (checked local pages, streams); a bad copy that another tier's good copy replaces still
loads bitwise right."""

from __future__ import annotations

import copy
import json
import uuid
import warnings
from pathlib import Path

import fsspec

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from recording import Recorder

import tierstore
from tierstore import EventKind
from tierstore.format.item_io import BufferReader, LoadUndo, needed_ranges, read_items
from tierstore.format.manifest import FileEntry
from tierstore.format.metadata import load_metadata

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

CID = "step-9"
LARGE = 1 << 17  # floats (512 KiB): read straight into the destination
SMALL = 100  # floats: copied from a read window


def state(seed: int) -> dict:
    """Large and small tensors of several files, and values that are not tensors."""
    gen = torch.Generator().manual_seed(seed)
    sd = {f"large{i}": torch.randn(LARGE, generator=gen) for i in range(6)}
    sd.update({f"small{i}": torch.randn(SMALL, generator=gen) for i in range(40)})
    sd["step"] = seed
    sd["extra"] = {"lr": seed / 10, "names": [f"run-{seed}"]}
    return sd


class Tiers:
    """Two tiers and their data files: ``local`` (files, checked before they are read),
    ``stream`` (fsspec's in-memory object store: read once, the old bytes kept), or ``mixed``
    (a first tier of files, ``first``: ``local`` or ``memory``, and a streamed slower one: a
    load reads some files from checked pages and others as streams)."""

    def __init__(self, root: Path, kind: str, first: str = "local"):
        self.root, self.kind, self.first = root, kind, first
        self.fs = fsspec.filesystem("memory")
        self.bucket = f"atomicity-{uuid.uuid4().hex[:8]}"

    def kind_of(self, tier: str) -> str:
        """``local`` or ``stream``: the backend of ``tier`` ("fast" or "slow")."""
        if self.kind == "mixed":
            return "local" if tier == "fast" else "stream"
        return self.kind

    def config(self, io_threads: int) -> dict:
        tiers = [{"name": n, "backend": self.first, "path": str(self.root / n)}
                 if self.kind_of(n) == "local" else
                 {"name": n, "backend": "fsspec", "url": f"memory://{self.bucket}/{n}"}
                 for n in ("fast", "slow")]
        return {"store": {"io_threads": io_threads}, "tier": tiers}

    def files(self, tier: str) -> list[str]:
        """Paths of the checkpoint's data files on ``tier``, in name order."""
        if self.kind_of(tier) == "local":
            return [str(p) for p in sorted((self.root / tier / CID).glob("*.distcp"))]
        return sorted(self.fs.glob(f"/{self.bucket}/{tier}/{CID}/*.distcp"))

    def path(self, tier: str, name: str) -> str:
        return next(p for p in self.files(tier) if p.endswith("/" + name))

    def _local(self, path: str) -> bool:
        return not path.startswith(f"/{self.bucket}/")

    def read(self, path: str) -> bytes:
        return Path(path).read_bytes() if self._local(path) else self.fs.cat_file(path)

    def write(self, path: str, data: bytes) -> None:
        if self._local(path):
            Path(path).write_bytes(data)
        else:
            self.fs.pipe_file(path, data)

    def corrupt_middle(self, path: str) -> None:
        """Change bytes in the middle of a data file; its size and manifest entry stay."""
        data = bytearray(self.read(path))
        mid = len(data) // 2
        for k in range(mid, mid + 64):
            data[k] ^= 0x5A
        self.write(path, bytes(data))

    def remove(self) -> None:
        """Drop the in-memory object store's copies (the local ones go with tmp_path)."""
        if self.kind != "local" and self.fs.exists(f"/{self.bucket}"):
            self.fs.rm(f"/{self.bucket}", recursive=True)


def name(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def assert_bitwise_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key
        else:
            assert got[key] == value, key


def save_on(tiers: Tiers) -> Tiers:
    """The checkpoint saved on ``tiers`` (drained to the slow one), in several data files."""
    with tierstore.open(tiers.config(4)) as store:
        dcp.save(state(1), storage_writer=store.writer(), checkpoint_id=CID)
        store.wait()
    names = [name(p) for p in tiers.files("fast")]
    assert len(names) >= 3 and [name(p) for p in tiers.files("slow")] == names
    return tiers


@pytest.fixture(params=["local", "stream", "mixed"])
def saved(tmp_path, request):
    """The checkpoint on both tiers, in several data files."""
    tiers = save_on(Tiers(tmp_path, request.param))
    yield tiers
    tiers.remove()


@pytest.mark.parametrize("io_threads", [1, 4])
def test_a_file_with_no_good_copy_leaves_the_state_dict_as_it_was(saved, io_threads):
    """Each data file in turn bad on every tier: with one reading thread the files before it
    loaded fine first; with four, others load beside it. Either way nothing changes."""
    for bad in [name(p) for p in saved.files("fast")]:
        paths = [saved.path(t, bad) for t in ("fast", "slow")]
        originals = {p: saved.read(p) for p in paths}
        for p in paths:
            saved.corrupt_middle(p)
        dest = state(2)
        before = copy.deepcopy(dest)
        with tierstore.open(saved.config(io_threads)) as store:
            with pytest.raises((tierstore.IntegrityError, CheckpointException), match=bad):
                dcp.load(dest, storage_reader=store.reader(), checkpoint_id=CID)
        assert_bitwise_equal(dest, before)
        for p, raw in originals.items():
            saved.write(p, raw)


@pytest.fixture(params=["local", "memory"])
def mixed(tmp_path, request):
    """The checkpoint on a first tier of files (``local`` or ``memory``) and a streamed
    (fsspec ``memory://``) slower one."""
    tiers = save_on(Tiers(tmp_path, "mixed", first=request.param))
    yield tiers
    tiers.remove()


@pytest.mark.parametrize("io_threads", [1, 4])
def test_a_failed_load_from_mixed_tiers_leaves_every_destination_as_it_was(mixed, io_threads):
    """The other files' copies on the first tier are good (checked from their mapped pages),
    the last file is bad on both tiers (its first copy fails its check, so the load reads it as
    a stream from the slower tier, where it fails too): what the good files hold must not reach
    the state dict before that failure is known, nor stay there after it."""
    bad = name(mixed.files("fast")[-1])
    for tier in ("fast", "slow"):
        mixed.corrupt_middle(mixed.path(tier, bad))
    dest = state(2)
    before = copy.deepcopy(dest)
    with tierstore.open(mixed.config(io_threads)) as store:
        with pytest.raises((tierstore.IntegrityError, CheckpointException)) as info:
            dcp.load(dest, storage_reader=store.reader(), checkpoint_id=CID)
    assert f"no tier has a good copy of {bad}" in str(info.value), info.value
    changed = [k for k, v in before.items() if isinstance(v, torch.Tensor)
               and not torch.equal(dest[k].view(torch.uint8), v.view(torch.uint8))]
    assert not changed, f"a failed load changed {len(changed)} tensors: {changed}"
    assert_bitwise_equal(dest, before)


@pytest.mark.parametrize("held", [False, True])
def test_bytes_checked_in_memory_reach_no_destination_before_the_load_is_good(tmp_path, held):
    """What a load reads from bytes already checked and in memory (a copy's mapped pages, a
    file peers sent, or with ``held`` only the ranges they sent: the other bytes are garbage)
    lands only at ``LoadUndo.apply``; a load that fails after them (``restore``) has nothing of
    theirs to put back, and one that succeeds lands them bitwise."""
    config = {"tier": [{"name": "t", "backend": "local", "path": str(tmp_path / "t")}]}
    with tierstore.open(config) as store:
        dcp.save(state(1), storage_writer=store.writer(), checkpoint_id=CID)
    directory = tmp_path / "t" / CID
    metadata = load_metadata((directory / ".metadata").read_bytes(), "test")
    files = json.loads((directory / "tierstore.json").read_text())["files"]

    def read_all(dest: dict) -> LoadUndo:
        planner = DefaultLoadPlanner()
        planner.set_up_planner(dest, metadata)
        reqs = planner.create_local_plan().items
        undo = LoadUndo()
        for name in sorted(n for n in files if n.endswith(".distcp")):
            entry = FileEntry(**files[name])
            mine = [r for r in reqs if metadata.storage_data[r.storage_index].relative_path == name]
            data = bytearray((directory / name).read_bytes())
            ranges = None
            if held:
                ranges = needed_ranges(entry, mine, metadata.storage_data, metadata)
                sent = bytearray(b"\xa5" * len(data))
                for start, end in ranges:
                    sent[start:end] = data[start:end]
                data = sent
            read_items(BufferReader(data, ranges), entry, mine, metadata.storage_data,
                       metadata, planner, None, undo=undo)
        return undo

    dest = state(2)
    before = copy.deepcopy(dest)
    undo = read_all(dest)
    assert_bitwise_equal(dest, before)  # every file read: nothing landed yet
    undo.restore()
    assert_bitwise_equal(dest, before)
    dest = state(2)
    read_all(dest).apply()
    assert_bitwise_equal(dest, state(1))


@pytest.mark.parametrize("io_threads", [1, 4])
def test_a_bad_copy_on_the_first_tier_falls_back_and_loads_bitwise(saved, io_threads):
    for p in saved.files("fast"):
        saved.corrupt_middle(p)
    dest = state(2)
    events = Recorder()
    with tierstore.open(saved.config(io_threads), plugins=[events]) as store:
        dcp.load(dest, storage_reader=store.reader(), checkpoint_id=CID)
    assert_bitwise_equal(dest, state(1))
    fell_back = {e.detail["file"] for e in events.events if e.kind == EventKind.FELL_BACK}
    assert fell_back == {name(p) for p in saved.files("fast")}


def test_a_load_that_fails_after_a_fallback_puts_back_what_the_fallback_wrote(saved):
    """One file read from the slow tier's good copy, another bad everywhere: the bytes of the
    good copy landed already (when read as a stream), and are put back too."""
    files = [name(p) for p in saved.files("fast")]
    saved.corrupt_middle(saved.path("fast", files[0]))
    for tier in ("fast", "slow"):
        saved.corrupt_middle(saved.path(tier, files[-1]))
    dest = state(2)
    before = copy.deepcopy(dest)
    with tierstore.open(saved.config(1)) as store:
        with pytest.raises((tierstore.IntegrityError, CheckpointException), match=files[-1]):
            dcp.load(dest, storage_reader=store.reader(), checkpoint_id=CID)
    assert_bitwise_equal(dest, before)


@pytest.mark.parametrize("ranks_on_node", [1, 64])
def test_a_load_reads_in_no_more_threads_than_its_share_of_the_cpus(saved, monkeypatch,
                                                                    ranks_on_node):
    """Reading from RAM and checking digests is CPU work: a rank whose node runs more ranks
    than it has CPUs reads in one thread, not in ``io_threads`` that take turns with the other
    ranks' (the load is still whole and bitwise right)."""
    import os

    from tierstore.dcp import reader as reader_module

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks_on_node))
    pools: list[int] = []

    class RecordingPool(reader_module.ThreadPoolExecutor):
        def __init__(self, workers, *args, **kwargs):
            pools.append(workers)
            super().__init__(workers, *args, **kwargs)

    monkeypatch.setattr(reader_module, "ThreadPoolExecutor", RecordingPool)
    got = state(2)
    with tierstore.open(saved.config(4)) as store:
        dcp.load(got, storage_reader=store.reader(), checkpoint_id=CID)
    assert_bitwise_equal(got, state(1))
    share = max(1, len(os.sched_getaffinity(0)) // ranks_on_node)
    workers = min(4, share, len(saved.files("fast")))
    # One pool checks the local copies (when DCP's plan is prepared), one reads them.
    assert pools == ([workers, workers] if workers > 1 else []), (pools, share)


@pytest.mark.timeout(300)
def test_a_load_that_fails_on_one_rank_leaves_every_ranks_state_as_it_was(tmp_path):
    """1 node x 2 ranks, ``memory`` and ``local`` tiers, shared by both ranks and then a
    directory per rank (a load that may fetch from peers): one byte of rank 1's data file
    flipped on both tiers. Both ranks' loads raise, naming that file, and neither rank's state
    changed (rank 0's own files were good: before, it applied them and returned before DCP's
    last exchange raised); with the byte back, the same stores load bitwise, and one rank alone
    exports the checkpoint without waiting for the other (the worker's checks); then the file
    deleted from both of rank 1's tiers is named on every rank. One launch."""
    from helpers import run_torchrun

    out = run_torchrun("load_atomicity_worker.py", tmp_path, timeout=240)
    for layout in ("shared", "per-rank"):
        for rank in range(2):
            assert f"RANK {rank} {layout} FAILED" in out, out[-5000:]
        # Rank 0 says why it left its state as it was: rank 1's load failed, on that file.
        line = next(s for s in out.splitlines() if s.startswith(f"RANK 0 {layout} FAILED"))
        assert "the load failed on rank(s) [1]" in line and "__1_0.distcp" in line, line
    # The file deleted from both of rank 1's tiers (a directory per rank): every rank names it.
    for rank in range(2):
        assert f"RANK {rank} per-rank DELETED checkpoint 'step-1' cannot be loaded by this " \
               f"job: the files of rank(s) [1] are on no tier of any rank (__1_0.distcp on " \
               f"none)" in out, out[-5000:]
