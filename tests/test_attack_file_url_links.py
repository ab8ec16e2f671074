"""A `file://` tier (backend "fsspec") follows no link out of its root, and trusts no root
another user owns, just as a `local` tier.

Whoever can write the directory of a `file://` tier could otherwise plant a checkpoint there
as a symbolic link to the `local` tier's copy: the `file://` tier's `keep` would delete the
`local` tier's manifest through the link, and the checkpoint would load from nowhere. Every
file and directory below a `file://` root is reached as the `local` backend reaches its own
(plugins/safe_fs.py): a link is reported, removed itself when deleted, never followed.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore.plugin import MANIFEST_NAME

OTHER_UID = 65534  # "nobody" on most systems: a user other than the one running the tests


def _config(tmp_path: Path, keep: int | None = None) -> dict:
    objects = {"name": "objects", "backend": "fsspec", "url": f"file://{tmp_path}/objects"}
    if keep is not None:
        objects["keep"] = keep
    return {"tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")},
                     objects]}


def _state(seed: int) -> dict:
    return {"w": torch.randn(30_000, generator=torch.Generator().manual_seed(seed))}


def _save(store, checkpoint_id: str, sd: dict) -> None:
    dcp.save(sd, storage_writer=store.writer(), checkpoint_id=checkpoint_id)
    store.wait()


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``, links not followed: its kind, size and bytes."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            data = Path(path).read_bytes() if stat.S_ISREG(st.st_mode) else None
            out[os.path.relpath(path, root)] = (stat.S_IFMT(st.st_mode), st.st_size, data)
    return out


def _loads_bitwise_from_nvme(tmp_path: Path, checkpoint_id: str, sd: dict) -> None:
    with tierstore.open({"tier": [{"name": "nvme", "backend": "local",
                                   "path": str(tmp_path / "nvme")}]}) as store:
        out = {"w": torch.zeros_like(sd["w"])}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id=checkpoint_id)
    assert torch.equal(out["w"], sd["w"])


def _said(caplog, errors: list[str]) -> str:
    return "\n".join(errors + [r.getMessage() for r in caplog.records
                               if r.name.startswith("tierstore")])


def test_a_checkpoint_planted_as_a_link_in_a_file_url_tier_is_not_evicted_through(
        tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="tierstore")
    nvme, objects = tmp_path / "nvme", tmp_path / "objects"
    sd1 = _state(1)
    with tierstore.open(_config(tmp_path)) as store:
        _save(store, "step-1", sd1)
    assert (objects / "step-1" / MANIFEST_NAME).is_file()
    # Someone who can write the file:// tier swaps its step-1 for a link to the NVMe copy.
    shutil.rmtree(objects / "step-1")
    (objects / "step-1").symlink_to(nvme / "step-1", target_is_directory=True)
    before = snapshot(nvme / "step-1")

    errors = []
    with tierstore.open(_config(tmp_path, keep=1)) as store:
        for step in (2, 3):  # keep = 1 on the file:// tier: step-1 (the link) is evicted
            try:
                _save(store, f"step-{step}", _state(step))
            except Exception as exc:  # noqa: BLE001 - the message is what is checked
                errors.append(str(exc))

    assert (nvme / "step-1" / MANIFEST_NAME).is_file()
    assert snapshot(nvme / "step-1") == before
    _loads_bitwise_from_nvme(tmp_path, "step-1", sd1)
    said = _said(caplog, errors)
    assert f"{objects}/step-1 -> {nvme}/step-1" in said, said
    assert "tierstore never follows a link in a tier" in said


def test_a_checkpoint_id_planted_as_a_link_before_its_save_is_never_written_through(tmp_path):
    """The next id planted ahead as a link to the NVMe tier's copy of an earlier checkpoint:
    the copy to the file:// tier is refused, naming the link, and nothing is written or
    deleted through it."""
    nvme, objects = tmp_path / "nvme", tmp_path / "objects"
    sd1, sd2 = _state(1), _state(2)
    with tierstore.open(_config(tmp_path)) as store:
        _save(store, "step-1", sd1)
        (objects / "step-2").symlink_to(nvme / "step-1", target_is_directory=True)
        before = snapshot(nvme / "step-1")
        with pytest.raises(tierstore.TierstoreError) as info:
            _save(store, "step-2", sd2)
        assert [(c.id, c.tiers) for c in store.list()] == [("step-2", ["nvme"]),
                                                           ("step-1", ["nvme", "objects"])]
    message = str(info.value)
    assert f"checkpoint 'step-2' was not copied to tier 'objects'" in message
    assert f"({objects}/step-2 -> {nvme}/step-1, that is {nvme}/step-1)" in message
    assert "Remove the link" in message
    assert snapshot(nvme / "step-1") == before
    assert (objects / "step-2").is_symlink()
    _loads_bitwise_from_nvme(tmp_path, "step-1", sd1)
    _loads_bitwise_from_nvme(tmp_path, "step-2", sd2)


def test_a_file_url_tier_root_another_user_owns_is_refused_at_open(tmp_path):
    root = tmp_path / "objects"
    root.mkdir()
    try:
        os.chown(root, OTHER_UID, OTHER_UID)
    except PermissionError:
        pytest.skip("changing a directory's owner needs root")
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.open({"tier": [{"name": "objects", "backend": "fsspec",
                                  "url": f"file://{root}"}]})
    message = str(info.value)
    assert f"{root} belongs to" in message and f"(uid {OTHER_UID}), not to this user" in message
    assert "use a directory of your own" in message
    assert os.listdir(root) == []
