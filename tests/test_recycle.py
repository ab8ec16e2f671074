"""Page recycling on peer tiers (tierstore_plugins.recycle), the transfer ends over mapped
files, and retention sparing a checkpoint while it is loaded."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore.mapped import BufferTarget, MappedFile, WrittenFile
from tierstore_plugins.local import LocalBackend
from tierstore_plugins.recycle import RECYCLE_DIR, MappedEnd


def write(backend: LocalBackend, path: str, data: bytes) -> None:
    backend.makedirs(os.path.dirname(path))
    with backend.open_write(path) as f:
        f.write(data)


def bin_files(backend: LocalBackend) -> list[str]:
    return sorted(os.listdir(backend.recycler.bin)) if os.path.isdir(backend.recycler.bin) else []


def test_a_dropped_checkpoints_files_are_written_over_in_place(tmp_path):
    backend = LocalBackend(str(tmp_path), fsync=False, recycle=True)
    write(backend, "step-1/a.distcp", b"x" * 10_000)
    old_inode = os.stat(tmp_path / "step-1/a.distcp").st_ino
    backend.delete("step-1")
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
    backend.delete("step-1")
    backend.delete("step-2")
    assert bin_files(backend) == ["0-200", "1-300"] or bin_files(backend) == ["0-300", "1-200"]
    backend.close()
    assert bin_files(backend) == []


def test_files_this_process_did_not_write_are_deleted_not_recycled(tmp_path):
    # Ranks of a node may share a directory: another rank's file may still be mapped there.
    backend = LocalBackend(str(tmp_path), fsync=False, recycle=True)
    (tmp_path / "step-1").mkdir()
    (tmp_path / "step-1" / "other-rank.distcp").write_bytes(b"z" * 500)
    write(backend, "step-1/mine.distcp", b"m" * 400)
    backend.delete("step-1")
    assert bin_files(backend) == ["0-400"]


def test_a_dead_processs_bin_is_freed_by_the_next_one(tmp_path):
    dead = tmp_path / RECYCLE_DIR / "999999999"
    dead.mkdir(parents=True)
    (dead / "0-100").write_bytes(b"x" * 100)
    LocalBackend(str(tmp_path), fsync=False, recycle=True)
    assert not dead.exists()


def test_a_replica_is_received_into_a_recycled_file_grown_never_cut(tmp_path):
    backend = LocalBackend(str(tmp_path), fsync=False, recycle=True)
    write(backend, "old/a", b"o" * 8192)
    write(backend, "old/big", b"o" * 1_000_000)
    backend.delete("old")
    # 10000 bytes: the 8192-byte file fits (grown); the 1 MB one would have to be cut.
    end = backend.receiving_end("new/a", 10_000)
    assert isinstance(end, MappedEnd)
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
    assert again._mapping is end._mapping
    backend.close()


def test_transfer_ends_without_recycling(tmp_path):
    data = os.urandom(2 * 4096 + 10)
    (tmp_path / "f").write_bytes(data)
    source = MappedFile(str(tmp_path / "f"), len(data))
    assert bytes(source.piece(4096, 4106).numpy()) == data[4096:]
    assert source.piece(0, 0).numel() == 0
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
