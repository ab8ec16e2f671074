"""A write that failed part-way never reaches another file later.

When a data file's write fails (a full tier, an unreadable or unpicklable value), the save's
``HashingWriter`` may still hold small records it gathered and has not handed to the backend
file yet, and the backend file is closed by the ``with`` around the write. The exception's
traceback keeps the writer alive (the frame that caught it holds the exception, a reference
cycle), so it is freed by Python's cyclic garbage collector: later, at any allocation, in any
thread. Its finalizer (``IOBase.__del__`` -> ``close`` -> ``flush``) then handed the gathered
bytes to the closed backend file, which wrote them to its old descriptor *number*: by then the
number of another file, the lowest free one, such as the next save's data file on the same
tier. That file then held bytes its manifest never hashed, after a save that returned without
error; nothing but a later read (a drain, a load, ``verify``) noticed.

The tests force the interleaving that the garbage collector makes by chance: automatic
collection is off, and the collection runs at a chosen point while the other file is open.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

import tierstore
from helpers import assert_state_dicts_equal, load_like, script_env
from tierstore.format.item_io import HashingWriter
from tierstore_plugins.local import MemoryBackend


@pytest.fixture
def no_automatic_gc():
    """Collections run only where a test calls ``gc.collect()``."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _fail_half_way(backend: MemoryBackend, path: str) -> OSError:
    """Write a small record (gathered, not written yet) into ``path``, then fail as a full tier
    would; returns the error, kept as a caller keeps it (its traceback holds the writer)."""
    try:
        with backend.open_write(path) as raw:
            out = HashingWriter(raw)
            out.write(b"x" * 1000)
            raise OSError(28, "No space left on device (injected)")
    except OSError as exc:
        return exc


def test_an_abandoned_writer_never_writes_into_the_file_that_took_its_descriptor(
        tmp_path, no_automatic_gc):
    backend = MemoryBackend(str(tmp_path), str(tmp_path))
    backend.makedirs("step-1")
    backend.makedirs("step-2")
    held = _fail_half_way(backend, "step-1/__0_0.distcp")
    # The next file opened takes the lowest free descriptor: the one the failed file released.
    with backend.open_write("step-2/__0_0.distcp") as other:
        other.write(b"y" * 10)
        del held
        gc.collect()  # the failed write's writer goes now, while the other file is open
        other.write(b"z" * 10)
    assert (tmp_path / "step-2/__0_0.distcp").read_bytes() == b"y" * 10 + b"z" * 10


def test_a_backend_file_refuses_writes_once_closed(tmp_path):
    """What a late writer (a codec stream's or a serializer's finalizer) hands a closed file is
    refused, never written to a descriptor number the file gave back."""
    backend = MemoryBackend(str(tmp_path), str(tmp_path))
    backend.makedirs("d")
    f = backend.open_write("d/a")
    f.write(b"a")
    f.close()
    with pytest.raises(ValueError, match="closed"):
        f.write(b"late")
    assert (tmp_path / "d/a").read_bytes() == b"a"


_ABANDONED_TORCH_WRITER = textwrap.dedent("""
    import gc, io, torch
    from tierstore.format.item_io import HashingWriter
    from tierstore.format.tensor_records import save_tensor

    class Sink(io.RawIOBase):
        def writable(self):
            return True
        def write(self, data):
            return memoryview(data).nbytes

    gc.disable()
    out = HashingWriter(Sink())
    tensor = torch.randn(1 << 20)
    tensor.note = lambda: 0  # its pickling fails inside torch's serializer
    try:
        save_tensor(tensor, out)
    except Exception as exc:
        held = exc  # holds torch's zip writer, never finished
    out.close()
    del held
    gc.collect()  # the zip writer's destructor writes the archive's end into a closed writer
    print("SURVIVED")
""")


def test_a_serializer_abandoned_half_way_finishes_into_a_closed_writer_without_aborting():
    """torch's zip writer, left unfinished by a failed save, writes its archive's end from its
    destructor whenever it is freed; a closed writer refuses those bytes (above), and the
    refusal must never reach the C++ destructor, which would abort the process."""
    out = subprocess.run([sys.executable, "-c", _ABANDONED_TORCH_WRITER], env=script_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "SURVIVED" in out.stdout, out.stderr[-3000:]


class _Planner(DefaultSavePlanner):
    """Resolves items as DCP's planner does; ``fail_on`` raises for that item (a value that
    cannot be read: any failure in the middle of a data file), ``collect`` runs the garbage
    collector before each item (while the data file is open)."""

    def __init__(self, *, fail_on: str | None = None, collect: bool = False):
        super().__init__()
        self.fail_on, self.collect = fail_on, collect

    def resolve_data(self, write_item):
        if self.collect:
            gc.collect()
        if write_item.index.fqn == self.fail_on:
            raise OSError(5, f"cannot read {write_item.index.fqn} (injected)")
        return super().resolve_data(write_item)


def _state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    # Small tensors: their records are gathered in the writer before they reach the file.
    return {f"t{i}": torch.randn(1000, generator=gen) for i in range(4)}


def test_a_failed_save_leaves_nothing_that_later_changes_the_next_save(
        tmp_path, no_automatic_gc):
    config = {"store": {"io_threads": 1}, "tier": [
        {"name": "ram", "backend": "memory", "path": str(tmp_path / "ram"), "keep": 3},
        {"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")}]}
    with tierstore.open(config) as store:
        with pytest.raises(CheckpointException):
            dcp.save(_state(1), storage_writer=store.writer(), checkpoint_id="step-1",
                     planner=_Planner(fail_on="t2"))
        dcp.save(_state(2), storage_writer=store.writer(), checkpoint_id="step-2",
                 planner=_Planner(collect=True))
        store.wait()  # the drain reads the RAM copy, checking every byte against its manifest
        report = store.verify("step-2")
        assert report.ok, report
        assert_state_dicts_equal(load_like(store, "step-2", _state(2)), _state(2))
    names = os.listdir(tmp_path / "ram" / "step-2")
    assert "__0_0.distcp" in names
