"""A RAM tier's root in a place every user shares never leads its saves or evictions elsewhere.

The `memory` tier lives in `/dev/shm`, where every local user may create directories. Another
user who takes over a directory on the way to a RAM tier's root, after the store opened, could
otherwise swap the root for a symbolic link to the user's NVMe tier, and the RAM tier's
`keep = 1` would then evict the NVMe tier's checkpoints. Every directory on the way to a root
is checked each time the root is opened (each save, each eviction), by descriptors and without
following a link another user could have put there; a directory or link another user owns in a
shared place is refused with a message naming it, its owner and what to do.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore

OTHER_UID = 65534  # "nobody" on most systems: a user other than the one running the tests


def _belongs_to_other(path: Path) -> str:
    """What a refusal says of ``path`` owned by the other user (named, or by uid alone)."""
    return rf"{re.escape(str(path))} belongs to (user \S+ \()?uid {OTHER_UID}\)?, not to this user"


def _as_other_user(*argv: str) -> None:
    """Run ``argv`` as the other user (a second local user, as an attacker would be)."""
    if os.geteuid() != 0:
        pytest.skip("running a command as a second user needs root (setpriv --reuid)")
    if shutil.which("setpriv") is None:
        pytest.skip("running a command as a second user needs setpriv (util-linux)")
    subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}",
                    "--clear-groups", *argv], check=True, capture_output=True, timeout=30)


@pytest.fixture
def shared_place():
    """A directory every user may create entries in, with the sticky bit, owned by root: what
    ``/dev/shm`` is. Made in ``/dev/shm`` itself (or ``/tmp``), so that a second user can
    reach it (pytest's own temporary directories are private to the user running it)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    place = Path(base) / f"tierstore-test-shared-{uuid.uuid4().hex[:12]}"
    place.mkdir()
    place.chmod(0o1777)
    yield place
    shutil.rmtree(place, ignore_errors=True)


def _config(ram: Path, nvme: Path) -> dict:
    return {"tier": [{"name": "ram", "backend": "memory", "path": str(ram), "keep": 1},
                     {"name": "nvme", "backend": "local", "path": str(nvme)}]}


def _state(seed: int) -> dict:
    return {"w": torch.randn(20_000, generator=torch.Generator().manual_seed(seed))}


def _save_refused_or_done(store, sd: dict, checkpoint_id: str) -> str:
    """Save ``sd``; the message of the error it raised, or "" when it raised none (a store may
    also go on with its other tiers and report the one it could not use)."""
    try:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id=checkpoint_id)
        store.wait()
    except Exception as exc:  # noqa: BLE001 - the message is what the test looks at
        return str(exc)
    return ""


def _loads_bitwise(nvme: Path, checkpoint_id: str, sd: dict) -> None:
    """The checkpoint loads from the NVMe tier alone, bit for bit."""
    with tierstore.open({"tier": [{"name": "nvme", "backend": "local",
                                   "path": str(nvme)}]}) as store:
        out = {"w": torch.zeros_like(sd["w"])}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id=checkpoint_id)
    assert torch.equal(out["w"], sd["w"])


def _earlier_checkpoints(nvme: Path) -> dict[str, dict]:
    """Checkpoints an earlier run of the job left on the NVMe tier (saved there directly)."""
    states = {f"step-{i}": _state(i) for i in (1, 2)}
    with tierstore.open({"tier": [{"name": "nvme", "backend": "local",
                                   "path": str(nvme)}]}) as store:
        for checkpoint_id, sd in states.items():
            dcp.save(sd, storage_writer=store.writer(), checkpoint_id=checkpoint_id)
    return states


def test_a_ram_tier_whose_shared_parent_another_user_takes_over_never_evicts_the_nvme_tier(
        tmp_path, shared_place, caplog):
    """The whole attack, with a second user: the RAM root's parent is made, writable by
    everyone, by the other user after the open, and the RAM root is swapped for a link to the
    NVMe tier after the first save; the RAM tier keeps 1."""
    caplog.set_level(logging.WARNING, logger="tierstore")
    parent = shared_place / "tierstore"
    ram, nvme = parent / "node0", tmp_path / "nvme"
    earlier = _earlier_checkpoints(nvme)
    with tierstore.open(_config(ram, nvme)) as store:
        # After the open, before the first save: the other user makes the parent, for all.
        _as_other_user("mkdir", "-m", "0777", str(parent))
        errors = [_save_refused_or_done(store, _state(3), "step-3")]
        # After the first save: the RAM root is replaced with a link to the NVMe tier.
        _as_other_user("sh", "-c", f'mv "{ram}" "{parent}/old" 2>/dev/null; '
                                   f'ln -s "{nvme}" "{ram}"')
        assert os.path.islink(ram)
        for step in (4, 5):
            errors.append(_save_refused_or_done(store, _state(step), f"step-{step}"))

    # Every checkpoint the NVMe tier held is still there, and loads.
    assert {"step-1", "step-2"} <= set(os.listdir(nvme))
    for checkpoint_id, sd in earlier.items():
        _loads_bitwise(nvme, checkpoint_id, sd)
    # The RAM tier was refused, by a message naming the directory the other user owns.
    said = "\n".join(errors + [r.getMessage() for r in caplog.records
                               if r.name.startswith("tierstore")])
    assert re.search(_belongs_to_other(parent), said), said
    assert f"it is in {shared_place}, where every user can create entries" in said
    assert "Have it removed if it is stale, or choose a directory of your own" in said


def _give_away(path: Path) -> None:
    try:
        os.lchown(path, OTHER_UID, OTHER_UID)
    except PermissionError:
        pytest.skip("changing an entry's owner needs root")


def test_a_link_another_user_plants_where_the_ram_root_goes_is_refused_at_the_save(
        tmp_path, caplog):
    """The root is missing when the store opens; another user then puts a link to the NVMe
    tier in its place, in a directory every user can write (with the sticky bit)."""
    caplog.set_level(logging.WARNING, logger="tierstore")
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    ram, nvme = shm / "ram", tmp_path / "nvme"
    earlier = _earlier_checkpoints(nvme)
    with tierstore.open(_config(ram, nvme)) as store:
        ram.symlink_to(nvme, target_is_directory=True)
        _give_away(ram)
        errors = [_save_refused_or_done(store, _state(step), f"step-{step}") for step in (3, 4)]

    assert os.path.islink(ram)  # left as it was
    assert sorted(os.listdir(nvme)) == ["step-1", "step-2"]  # nothing written there, either
    for checkpoint_id, sd in earlier.items():
        _loads_bitwise(nvme, checkpoint_id, sd)
    said = "\n".join(errors + [r.getMessage() for r in caplog.records
                               if r.name.startswith("tierstore")])
    assert re.search(rf"{re.escape(str(ram))} is a symbolic link to {re.escape(str(nvme))} "
                     rf"and belongs to (user \S+ \()?uid {OTHER_UID}", said), said
    assert f"it is in {shm}, where every user can create entries" in said


def test_a_directory_another_user_made_where_the_root_goes_is_refused_at_the_save(tmp_path):
    """Made after the open: it is not taken for one another rank of this job made."""
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    squatted, nvme = shm / "tierstore", tmp_path / "nvme"
    with tierstore.open({"tier": [{"name": "ram", "backend": "memory",
                                   "path": str(squatted / "node0")}]}) as store:
        squatted.mkdir()
        squatted.chmod(0o777)
        _give_away(squatted)
        with pytest.raises(Exception) as info:
            dcp.save(_state(1), storage_writer=store.writer(), checkpoint_id="step-1")
            store.wait()
    message = str(info.value)
    assert re.search(_belongs_to_other(squatted), message), message
    assert "Have it removed if it is stale, or choose a directory of your own" in message
    assert os.listdir(squatted) == []  # nothing made or written in it
    assert not nvme.exists()


def test_a_directory_on_the_way_opened_to_everyone_after_the_open_is_refused_at_the_save(
        tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    with tierstore.open({"tier": [{"name": "nvme", "backend": "local",
                                   "path": str(shared / "tier")}]}) as store:
        dcp.save(_state(1), storage_writer=store.writer(), checkpoint_id="step-1")
        shared.chmod(0o777)  # chmod: not filtered by the umask
        with pytest.raises(Exception,
                           match=rf"{shared} can be written by every user and has no sticky bit"):
            dcp.save(_state(2), storage_writer=store.writer(), checkpoint_id="step-2")
            store.wait()
    assert os.listdir(shared / "tier") == ["step-1"]


def test_a_checkpoint_directory_another_user_made_in_a_sticky_root_is_not_written_into(
        tmp_path):
    """A root with the sticky bit (accepted, like /dev/shm) lets others add names: a
    checkpoint's directory made there by another user first is refused, not written into."""
    root = tmp_path / "tier"
    root.mkdir()
    root.chmod(0o1777)
    planted = root / "step-1"
    planted.mkdir()
    _give_away(planted)
    with tierstore.open({"tier": [{"name": "ram", "backend": "memory",
                                   "path": str(root)}]}) as store:
        with pytest.raises(Exception) as info:
            dcp.save(_state(1), storage_writer=store.writer(), checkpoint_id="step-1")
            store.wait()
    assert re.search(_belongs_to_other(planted), str(info.value)), str(info.value)
    assert os.listdir(planted) == []


def test_a_root_reached_through_a_link_of_this_users_own_still_works(tmp_path):
    """A configured path may go through links the user (or root) made, as /local_nvme ->
    /mnt/nvme0 does; only links another user could have planted are refused."""
    real = tmp_path / "mnt" / "nvme0"
    real.mkdir(parents=True)
    (tmp_path / "local_nvme").symlink_to(real, target_is_directory=True)
    sd = _state(1)
    config = {"tier": [{"name": "nvme", "backend": "local",
                        "path": str(tmp_path / "local_nvme" / "ckpt")}]}
    with tierstore.open(config) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
    assert os.listdir(real / "ckpt") == ["step-1"]
    _loads_bitwise(real / "ckpt", "step-1", sd)


def test_the_memory_tier_default_root_is_this_users_own():
    """/dev/shm/tierstore-<uid>: another user's RAM tier, or a directory another user made
    under the shared name, is never this user's default."""
    with tierstore.open({"tier": [{"name": "ram", "backend": "memory"}]}) as store:
        root = store._ctx.tiers[0].backend.root
    assert root == f"/dev/shm/tierstore-{os.geteuid()}/0"


def test_a_link_another_user_owns_on_the_way_to_a_root_is_never_followed(tmp_path):
    """A ``{node}`` directory that is a link belonging to another user, in a directory only
    this user (or root) can write: the link was chosen by someone else (root fooled into
    making it, a group member), so the tier is refused, and nothing is written where it
    points."""
    nodes, elsewhere = tmp_path / "local", tmp_path / "elsewhere"
    nodes.mkdir()
    elsewhere.mkdir()
    link = nodes / "0"
    link.symlink_to(elsewhere)
    _give_away(link)
    with pytest.raises(Exception) as info:
        with tierstore.open({"tier": [{"name": "local", "backend": "local",
                                       "path": str(nodes / "{node}")}]}) as store:
            dcp.save(_state(1), storage_writer=store.writer(), checkpoint_id="step-1")
            store.wait()
    message = str(info.value)
    assert f"{link} is a symbolic link to {elsewhere} and belongs to" in message, message
    assert "tierstore follows only links this user or root made" in message, message
    assert os.listdir(elsewhere) == []
