"""tierstore.integrations.lightning: Lightning's Trainer and Fabric checkpointing through a store.

The Trainer runs for real (tests/scripts/lightning_worker.py under torchrun: 2 ranks, CPU, gloo,
a tiny MLP sharded with FSDP2, Adam): killed with SIGKILL in the middle of a save, restarted with
``ckpt_path="last"``, it ends bitwise equal to the same job run without interruption, and to the
same job with Lightning's own checkpointing. FSDP1 (FSDPStrategy) and Fabric's strategies run in
a second job. The rest is this process: the path <-> id mapping both ways, and the order of what
follows a commit (a pointer file only for a committed checkpoint, pins, release).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from helpers import run_torchrun, script_env, torchrun_command

import tierstore
from tierstore.format.ids import is_valid_checkpoint_id
from tierstore.integrations.lightning import checkpoint_id, checkpoint_path
from tierstore.integrations.lightning.checkpointing import Checkpoints, CheckpointSaveFailed
from tierstore.integrations.lightning.paths import MAX_ID_LENGTH
from tierstore.integrations.lightning.pointers import pointed_id
from tierstore.integrations.lightning.record import KEY, pack

# --------------------------------------------------------------------------- paths <-> ids

NAMES = [
    ("epoch=3-step=100.ckpt", "epoch_3D3-step_3D100"),  # Lightning's default name; ends in its step
    ("last.ckpt", "last"),
    ("last-v1.ckpt", "last-v1"),
    ("epoch=0-val_loss=0.12.ckpt", "epoch_3D0-val__loss_3D0.12"),
    ("model.pt", "model.pt_"),  # not Lightning's extension: kept whole, marked
    ("x_.ckpt", "x__"),
    ("x_", "x___"),
    (".hidden.ckpt", "_2Ehidden"),  # an id cannot start with '.'
    ("a b:c%d@e.ckpt", "a_20b_3Ac_25d_40e"),
    ("naïve-日本.ckpt", "na_C3_AFve-_E6_97_A5_E6_9C_AC"),
    (".ckpt", "_2Eckpt_"),
    ("__init__.ckpt", "____init____"),
]


@pytest.mark.parametrize("name,cid", NAMES, ids=[n for n, _ in NAMES])
def test_a_lightning_path_maps_to_a_valid_id_and_back(tmp_path, name, cid):
    path = os.path.join(tmp_path, "checkpoints", name)
    assert checkpoint_id(path) == cid
    assert is_valid_checkpoint_id(cid)  # the core's own rule
    assert checkpoint_path(cid, tmp_path / "checkpoints") == path


def test_the_id_depends_on_the_file_name_only(tmp_path):
    assert checkpoint_id("/a/b/epoch=1-step=2.ckpt") == checkpoint_id("epoch=1-step=2.ckpt")
    assert checkpoint_id(tmp_path / "last.ckpt") == "last"


@pytest.mark.parametrize("cid", ["step-100_", "_41", "a_4", "a_zz", "_", "", "a_3d", "_FF",
                                 "last_2"])
def test_an_id_the_mapping_does_not_make_is_refused(cid):
    """Every '_' of an id starts an escape; another spelling of a name (``_41`` for ``A``,
    lower-case hex), a broken escape or bytes that are not UTF-8 are not ids of this mapping."""
    if cid == "step-100_":  # but a valid one: a name without the extension
        assert checkpoint_path(cid, "/d") == "/d/step-100"
        return
    with pytest.raises(ValueError, match="not a checkpoint id that tierstore.integrations"):
        checkpoint_path(cid, "/d")


def test_a_name_whose_id_would_be_too_long_is_refused():
    assert len(checkpoint_id("a" * MAX_ID_LENGTH + ".ckpt")) == MAX_ID_LENGTH
    with pytest.raises(ValueError, match=r"makes a tierstore id of 201 characters, and at most "
                                         r"200 are allowed .*shorter ModelCheckpoint"):
        checkpoint_id("=" * 67 + ".ckpt")
    with pytest.raises(ValueError, match="no file name"):
        checkpoint_id("")


# --------------------------------------------------------------------------- after a commit

def _store_config(root, **store):
    return {"store": {"plugins": ["scripts.lightning_worker"], **store}, "tier": [
        {"name": "ram", "backend": "memory", "path": f"{root}/ram", "keep": 1},
        {"name": "disk", "backend": "local", "path": f"{root}/disk", "keep": 2},
    ]}


def _state(step):
    return {"w": torch.full((8,), float(step)), KEY: pack({"global_step": step, "loops": {}})}


def test_a_save_that_never_commits_leaves_no_pointer_and_is_never_resumed(tmp_path,
                                                                          monkeypatch):
    """The pointer file (what Lightning's directory checks and ``ckpt_path="last"`` see)
    appears only once its checkpoint committed; a save failing half-way leaves none, the next
    save raises the failure, and the newest checkpoint is still the one before."""
    dirpath = tmp_path / "checkpoints"
    paths = [str(dirpath / f"epoch=0-step={s}.ckpt") for s in (2, 4)]
    monkeypatch.setenv("LIGHTNING_WORKER_FAIL_AT", checkpoint_id(paths[1]))
    checkpoints = Checkpoints(_store_config(tmp_path))
    checkpoints.open()
    try:
        checkpoints.save(_state(2), checkpoint_id(paths[0]), paths[0], pointer=True, pin=False)
        checkpoints.settle()
        assert pointed_id(paths[0]) == "epoch_3D0-step_3D2"
        checkpoints.save(_state(4), checkpoint_id(paths[1]), paths[1], pointer=True, pin=False)
        with pytest.raises(CheckpointSaveFailed, match=r"epoch=0-step=4.ckpt \(tierstore id "
                                                       r"'epoch_3D0-step_3D4'\) was not saved"):
            checkpoints.settle()
        assert not os.path.exists(paths[1])
        assert checkpoints.latest() == "epoch_3D0-step_3D2"
        loaded = {"w": torch.zeros(8)}
        record = checkpoints.load(loaded, checkpoints.latest())
        assert record == {"global_step": 2, "loops": {}}  # an empty dict survives, unflattened
        assert torch.equal(loaded["w"], torch.full((8,), 2.0))
    finally:
        checkpoints.close()


def test_a_pinned_checkpoint_outlives_keep_until_released(tmp_path):
    """``pin``: Lightning keeps it for its score; ``keep`` (1 on RAM, 2 on disk) evicts the
    others. ``release`` (Lightning's remove_checkpoint) unpins it and removes its pointer, and
    a save released before it committed gets neither pointer nor pin; pointers of evicted
    checkpoints go at close."""
    dirpath = tmp_path / "checkpoints"
    path = {s: str(dirpath / f"step={s}.ckpt") for s in range(1, 6)}
    checkpoints = Checkpoints(_store_config(tmp_path))
    checkpoints.open()
    store = checkpoints.store
    for step in (1, 2, 3):
        checkpoints.save(_state(step), checkpoint_id(path[step]), path[step], pointer=True,
                         pin=step == 1)
    checkpoints.settle()
    store.wait()
    assert {c.id: c.pinned for c in store.list()} == {"step_3D1": True, "step_3D2": False,
                                                      "step_3D3": False}
    checkpoints.release("step_3D1", path[1], unpin=True)
    assert not os.path.exists(path[1])
    assert {c.id: c.pinned for c in store.list()}["step_3D1"] is False
    checkpoints.save(_state(4), "step_3D4", path[4], pointer=True, pin=True)
    checkpoints.release("step_3D4", path[4], unpin=True)  # before it committed, most likely
    checkpoints.save(_state(5), "step_3D5", path[5], pointer=True, pin=False)
    checkpoints.close()
    with tierstore.open(_store_config(tmp_path)) as reopened:
        held = {c.id: c.pinned for c in reopened.list()}
    assert held == {"step_3D5": False, "step_3D4": False}
    assert sorted(os.listdir(dirpath)) == ["step=5.ckpt"]  # step 4's pointer never came


def test_a_name_saved_again_without_overwrite_says_how_lightning_gets_there(tmp_path):
    """ModelCheckpoint saves last.ckpt again at every save: without ``[store] overwrite`` the
    second save fails, and the error (raised by the next call) says why and what to change."""
    checkpoints = Checkpoints({"tier": [{"name": "disk", "backend": "local",
                                         "path": str(tmp_path / "disk")}]})
    checkpoints.open()
    path = str(tmp_path / "checkpoints" / "last.ckpt")
    for step in (2, 4):
        checkpoints.save(_state(step), "last", path, pointer=True, pin=False)
    with pytest.raises(CheckpointSaveFailed, match=r"already exists.*set \[store\] overwrite = "
                                                   r"true in the tiers' config, or use "
                                                   r"ModelCheckpoint\(save_last='link'\)"):
        checkpoints.close()
    assert pointed_id(path) == "last"  # the first one's


# --------------------------------------------------------------------------- the real trainer

def _final(root, run):
    return [torch.load(root / f"{run}-rank{r}.pt") for r in range(2)]


def _assert_bitwise_equal(got, want, what):
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), f"{what}, rank {rank}: {sorted(g.keys() ^ w.keys())}"
        differ = [k for k in w if g[k].dtype != w[k].dtype or g[k].shape != w[k].shape
                  or not torch.equal(g[k].reshape(-1).view(torch.uint8),
                                     w[k].reshape(-1).view(torch.uint8))]
        assert not differ, f"{what}, rank {rank}: not bitwise equal: {differ}"
        assert any(k.endswith("exp_avg_sq") for k in w), "the optimizer's state is compared"


def _started_at(root, run):
    return json.loads((root / f"{run}-start.json").read_text())["global_step"]


def _store(root):
    return tierstore.open({"tier": [
        {"name": "ram", "backend": "memory", "path": f"{root}/ram"},
        {"name": "disk", "backend": "local", "path": f"{root}/disk"}]}, read_only=True)


# Each job takes 10 to 20 s on the 2-core machine; the limits leave room for a loaded one.
@pytest.mark.timeout(420)
def test_a_trainer_killed_mid_run_resumes_from_the_newest_checkpoint_bitwise(tmp_path):
    """8 steps, a checkpoint every 2 (``epoch=E-step=S.ckpt``, then ``last.ckpt`` again) into a
    RAM and a disk tier. Rank 1 is killed with SIGKILL while it writes ``last.ckpt`` at step 6, after
    ``epoch=2-step=6.ckpt`` committed; torchrun ends the job. Restarted with
    ``ckpt_path="last"``, the job resumes from step 6 (the store's newest complete checkpoint:
    not the last.ckpt of step 4, and not the half-written one) and ends with parameters and
    Adam state bitwise equal to the job run without interruption, which equal those of the same
    job with Lightning's own checkpointing."""
    killed = subprocess.run(torchrun_command("lightning_worker.py", tmp_path, "killed"),
                            env=script_env(), capture_output=True, text=True, timeout=200)
    report = f"--- stdout\n{killed.stdout}\n--- stderr\n{killed.stderr[-6000:]}"
    assert killed.returncode != 0 and "RANK 1 KILLED writing save 3 of last" in killed.stdout, \
        report
    assert "exitcode  : -9" in killed.stderr, report  # torchrun saw rank 1 die of SIGKILL
    with _store(tmp_path / "killed") as store:
        assert store.latest() == "epoch_3D2-step_3D6", report
    assert not (tmp_path / "killed-rank0.pt").exists()

    run_torchrun("lightning_worker.py", tmp_path, "resumed", "tierstore", "default",
                 timeout=200)
    assert _started_at(tmp_path, "resumed") == 6
    assert _started_at(tmp_path, "tierstore") == 0
    uninterrupted = _final(tmp_path, "tierstore")
    _assert_bitwise_equal(_final(tmp_path, "resumed"), uninterrupted, "killed and resumed")
    _assert_bitwise_equal(_final(tmp_path, "default"), uninterrupted,
                          "Lightning's own checkpointing")

    # The uninterrupted run: ModelCheckpoint's top-2 by train_loss is what is pinned; the
    # tiers' keep (2 on RAM, 3 on disk) removed the rest but what Lightning kept; a pointer
    # file stands for each checkpoint still held, none for what keep evicted; save_last="link"
    # saved nothing twice and links last.ckpt to the newest pointer.
    root = tmp_path / "tierstore"
    best = {checkpoint_id(p) for p in json.loads((root / "best.json").read_text())}
    with _store(root) as store:
        held = {c.id: c for c in store.list()}
    assert len(best) == 2 and best <= set(held), (best, held)
    assert {i for i, c in held.items() if c.pinned} == best
    assert "epoch_3D3-step_3D8" in held and not {"epoch_3D0-step_3D2", "last"} & set(held)
    checkpoints = root / "checkpoints"
    assert os.path.islink(checkpoints / "last.ckpt")
    assert pointed_id(checkpoints / "last.ckpt") == "epoch_3D3-step_3D8"
    pointers = {name: pointed_id(checkpoints / name) for name in os.listdir(checkpoints)
                if name != "last.ckpt"}
    assert {checkpoint_id(name) for name in pointers} == set(held)
    assert all(pointers[n] == checkpoint_id(n) for n in pointers), pointers


@pytest.mark.timeout(240)
def test_fsdp1_and_fabric_strategies_checkpoint_through_the_store(tmp_path):
    """FSDPStrategy (FSDP1, CPU): 4 steps, then resumed from "last" to 8, bitwise equal to
    Lightning's own FSDPStrategy running the 8 steps. Fabric's ModelParallelStrategy and
    FSDPStrategy: ``fabric.save`` twice, ``fabric.load`` of the newest into fresh objects gives
    the saved state back, and the rest of the state dict as it was (an empty dict, an int
    key). Every strategy refuses to gather the whole state on rank 0."""
    out = run_torchrun("lightning_worker.py", tmp_path, "fsdp1-half", "fsdp1-resumed",
                       "fsdp1-default", "fabric", "refusals", timeout=200)
    assert "MISMATCH" not in out
    assert _started_at(tmp_path, "fsdp1-resumed") == 4
    _assert_bitwise_equal(_final(tmp_path, "fsdp1-resumed"), _final(tmp_path, "fsdp1-default"),
                          "FSDP1 resumed from last against Lightning's own")
    for name in ("fabric-fsdp2", "fabric-fsdp1"):
        assert sorted(os.listdir(tmp_path / name / "checkpoints")) == ["step=2.ckpt",
                                                                      "step=4.ckpt"]
