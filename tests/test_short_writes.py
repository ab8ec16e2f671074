"""A backend whose files take fewer bytes than they are given (a raw file's ``write`` may, and
says so in what it returns): every byte still lands, and a file that takes none is a clear
error that loses nothing."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tierstore
from tierstore_plugins.local import LocalBackend


class _Sipping(io.RawIOBase):
    """A file that writes at most ``most`` bytes per call (0: none at all)."""

    def __init__(self, inner, most: int):
        super().__init__()
        self._inner, self._most = inner, most

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")[:self._most]
        return self._inner.write(view) if len(view) else 0

    def close(self) -> None:
        if not self.closed:
            self._inner.close()
        super().close()


def _plugin(most: dict):
    class SippingBackend(LocalBackend):
        """The local backend, its written files sipping."""

        def open_write(self, path: str):
            return _Sipping(super().open_write(path), most["bytes"])

    class Plugin:
        @tierstore.hookimpl
        def tierstore_register_backends(self, register):
            register("sipping", SippingBackend)

    return Plugin()


def test_a_file_that_takes_part_of_each_write_still_gets_every_byte(tmp_path):
    most = {"bytes": 4096 + 17}
    config = {"tier": [{"name": "disk", "backend": "sipping", "path": str(tmp_path / "d")}]}
    sd = {"big": torch.randn(512, 1024), "small": torch.arange(10), "step": 3}
    with tierstore.open(config, plugins=[_plugin(most)]) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        assert store.verify("step-1").ok
        out = {"big": torch.zeros(512, 1024), "small": torch.zeros(10, dtype=torch.long),
               "step": 0}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    assert torch.equal(out["big"], sd["big"]) and torch.equal(out["small"], sd["small"])
    assert out["step"] == 3


def test_a_file_that_takes_nothing_fails_the_save_and_keeps_the_previous_one(tmp_path):
    most = {"bytes": 1 << 30}
    config = {"tier": [{"name": "disk", "backend": "sipping", "path": str(tmp_path / "d")}]}
    sd = {"w": torch.randn(64, 64)}
    with tierstore.open(config, plugins=[_plugin(most)]) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        most["bytes"] = 0
        # (DCP wraps the writer's failure, with its message, in a CheckpointException)
        with pytest.raises(CheckpointException, match=r"took none of the \d+ bytes"):
            dcp.save({"w": sd["w"] + 1}, storage_writer=store.writer(), checkpoint_id="step-2")
        assert store.latest() == "step-1"
        out = {"w": torch.zeros(64, 64)}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    assert torch.equal(out["w"], sd["w"])
