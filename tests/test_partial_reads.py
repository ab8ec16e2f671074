"""A load at another world size reads part of each stored chunk: the rows it needs land in the
destination straight from the file when they are one run of its bytes (no ``torch.load`` of
the whole chunk), and through the decoder when they are not. Which boxes are one run decides
which bytes are read, so it is checked here against ``narrow`` on every box of small tensors;
the multi-rank loads of ``test_reshard`` check the bytes that land. A rank that needs part of a
file a peer holds gets the blocks holding it, each checked against its own digest in the
manifest; a block that differs is named, and bytes that did not arrive are never read."""

from __future__ import annotations

import dataclasses
import io
import itertools
import re

import pytest
import torch

from tierstore.format.checksum import checksum_of
from tierstore.format.item_io import BLOCK_MIN_BYTES, _contiguous_slice


def boxes(sizes):
    """Every box (offsets, lengths) of a tensor of ``sizes``."""
    per_dim = [[(o, n) for o in range(s) for n in range(1, s - o + 1)] for s in sizes]
    for combo in itertools.product(*per_dim):
        yield tuple(o for o, _ in combo), tuple(n for _, n in combo)


def test_a_box_is_one_run_exactly_when_its_bytes_are_contiguous_and_the_run_is_its_bytes():
    for sizes in [(5,), (4, 3), (3, 2, 4), (1, 3, 2)]:
        whole = torch.arange(torch.Size(sizes).numel(), dtype=torch.int32).reshape(sizes)
        raw = whole.numpy().tobytes()
        runs = strided = 0
        for offsets, lengths in boxes(sizes):
            box = whole
            for d, (o, n) in enumerate(zip(offsets, lengths)):
                box = box.narrow(d, o, n)
            run = _contiguous_slice(sizes, offsets, lengths, 4)
            if box.is_contiguous():
                assert run is not None, (sizes, offsets, lengths)
                start, length = run
                assert raw[start:start + length] == box.numpy().tobytes(), (sizes, offsets)
                runs += 1
            else:
                assert run is None, (sizes, offsets, lengths)
                strided += 1
        assert runs and (strided or len(sizes) == 1)


def test_rows_of_a_saved_chunk_are_one_run_and_columns_are_not():
    assert _contiguous_slice((8, 1024), (4, 0), (2, 1024), 4) == (4 * 1024 * 4, 2 * 1024 * 4)
    assert _contiguous_slice((8, 1024), (0, 0), (8, 1024), 2) == (0, 8 * 1024 * 2)
    assert _contiguous_slice((8, 1024), (0, 512), (8, 512), 4) is None
    assert _contiguous_slice((8, 1024), (0,), (8,), 4) is None  # not a box of this chunk


def _entry_of(data: bytes, block: int):
    """A manifest entry for ``data`` with blocks of ``block`` bytes, as a save writes it."""
    from tierstore.format.item_io import HashingWriter
    from tierstore.format.manifest import FileEntry

    sink = io.BytesIO()
    out = HashingWriter(sink, block_bytes=block)
    out.write(data[:1000])  # writes that straddle block boundaries
    out.write(data[1000:])
    out.flush()
    assert sink.getvalue() == data
    return FileEntry(len(data), out.hasher.hexdigest(), 0, None, block, out.blocks())


def test_a_block_from_a_peer_that_differs_from_its_digest_is_named_and_refused():
    from tierstore.format.item_io import check_blocks
    from tierstore.format.signing import UNSIGNED

    block = 1 << 12
    data = bytes(range(256)) * 70  # 17920 bytes: 4 whole blocks and a short one
    entry = _entry_of(data, block)
    assert len(entry.blocks) == 5 and entry.checksum == checksum_of(data)
    assert entry.blocks[4] == checksum_of(data[4 * block:])
    # The blocks a load needs, as whole blocks, adjacent ones joined.
    runs = entry.block_runs([(5000, 5001), (9000, 12000), (17000, 17920)])
    assert runs == [(4096, 12288), (16384, 17920)]
    received = bytearray(len(data))  # what arrived: those runs only
    for start, end in runs:
        received[start:end] = data[start:end]
    assert check_blocks(UNSIGNED, entry, memoryview(received), runs) == ""
    received[10000] ^= 1
    assert "block 2 (bytes 8192-12288) differs" in check_blocks(UNSIGNED, entry,
                                                                memoryview(received), runs)
    assert check_blocks(UNSIGNED, entry, memoryview(received), None) == "the file's checksum differs"
    assert entry.block_runs([(0, 1)]) == [(0, 4096)]
    without = dataclasses.replace(entry, block_bytes=0, blocks=None)
    assert without.block_runs([(5000, 5001)]) == [(0, len(data))]  # no blocks: the whole file


def test_a_file_fetched_in_part_reads_only_the_bytes_that_arrived():
    from tierstore.format.item_io import BufferReader, FileReadError

    reader = BufferReader(bytearray(b"abcdefghij"), held=[(2, 6)])
    reader.seek(2)
    got = bytearray(4)
    assert reader.readinto(got) == 4 and got == b"cdef"
    reader.seek(5)
    with pytest.raises(FileReadError, match="bytes 5-7 of the file were not fetched"):
        reader.readinto(bytearray(2))
    whole = BufferReader(b"abc")
    assert whole.readinto(bytearray(5)) == 3 and whole.readinto(bytearray(1)) == 0


def _three(fill=None) -> dict:
    """Three 3 MiB tensors (one data file with io_threads = 1), or zeroed destinations."""
    gen = torch.Generator().manual_seed(5)
    return {k: (torch.rand(3 << 18, generator=gen) if fill is None else torch.zeros(3 << 18))
            for k in "abc"}


def test_an_object_store_copy_serves_part_of_a_file_by_its_checked_blocks(tmp_path):
    import json
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import tierstore
    from recording import Recorder
    from tierstore import EventKind, IntegrityError

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    config = {"store": {"io_threads": 1},
              "tier": [{"name": "objects", "backend": "fsspec", "url": f"file://{tmp_path}/o"}]}
    saved = _three()
    with tierstore.open(config) as store:
        dcp.save(saved, storage_writer=store.writer(), checkpoint_id="step-1")
    manifest = json.loads((tmp_path / "o/step-1/tierstore.json").read_text())
    (name, entry), = [(n, e) for n, e in manifest["files"].items() if n.endswith(".distcp")]
    block = entry["block_bytes"]
    assert block == BLOCK_MIN_BYTES and len(entry["blocks"]) == -(-entry["size"] // block)
    raw_at = {s[2]: s[1] for s in entry["spans"]}  # all three are 3 MiB: in file order
    starts = sorted(s[1] for s in entry["spans"])

    def load_b():
        recorder, out = Recorder(), {"b": torch.zeros(3 << 18)}
        with tierstore.open(config, plugins=[recorder]) as store:
            dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
        loaded, = [e for e in recorder.events if e.kind == EventKind.LOADED]
        return out["b"], loaded.detail["bytes_from"]["objects"]

    b, read = load_b()
    assert torch.equal(b, saved["b"])
    # Only the blocks holding b's bytes: 3 MiB of them, give or take a block at each end.
    assert 3 << 20 <= read <= (3 << 20) + 2 * block < entry["size"], (read, entry["size"])
    assert len(raw_at) == 1 and len(starts) == 3

    def flip(offset):
        path = tmp_path / "o/step-1" / name
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF
        path.write_bytes(data)

    b_start = starts[1]  # "b" is the second item written
    flip(starts[0] + 10)  # in a's bytes, a block b's read never touches
    b, _ = load_b()
    assert torch.equal(b, saved["b"])
    flip(b_start + (1 << 20) + 5)  # in b's bytes: its block fails its digest
    out = {"b": torch.full((3 << 18,), 7.0)}
    with tierstore.open(config) as store:
        with pytest.raises((IntegrityError, CheckpointException)) as info:
            dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    assert "no tier has a good copy of " + name in str(info.value), info.value
    assert re.search(r"block \d+ \(bytes \d+-\d+\) differs", str(info.value)), info.value
    assert torch.equal(out["b"], torch.full((3 << 18,), 7.0))  # nothing of it landed


@pytest.mark.parametrize("destination", ["float64", "transposed"])
def test_a_destination_that_cannot_take_the_raw_bytes_gets_them_from_the_same_blocks(
        tmp_path, destination):
    """What a load reads of a file follows from its plan and the metadata, never from the
    destination tensors (a load knows it before DCP hands it its planner): a destination of
    another dtype, or not contiguous (as a tensor on a GPU cannot take raw bytes either), gets
    the raw bytes through a buffer of the load's own, read from the same checked blocks."""
    import warnings

    import torch.distributed.checkpoint as dcp

    import tierstore
    from recording import Recorder
    from tierstore import EventKind

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    config = {"store": {"io_threads": 1},
              "tier": [{"name": "objects", "backend": "fsspec", "url": f"file://{tmp_path}/o"}]}
    saved = {k: v.reshape(768, 1024) for k, v in _three().items()}
    with tierstore.open(config) as store:
        dcp.save(saved, storage_writer=store.writer(), checkpoint_id="step-1")
    out = ({"b": torch.zeros(768, 1024, dtype=torch.float64)} if destination == "float64"
           else {"b": torch.zeros(1024, 768).t()})
    recorder = Recorder()
    with tierstore.open(config, plugins=[recorder]) as store:
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    assert torch.equal(out["b"], saved["b"].to(out["b"].dtype))
    loaded, = [e for e in recorder.events if e.kind == EventKind.LOADED]
    read = loaded.detail["bytes_from"]["objects"]
    assert 3 << 20 <= read <= (3 << 20) + 2 * BLOCK_MIN_BYTES, read


def test_a_local_copy_is_checked_and_read_in_the_blocks_a_load_needs_only(tmp_path):
    """A node-local copy is checked from its mapped pages before anything lands, and only in
    the blocks the load reads (a job at another world size reads part of a file): damage
    elsewhere in the file does not stop the load, damage in those blocks sends it to the next
    tier, and the bytes land once, from the pages that were checked."""
    import json
    import warnings

    import torch.distributed.checkpoint as dcp

    import tierstore
    from recording import Recorder
    from tierstore import EventKind

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    config = {"store": {"io_threads": 1},
              "tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "l")},
                       {"name": "objects", "backend": "fsspec", "url": f"file://{tmp_path}/o"}]}
    saved = _three()
    with tierstore.open(config) as store:
        dcp.save(saved, storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
    manifest = json.loads((tmp_path / "l/step-1/tierstore.json").read_text())
    (name, entry), = [(n, e) for n, e in manifest["files"].items() if n.endswith(".distcp")]
    block = entry["block_bytes"]
    starts = sorted(s[1] for s in entry["spans"])

    def load_b():
        recorder, out = Recorder(), {"b": torch.full((3 << 18,), 7.0)}
        with tierstore.open(config, plugins=[recorder]) as store:
            dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
        loaded, = [e for e in recorder.events if e.kind == EventKind.LOADED]
        return out["b"], loaded.detail["bytes_from"]

    def flip(offset):
        path = tmp_path / "l/step-1" / name
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF
        path.write_bytes(data)

    b, read = load_b()
    assert torch.equal(b, saved["b"])
    assert list(read) == ["nvme"] and 3 << 20 <= read["nvme"] <= (3 << 20) + 2 * block, read
    flip(starts[0] + 10)  # in a's bytes, in a block b's read never touches
    b, read = load_b()
    assert torch.equal(b, saved["b"]) and list(read) == ["nvme"], read
    flip(starts[1] + (1 << 20) + 5)  # in b's bytes: the object store's copy is read instead
    b, read = load_b()
    assert torch.equal(b, saved["b"]) and list(read) == ["objects"], read


def _saved_with_a_neighbour(tmp_path):
    """``_three()`` saved as step-1 on a ``local`` tier: its config, the saved values, and a
    backend of the same directory standing for another process sharing it."""
    import warnings

    import torch.distributed.checkpoint as dcp

    import tierstore
    from tierstore_plugins.local import LocalBackend

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    config = {"tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "l")}]}
    saved = _three()
    with tierstore.open(config) as store:
        dcp.save(saved, storage_writer=store.writer(), checkpoint_id="step-1")
    return config, saved, LocalBackend(str(tmp_path / "l"))


def test_a_local_copy_being_read_is_not_evicted_by_another_process_sharing_its_directory(
        tmp_path):
    """The read takes its bytes from the pages it checked, without hashing them again: the
    directory is held shared from the check to the end of the read, so another process
    sharing it (a node's other ranks evict and recycle under an exclusive lock) cannot take
    the pages meanwhile; once the load is done, it can."""
    import torch.distributed.checkpoint as dcp

    import tierstore

    config, saved, neighbour = _saved_with_a_neighbour(tmp_path)

    class Neighbour:
        """Another process sharing the directory tries to evict while each file is read."""

        refused: list[bool] = []

        @tierstore.hookimpl
        def tierstore_phase(self, phase, checkpoint_id, tier, detail):
            if phase == tierstore.Phase.READ_FILE:
                lock = neighbour.lock_directory(checkpoint_id, exclusive=True)
                self.refused.append(lock is None)
                if lock is not None:
                    lock.release()

    out = _three(fill=0)
    with tierstore.open(config, plugins=[Neighbour()]) as store:
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    assert all(torch.equal(out[k], saved[k]) for k in saved)
    assert Neighbour.refused and all(Neighbour.refused), Neighbour.refused
    lock = neighbour.lock_directory("step-1", exclusive=True)
    assert lock is not None  # the load let it go
    lock.release()


def test_a_load_abandoned_between_its_plan_and_its_read_lets_its_checked_copies_go(tmp_path):
    """Local copies are checked (mapped, their directory held shared) when DCP prepares the
    plan, and read in read_data: a load that fails in between (here the planner's global
    step) leaves nothing mapped or held once the reader is dropped, so keep in a process
    sharing the directory can evict again."""
    import gc

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.api import CheckpointException

    import tierstore

    config, saved, neighbour = _saved_with_a_neighbour(tmp_path)

    class Failing(DefaultLoadPlanner):
        def create_global_plan(self, global_plan):
            raise RuntimeError("the global plan failed")

    out = _three(fill=0)
    with tierstore.open(config) as store:
        with pytest.raises(CheckpointException, match="the global plan failed"):
            dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1",
                     planner=Failing())
        gc.collect()
        lock = neighbour.lock_directory("step-1", exclusive=True)
        assert lock is not None  # nothing of the abandoned load holds it
        lock.release()
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    assert all(torch.equal(out[k], saved[k]) for k in saved)
