"""A load lands the bytes it checked: a writer of the tier who changes a data file in place after
the load checked it (its digest against the manifest) and before its tensors are copied out of it
gets nothing of its own into the state dict. The load either returns the checked bytes or raises
IntegrityError with the state dict as it was.

The change is made deterministically, by a plugin on the load's ``read_file`` phase (after the
check, which runs as DCP plans the load, and before the copy): it inverts the raw bytes of a
large tensor in the file (same size, same inode: what a mapping of the file sees). The data files
are made group-writable first: the writer is someone else who may write the tier (a file only
the loading user can write is read through its mapping, as another process of that user could
change the process itself)."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore.events import Phase

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

CID = "step-1"
LARGE = 1 << 17  # floats (512 KiB): read straight into the destination


def state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    sd = {f"large{i}": torch.randn(LARGE, generator=gen) for i in range(3)}
    sd.update({f"small{i}": torch.randn(64, generator=gen) for i in range(8)})
    return sd


class RewriteAfterCheck:
    """Inverts, in place, the first tensor's raw bytes of every data file the load is about to
    read (once each), as a writer of the tier could while the load waits for its peers."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.rewritten: list[str] = []

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail):
        name = detail.get("file", "")
        if phase != Phase.READ_FILE or not name.endswith(".distcp") or name in self.rewritten:
            return
        manifest = json.loads((self.directory / "tierstore.json").read_text())
        spans = manifest["files"][name].get("spans") or []
        if not spans:
            return
        _, offset, length = spans[0]
        path = self.directory / name
        with open(path, "r+b") as f:  # the same file, its size unchanged: no new inode
            f.seek(offset)
            raw = f.read(length)
            f.seek(offset)
            f.write(bytes(b ^ 0xFF for b in raw))
        self.rewritten.append(name)


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_bytes_changed_after_the_check_never_reach_the_state_dict(tmp_path, backend):
    config = {"tier": [{"name": "t", "backend": backend, "path": str(tmp_path / "tier")}]}
    saved = state(1)
    with tierstore.open(config) as store:
        dcp.save(saved, storage_writer=store.writer(), checkpoint_id=CID)
        store.wait()
    for data_file in (tmp_path / "tier" / CID).glob("*.distcp"):
        data_file.chmod(0o664)  # a tier others (the group) may write
    hook = RewriteAfterCheck(tmp_path / "tier" / CID)
    dest = state(2)
    before = copy.deepcopy(dest)
    with tierstore.open(config, plugins=[hook]) as store:
        try:
            dcp.load(dest, storage_reader=store.reader(), checkpoint_id=CID)
            loaded = True
        except tierstore.IntegrityError:
            loaded = False
    assert hook.rewritten, "the plugin found no tensor to rewrite: the test proves nothing"
    want = saved if loaded else before
    wrong = [k for k in dest if not torch.equal(dest[k], want[k])]
    assert not wrong, (f"the load {'returned' if loaded else 'failed and left'} bytes that were "
                       f"not checked in {wrong}")
