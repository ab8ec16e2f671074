"""Page recycling on peer tiers (tierstore_plugins.recycle), the transfer ends over mapped
files, and retention sparing a checkpoint while it is loaded."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tierstore
from tierstore.transport.ends import BufferTarget, MappedFile, WrittenFile
from tierstore_plugins.local import LocalBackend
from tierstore_plugins.recycle import RECYCLE_DIR, MappedEnd


def write(backend: LocalBackend, path: str, data: bytes) -> None:
    backend.makedirs(os.path.dirname(path))
    with backend.open_write(path) as f:
        f.write(data)


def bin_files(backend: LocalBackend) -> list[str]:
    return sorted(os.listdir(backend.recycler.bin)) if os.path.isdir(backend.recycler.bin) else []


def test_an_evicted_checkpoints_files_are_written_over_in_place(tmp_path):
    backend = LocalBackend(str(tmp_path), fsync=False, recycle=True)
    write(backend, "step-1/a.distcp", b"x" * 10_000)
    old_inode = os.stat(tmp_path / "step-1/a.distcp").st_ino
    backend.discard("step-1")
    assert not (tmp_path / "step-1").exists()
    assert bin_files(backend) == ["0-10000"]

    write(backend, "step-2/b.distcp", b"new bytes")  # shorter: cut to what was written
    path = tmp_path / "step-2/b.distcp"
    assert path.read_bytes() == b"new bytes"
    assert os.stat(path).st_ino == old_inode
    assert bin_files(backend) == []


def test_the_bin_holds_one_dropped_directory_and_close_frees_it(tmp_path):
    backend = LocalBackend(str(tmp_path), fsync=False, recycle=True)
    write(backend, "step-1/a", b"1" * 100)
    write(backend, "step-2/a", b"2" * 200)
    write(backend, "step-2/b", b"2" * 300)
    backend.discard("step-1")
    backend.discard("step-2")
    assert bin_files(backend) == ["0-200", "1-300"] or bin_files(backend) == ["0-300", "1-200"]
    backend.close()
    assert bin_files(backend) == []


def test_files_this_process_did_not_write_are_deleted_not_recycled(tmp_path):
    # Ranks of a node may share a directory: another rank's file may still be mapped there.
    backend = LocalBackend(str(tmp_path), fsync=False, recycle=True)
    (tmp_path / "step-1").mkdir()
    (tmp_path / "step-1" / "other-rank.distcp").write_bytes(b"z" * 500)
    write(backend, "step-1/mine.distcp", b"m" * 400)
    backend.discard("step-1")
    assert bin_files(backend) == ["0-400"]


def test_a_dead_processs_bin_is_freed_by_the_next_one_a_live_ones_is_not(tmp_path):
    dead = tmp_path / RECYCLE_DIR / "999999999"
    # A live process's bin, whatever its name says: it holds the bin's lock.
    live = subprocess.Popen(
        [sys.executable, "-c",
         "import time; from tierstore_plugins.local import LocalBackend; "
         f"b = LocalBackend({str(tmp_path)!r}, fsync=False, recycle=True); b.makedirs('x'); "
         "b.open_write('x/a').write(b'1' * 100); b.discard('x'); "
         "print(b.recycler.bin, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        live_bin = live.stdout.readline().strip()
        assert os.listdir(live_bin) == ["0-100"]
        dead.mkdir()  # (after the live process's first write, which would have freed it)
        (dead / "0-100").write_bytes(b"x" * 100)
        # Opening the tier changes nothing (a reading command such as `tierstore ls` opens it
        # too); the first write frees the dead bin and leaves the live one.
        reader = LocalBackend(str(tmp_path), fsync=False, recycle=True)
        assert (dead / "0-100").read_bytes() == b"x" * 100
        write(reader, "y/b", b"2" * 10)
        assert not dead.exists()
        assert os.path.isdir(live_bin)
    finally:
        live.kill()
        live.wait()
    write(LocalBackend(str(tmp_path), fsync=False, recycle=True), "z/c", b"3")
    assert not os.path.exists(live_bin)


def test_a_deleted_not_evicted_checkpoint_is_never_written_over(tmp_path):
    # Overwriting a checkpoint id, an aborted save and gc delete: a reader may still hold the
    # files, and a new save must not write into them.
    backend = LocalBackend(str(tmp_path), fsync=False, recycle=True)
    write(backend, "step-1/a.distcp", b"1" * 50_000)
    with open(tmp_path / "step-1/a.distcp", "rb") as held:
        backend.delete("step-1")
        write(backend, "step-2/a.distcp", b"2" * 50_000)
        assert bin_files(backend) == []
        assert held.read() == b"1" * 50_000
    backend.close()


def test_overwriting_a_peer_replica_under_its_id_keeps_the_old_files_intact(tmp_path):
    # The atomic commit moves the old copy aside and deletes it: no recycling there.
    from tierstore_plugins.atomic import AtomicRenameCommit
    backend = LocalBackend(str(tmp_path), fsync=False, recycle=True)
    commit = AtomicRenameCommit()
    for fill in (b"1", b"2"):
        staging = commit.begin(backend, "step-1", fill.hex())
        write(backend, f"{staging}/a.distcp", fill * 50_000)
        if fill == b"1":
            commit.commit(backend, "step-1", staging, b"{}", lambda phase: None)
            held = open(tmp_path / "step-1/a.distcp", "rb")
        else:
            commit.commit(backend, "step-1", staging, b"{}", lambda phase: None)
    with held:
        assert held.read() == b"1" * 50_000
    assert (tmp_path / "step-1/a.distcp").read_bytes() == b"2" * 50_000
    assert bin_files(backend) == []
    backend.close()


def test_a_replica_is_received_into_a_recycled_file_grown_never_cut(tmp_path):
    backend = LocalBackend(str(tmp_path), fsync=False, recycle=True)
    write(backend, "old/a", b"o" * 8192)
    write(backend, "old/big", b"o" * 1_000_000)
    backend.discard("old")
    # 10000 bytes: the 8192-byte file fits (grown); the 1 MB one would have to be cut.
    end = backend.receiving_end("new/a", 10_000)
    assert isinstance(end, MappedEnd)
    # Grown with its pages allocated, not as a hole (a full tmpfs would fault in a transfer).
    assert os.stat(tmp_path / "new/a").st_blocks * 512 >= 10_000
    end.piece(0, 4096).copy_(torch.full((4096,), 1, dtype=torch.uint8))
    end.piece(4096, 5904).copy_(torch.full((5904,), 2, dtype=torch.uint8))
    end.close(fsync=True)
    assert (tmp_path / "new/a").read_bytes() == b"\x01" * 4096 + b"\x02" * 5904
    assert bin_files(backend) == ["1-1000000"]
    # Nothing small enough left: a new file, written from the transfer's buffers.
    fresh = backend.receiving_end("new/b", 5000)
    assert isinstance(fresh, WrittenFile)
    fresh.write_at(0, torch.full((5000,), 3, dtype=torch.uint8))
    fresh.close()
    assert (tmp_path / "new/b").read_bytes() == b"\x03" * 5000
    backend.close()


def test_a_sending_end_maps_the_file_and_keeps_the_mapping(tmp_path):
    backend = LocalBackend(str(tmp_path), fsync=False, recycle=True)
    data = os.urandom(3 * 4096)
    write(backend, "step-1/a", data)
    end = backend.sending_end("step-1/a", len(data))
    assert bytes(end.piece(4096, 8192).numpy()) == data[4096:]
    again = backend.sending_end("step-1/a", len(data))
    assert again.piece(0, 1).data_ptr() == end.piece(0, 1).data_ptr()  # the same mapping
    backend.close()
    # An end handed out stays valid after the recycler let go of its mapping.
    assert bytes(end.piece(0, len(data)).numpy()) == data
    end.close()
    again.close()


def test_transfer_ends_without_recycling(tmp_path):
    data = os.urandom(2 * 4096 + 10)
    (tmp_path / "f").write_bytes(data)
    source = MappedFile(str(tmp_path / "f"), len(data))
    assert bytes(source.piece(4096, 4106).numpy()) == data[4096:]
    assert source.piece(0, 0).numel() == 0
    # A range starting anywhere (a parity chunk's piece of a file), not only at a page.
    assert bytes(source.piece(4090, 100).numpy()) == data[4090:4190]
    assert bytes(source.piece(8190, 12).numpy()) == data[8190:]
    source.close()
    with pytest.raises(OSError, match="fewer than the 99999 expected"):
        MappedFile(str(tmp_path / "f"), 99999)
    buffer = BufferTarget(len(data))
    buffer.piece(0, len(data)).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert bytes(buffer.data) == data


def test_keep_spares_a_checkpoint_while_it_is_loaded(tmp_path):
    config = {"tier": [{"name": "ram", "backend": "memory", "path": str(tmp_path / "ram"),
                        "keep": 1}]}
    sd = {"w": torch.randn(1000)}
    with tierstore.open(config) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        reader = store.reader()
        reader.reset("step-1")  # what dcp.load does first
        dcp.save({"w": torch.randn(1000)}, storage_writer=store.writer(), checkpoint_id="step-2")
        assert (tmp_path / "ram/step-1/tierstore.json").exists()  # kept: it is being loaded
        out = {"w": torch.zeros(1000)}
        dcp.load(out, storage_reader=reader, checkpoint_id="step-1")
        assert torch.equal(out["w"], sd["w"])
        dcp.save({"w": torch.randn(1000)}, storage_writer=store.writer(), checkpoint_id="step-3")
        assert [c.id for c in store.list()] == ["step-3"]


def test_a_failed_load_does_not_keep_its_checkpoint_from_eviction(tmp_path):
    config = {"tier": [{"name": "ram", "backend": "memory", "path": str(tmp_path / "ram"),
                        "keep": 1}]}
    with tierstore.open(config) as store:
        dcp.save({"w": torch.randn(1000)}, storage_writer=store.writer(), checkpoint_id="step-1")
        wrong = {"w": torch.zeros(7)}  # DCP refuses the shape after the reader's reset
        with pytest.raises(CheckpointException, match="Size mismatch"):
            dcp.load(wrong, storage_reader=store.reader(), checkpoint_id="step-1")
        gc.collect()  # the failed load's frames go with its exception
        dcp.save({"w": torch.randn(1000)}, storage_writer=store.writer(), checkpoint_id="step-2")
        assert [c.id for c in store.list()] == ["step-2"]
        assert not (tmp_path / "ram/step-1").exists()


def test_keep_spares_a_checkpoint_another_process_of_the_node_still_sends(tmp_path):
    # Ranks of a node share a {node} directory and its leader applies keep there; a rank still
    # sending a checkpoint to its peers holds the directory's shared lock (replication does).
    config = {"tier": [{"name": "ram", "backend": "memory", "path": str(tmp_path / "ram"),
                        "keep": 1}]}
    with tierstore.open(config) as store:
        dcp.save({"w": torch.randn(100)}, storage_writer=store.writer(), checkpoint_id="step-1")
        sender = subprocess.Popen(
            [sys.executable, "-c",
             "import sys; from tierstore_plugins.local import LocalBackend; "
             f"lock = LocalBackend({str(tmp_path / 'ram')!r}).lock_directory("
             "'step-1', exclusive=False); print('held', flush=True); sys.stdin.readline()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert sender.stdout.readline().strip() == "held"
            dcp.save({"w": torch.randn(100)}, storage_writer=store.writer(),
                     checkpoint_id="step-2")
            assert (tmp_path / "ram/step-1/tierstore.json").exists()  # still being sent
        finally:
            sender.communicate("done\n")
        dcp.save({"w": torch.randn(100)}, storage_writer=store.writer(), checkpoint_id="step-3")
        assert [c.id for c in store.list()] == ["step-3"]
        assert not (tmp_path / "ram/step-1").exists()


def test_a_load_released_by_the_garbage_collector_inside_retention_does_not_hang_it(tmp_path):
    # A failed load's reader lives on in a reference cycle; the collector frees it on whatever
    # thread allocates next, possibly inside keep's retention pass (forced here with collect).
    import threading
    config = {"tier": [{"name": "ram", "backend": "memory", "path": str(tmp_path / "ram"),
                        "keep": 1}]}
    with tierstore.open(config) as store:
        dcp.save({"w": torch.randn(10)}, storage_writer=store.writer(), checkpoint_id="step-1")
        gc.disable()
        try:
            reader = store.reader()
            reader.reset("step-1")
            reader.cycle = reader
            del reader
            dcp.save({"w": torch.randn(10)}, storage_writer=store.writer(),
                     checkpoint_id="step-2")
            assert (tmp_path / "ram/step-1").exists()  # still counted as loading
            tier = store._ctx.tiers[0]
            victims = tier.retention_victims
            tier.retention_victims = lambda manifests: (gc.collect(), victims(manifests))[1]
            retention = threading.Thread(target=store._retention.apply, args=(tier,),
                                         daemon=True)
            retention.start()
            retention.join(20)
            assert not retention.is_alive(), "retention hung on the load's release"
        finally:
            gc.enable()
        store._retention.apply(store._ctx.tiers[0])  # the release is counted: step-1 goes
        assert [c.id for c in store.list()] == ["step-2"]


def test_a_checkpoint_removed_by_another_process_while_keep_evicts_it_fails_nothing(tmp_path):
    # Ranks sharing a directory, or gc in another process, may remove the victim first.
    import shutil
    config = {"tier": [{"name": "ram", "backend": "memory", "path": str(tmp_path / "ram"),
                        "keep": 1}]}
    with tierstore.open(config) as store:
        dcp.save({"w": torch.randn(10)}, storage_writer=store.writer(), checkpoint_id="step-1")
        tier = store._ctx.tiers[0]
        victims = tier.retention_victims

        def removed_meanwhile(manifests):
            chosen = victims(manifests)
            for cid in chosen:
                shutil.rmtree(tmp_path / "ram" / cid)
            return chosen

        tier.retention_victims = removed_meanwhile
        sd = {"w": torch.randn(10)}
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-2")  # does not raise
        assert [c.id for c in store.list()] == ["step-2"]
        out = {"w": torch.zeros(10)}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-2")
        assert torch.equal(out["w"], sd["w"])
