"""A drain whose source is saved again under the same id while it copies (``overwrite = true``,
as Lightning's ``last.ckpt`` is at every save) gives way to the newer save's drain: ``wait()``
raises nothing and the slower tier ends with the newer save, bitwise."""

from __future__ import annotations

import threading

import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore.events import Phase


class _HoldFirstCopy:
    """Stops the first drain of ``ck`` to 'disk' at its first file, before it opens it, until
    released."""

    def __init__(self):
        self.reached, self.release = threading.Event(), threading.Event()
        self._done = False

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail):
        if phase == Phase.DRAIN_FILE and tier == "disk" and not self._done:
            self._done = True
            self.reached.set()
            assert self.release.wait(60)


def test_a_drain_whose_source_is_saved_again_gives_way_to_the_newer_save(tmp_path):
    hold = _HoldFirstCopy()
    config = {"store": {"overwrite": True}, "tier": [
        {"name": "ram", "backend": "memory", "path": str(tmp_path / "ram")},
        {"name": "disk", "backend": "local", "path": str(tmp_path / "disk")}]}
    first, second = {"w": torch.zeros(256, 256)}, {"w": torch.ones(256, 256)}
    with tierstore.open(config, plugins=[hold]) as store:
        dcp.save(first, storage_writer=store.writer(), checkpoint_id="ck")
        assert hold.reached.wait(60)
        # While the first drain waits before opening its file, the same id is saved again.
        saver = threading.Thread(target=lambda: dcp.save(
            second, storage_writer=store.writer(), checkpoint_id="ck"))
        saver.start()
        saver.join(5)  # (the new save's commit on RAM does not wait for the old drain)
        hold.release.set()
        saver.join(60)
        store.wait()  # raises the first drain failure, if any
        info = next(i for i in store.list() if i.id == "ck")
        assert sorted(info.tiers) == ["disk", "ram"]
    with tierstore.open({"tier": [config["tier"][1]]}) as disk_only:
        got = {"w": torch.full((256, 256), 7.0)}
        dcp.load(got, storage_reader=disk_only.reader(), checkpoint_id="ck")
    assert torch.equal(got["w"], second["w"])
