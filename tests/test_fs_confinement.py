"""No path outside a tier's root, even through a symbolic link or another user.

A `local`, `memory` or `peer` tier reaches everything below its root from the root's descriptor
without following a link (plugins/safe_fs.py): a `.recycle` bin, a bin entry, a checkpoint
directory or a file swapped for a link never sends a write or a delete outside the tier, and a
link is never read as data. A root another user owns, or could write, is refused when the store
opens (plugins/ownership.py). Every test here compares a snapshot of what lies outside the tier
before and after (names, sizes, bytes, modification times).
"""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tierstore
from tierstore.plugin.host import build_plugin_host
from tierstore_plugins.atomic import AtomicRenameCommit
from tierstore_plugins.local import LocalBackend
from tierstore_plugins.recycle import RECYCLE_DIR

OTHER_UID = 65534  # "nobody" on most systems: a user other than the one running the tests


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` and ``root`` itself, links not followed: its kind, size and
    modification time, and a file's bytes."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in [".", *dirs, *files] if dirpath == str(root) else [*dirs, *files]:
            path = os.path.normpath(os.path.join(dirpath, name))
            st = os.lstat(path)
            data = Path(path).read_bytes() if stat.S_ISREG(st.st_mode) else None
            out[os.path.relpath(path, root)] = (stat.S_IFMT(st.st_mode), st.st_size,
                                                st.st_mtime_ns, data)
    return out


def outside_tree(tmp_path: Path) -> Path:
    """A directory beside the tiers holding directories (one named like an unlocked recycle
    bin, with a file named like a recycled one) and files."""
    outside = tmp_path / "outside"
    (outside / "4242-deadbeef").mkdir(parents=True)
    (outside / "4242-deadbeef" / "0-8192").write_bytes(os.urandom(8192))
    (outside / "work" / "nested").mkdir(parents=True)
    (outside / "work" / "notes.txt").write_text("the user's own notes\n")
    (outside / "work" / "nested" / "weights.bin").write_bytes(os.urandom(100_000))
    return outside


def peer_backend(root: Path):
    """The `peer` backend of a tier at ``root``, built the way opening a store builds it (its
    recycler frees dead bins right then)."""
    reg = build_plugin_host().lookup("backend", "peer")
    return reg.factory(root=str(root), path=str(root),
                       replication={"strategy": "clique", "factor": 2})


def save(backend, checkpoint_id: str, files: dict[str, bytes]) -> None:
    """A save as the tier makes it: staging directory, files, manifest, rename into place."""
    commit = AtomicRenameCommit()
    staging = commit.begin(backend, checkpoint_id, uuid.uuid4().hex[:12])
    for name, data in files.items():
        with backend.open_write(f"{staging}/{name}") as f:
            f.write(data)
    commit.commit(backend, checkpoint_id, staging, b"{}", lambda phase: None)


def files(seed: int) -> dict[str, bytes]:
    gen = torch.Generator().manual_seed(seed)
    return {"__0_0.distcp": bytes(torch.randint(0, 256, (300_000,), generator=gen,
                                                dtype=torch.uint8).numpy()),
            "__0_1.distcp": bytes(torch.randint(0, 256, (70_000,), generator=gen,
                                                dtype=torch.uint8).numpy())}


# -- the peer tier's recycle bin ---------------------------------------------------------------

def test_a_recycle_bin_that_is_a_link_out_of_the_tier_is_neither_emptied_nor_filled(tmp_path):
    outside = outside_tree(tmp_path)
    root = tmp_path / "peer"
    root.mkdir()
    (root / RECYCLE_DIR).symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)

    backend = peer_backend(root)  # frees the bins no live process holds: none of these
    assert snapshot(outside) == before
    save(backend, "step-1", files(1))
    save(backend, "step-2", files(2))
    backend.discard("step-1")  # what keep does: its files would go to the bin
    save(backend, "step-3", files(3))
    backend.close()  # frees the bin

    assert snapshot(outside) == before
    assert (root / RECYCLE_DIR).is_symlink()  # left as it was, not replaced or followed
    assert sorted(backend.list("")) == ["step-2", "step-3"]
    for name, data in files(3).items():
        assert (root / "step-3" / name).read_bytes() == data


def test_replicas_directory_that_is_a_link_out_of_the_tier_is_refused(tmp_path):
    outside = outside_tree(tmp_path)
    root = tmp_path / "peer"
    root.mkdir()
    (root / ".replicas").symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)

    replicas = peer_backend(root).replica_backend(1, 0)  # where rank 0 keeps rank 1's files
    with pytest.raises(tierstore.IntegrityError,
                       match=r"refusing .*/\.replicas/1-held-by-0: a symbolic link leads it out "
                             r"of the tier's root"):
        replicas.makedirs("step-1")
    with pytest.raises(tierstore.IntegrityError, match="symbolic link"):
        replicas.receiving_end("step-1/__1_0.distcp", 4096)
    replicas.close()
    assert snapshot(outside) == before


@pytest.mark.parametrize("how", ["symbolic link", "hard link"])
@pytest.mark.parametrize("written_by", ["save", "replica received"])
def test_a_bin_entry_swapped_for_a_link_to_an_outside_file_is_never_written_into(
        tmp_path, how, written_by):
    outside = outside_tree(tmp_path)
    victim = outside / "work" / "nested" / "weights.bin"
    root = tmp_path / "peer"
    backend = peer_backend(root)
    save(backend, "step-1", files(1))
    backend.discard("step-1")  # its files are kept in this process's bin for the next save
    binned = sorted(root.glob(f"{RECYCLE_DIR}/*/*"))
    assert len(binned) == 2
    for entry in binned:  # another process puts links in their place
        entry.unlink()
        if how == "symbolic link":
            entry.symlink_to(victim)
        else:
            os.link(victim, entry)
    before = snapshot(outside)

    new = files(2)
    if written_by == "save":
        save(backend, "step-2", new)
        path = "step-2"
    else:
        path = "incoming"
        backend.makedirs(path)
        for name, data in new.items():
            end = backend.receiving_end(f"{path}/{name}", len(data))
            if end.in_place:
                end.piece(0, len(data)).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            else:
                end.write_at(0, torch.frombuffer(bytearray(data), dtype=torch.uint8))
            end.close(fsync=True)
    for name, data in new.items():
        assert backend.read_bytes(f"{path}/{name}") == data
        assert not (root / path / name).is_symlink()
    backend.close()

    assert snapshot(outside) == before
    assert victim.stat().st_nlink == 1  # the bin's hard link went with the bin


# -- whose root --------------------------------------------------------------------------------

def _tier(backend: str, path: Path) -> dict:
    tier = {"name": "t", "backend": backend, "path": str(path)}
    if backend == "peer":
        tier["replication"] = {"strategy": "clique", "factor": 2}
    return {"tier": [tier]}


def _give_away(path: Path) -> None:
    try:
        os.chown(path, OTHER_UID, OTHER_UID)
    except PermissionError:
        pytest.skip("changing a directory's owner needs root")


@pytest.mark.parametrize("backend", ["local", "memory", "peer"])
def test_a_tier_root_another_user_owns_is_refused_at_open(tmp_path, backend):
    root = tmp_path / "tier"
    root.mkdir()
    _give_away(root)
    before = snapshot(root)
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.open(_tier(backend, root))
    message = str(info.value)
    assert f"tier 't': path '{root}' cannot be used" in message
    assert f"{root} belongs to" in message and f"(uid {OTHER_UID}), not to this user" in message
    assert "use a directory of your own" in message
    assert snapshot(root) == before


@pytest.mark.parametrize("mode", [0o777, 0o757])
def test_a_tier_root_every_user_can_write_is_refused_at_open(tmp_path, mode):
    root = tmp_path / "tier"
    root.mkdir()
    root.chmod(mode)  # chmod: not filtered by the umask
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.open(_tier("local", root))
    message = str(info.value)
    assert f"{root} (mode {mode:04o}) can be written by every user" in message
    assert f"run chmod o-w {root}" in message
    assert os.listdir(root) == []


def test_a_tier_root_only_its_group_can_write_is_accepted(tmp_path):
    """User private groups (umask 002) make every directory group-writable: the group is the
    user, and refusing it would refuse most roots made by hand on such systems."""
    root = tmp_path / "tier"
    root.mkdir()
    root.chmod(0o775)
    with tierstore.open(_tier("local", root)) as store:
        assert store.latest() is None


def test_a_tier_root_with_the_sticky_bit_like_dev_shm_is_accepted(tmp_path):
    # Others may add names there but never rename or remove the store's.
    root = tmp_path / "tier"
    root.mkdir()
    root.chmod(0o1777)
    with tierstore.open(_tier("memory", root)) as store:
        dcp.save({"w": torch.arange(10)}, storage_writer=store.writer(), checkpoint_id="step-1")
        assert [c.id for c in store.list()] == ["step-1"]


def test_a_directory_another_user_made_in_a_shared_place_is_refused_at_open(tmp_path):
    # /dev/shm stand-in: every user may create entries, the sticky bit protects them.
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    squatted = shm / "tierstore-peer"  # made by another user before the job
    squatted.mkdir()
    squatted.chmod(0o777)
    _give_away(squatted)
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.open(_tier("peer", squatted / "{node}"))
    message = str(info.value)
    assert f"{squatted} belongs to" in message and f"(uid {OTHER_UID})" in message
    assert f"it is in {shm}, where every user can create entries" in message
    assert os.listdir(squatted) == []  # no {node} directory made in it


def test_a_parent_everyone_can_write_without_the_sticky_bit_is_refused_at_open(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(tierstore.ConfigError,
                       match=rf"{shared} can be written by every user and has no sticky bit"):
        tierstore.open(_tier("local", shared / "tier"))
    assert os.listdir(shared) == []


def test_the_tier_root_made_by_the_store_is_written_by_its_owner_only(tmp_path):
    # Even under a umask that leaves directories group-writable (user private groups).
    root = tmp_path / "made" / "tier"
    umask = os.umask(0o002)
    try:
        with tierstore.open(_tier("local", root)) as store:
            dcp.save({"w": torch.arange(10)}, storage_writer=store.writer(),
                     checkpoint_id="step-1")
    finally:
        os.umask(umask)
    for directory in (root.parent, root, root / "step-1"):
        assert directory.stat().st_uid == os.geteuid()
        assert not directory.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def test_a_root_given_away_after_the_open_is_refused_when_used(tmp_path):
    root = tmp_path / "tier"
    backend = LocalBackend(str(root))
    backend.makedirs("step-1")
    _give_away(root)
    with pytest.raises(PermissionError, match=rf"refusing the tier root {root}: .*belongs to"):
        backend.open_write("step-1/a.distcp")
    assert os.listdir(root) == ["step-1"] and os.listdir(root / "step-1") == []


# -- links inside a local tier -----------------------------------------------------------------

def _local(tmp_path: Path, keep: int | None = None, overwrite: bool = False) -> dict:
    tier = {"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")}
    if keep is not None:
        tier["keep"] = keep
    return {"store": {"overwrite": overwrite}, "tier": [tier]}


def _save(store, checkpoint_id: str, seed: int) -> dict:
    sd = {"w": torch.randn(50_000, generator=torch.Generator().manual_seed(seed))}
    dcp.save(sd, storage_writer=store.writer(), checkpoint_id=checkpoint_id)
    return sd


def test_a_checkpoint_directory_linked_out_of_the_tier_is_neither_read_nor_deleted(tmp_path):
    tier = tmp_path / "nvme"
    with tierstore.open(_local(tmp_path)) as store:
        _save(store, "step-1", 1)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.replace(tier / "step-1", outside / "step-1")  # a whole checkpoint, moved out
    (tier / "step-1").symlink_to(outside / "step-1", target_is_directory=True)
    (tier / ".tierstore-trash.step-0.feedface").symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)

    with tierstore.open(_local(tmp_path, keep=1)) as store:
        assert store.list() == []  # the link is no checkpoint of this tier
        assert store.gc() == ["nvme:.tierstore-trash.step-0.feedface"]  # the link, not its target
        with pytest.raises(tierstore.IntegrityError,
                           match="'step-1' has no copy to trust: .* a symbolic link leads it out"):
            dcp.load({"w": torch.zeros(50_000)}, storage_reader=store.reader(),
                     checkpoint_id="step-1")
        _save(store, "step-2", 2)
        _save(store, "step-3", 3)  # keep = 1 evicts step-2
        assert [c.id for c in store.list()] == ["step-3"]

    assert snapshot(outside) == before
    assert sorted(os.listdir(tier)) == ["step-1", "step-3"]


def test_a_data_file_linked_inside_the_tier_is_not_read_and_its_target_not_deleted(tmp_path):
    tier = tmp_path / "nvme"
    with tierstore.open(_local(tmp_path, overwrite=True)) as store:
        sd = _save(store, "step-1", 1)
        (data_file,) = (tier / "step-1").glob("*.distcp")
        # The same bytes elsewhere in the tier (a user's own copy): the checksum would match,
        # and the link does not even leave the root; a link is still no copy of the file.
        mine = tier / "mine"
        mine.mkdir()
        os.replace(data_file, mine / "copy.distcp")
        data_file.symlink_to(mine / "copy.distcp")
        before = snapshot(mine)

        report = store.verify("step-1")
        assert not report.ok and "is a symbolic link" in str(report)
        with pytest.raises((tierstore.TierstoreError, CheckpointException),
                           match="is a symbolic link"):
            dcp.load({"w": torch.zeros_like(sd["w"])}, storage_reader=store.reader(),
                     checkpoint_id="step-1")
        # Saved again under its id: the old directory, link and all, is moved aside and
        # deleted.
        sd = _save(store, "step-1", 2)
        assert not (tier / "step-1" / data_file.name).is_symlink()
        out = {"w": torch.zeros_like(sd["w"])}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
        assert torch.equal(out["w"], sd["w"])

    assert snapshot(mine) == before
    assert sorted(os.listdir(tier)) == ["mine", "step-1"]
