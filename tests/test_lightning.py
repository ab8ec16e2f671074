"""tierstore.integrations.lightning: Lightning's Trainer and Fabric checkpointing through a store.

The Trainer runs for real (tests/scripts/lightning_worker.py under torchrun: 2 ranks, CPU, gloo,
a tiny MLP sharded with FSDP2, Adam): ``lightning.pytorch``'s, killed with SIGKILL in the middle
of a save, restarted with ``ckpt_path="last"``, ends bitwise equal to the same job run without
interruption, and to the same job with Lightning's own checkpointing. A second job runs
``pytorch_lightning``'s Trainer (stopped half-way and resumed, bitwise, with the names code
written for it imports), FSDP1 (FSDPStrategy, saved under ``pytorch_lightning`` and resumed under
``lightning.pytorch``) and Fabric's strategies under both packages. The rest is this process:
the path <-> id mapping both ways, and the order of what follows a commit (a pointer file only
for a committed checkpoint, pins, release), what the strategies decide from paths (which
checkpoint a path loads, ``ckpt_path="last"`` in a store several runs share, which removal
unpins), with Lightning's callbacks but no Trainer, and which strategy classes each package's
Trainer and Fabric take.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from importlib import import_module

import pytest
import torch
from helpers import run_torchrun, script_env, torchrun_command

import tierstore
from tierstore.format.ids import is_valid_checkpoint_id
from tierstore.integrations.lightning import checkpoint_id, checkpoint_path
from tierstore.integrations.lightning.checkpointing import Checkpoints, CheckpointSaveFailed
from tierstore.errors import CheckpointNotFound
from tierstore.integrations.lightning.paths import MAX_ID_LENGTH, directory_digest
from tierstore.integrations.lightning.pointers import pointed_id, write_pointer
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


@pytest.mark.parametrize("name,escaped", NAMES, ids=[n for n, _ in NAMES])
def test_a_lightning_path_maps_to_a_valid_id_and_back(tmp_path, name, escaped):
    """The id is the directory's digest, ``_.``, and the file name escaped."""
    path = os.path.join(tmp_path, "checkpoints", name)
    cid = checkpoint_id(path)
    assert cid == f"{directory_digest(tmp_path / 'checkpoints')}_.{escaped}"
    assert re.fullmatch(r"[0-9a-f]{12}_\..+", cid)
    assert is_valid_checkpoint_id(cid)  # the core's own rule
    assert checkpoint_path(cid, tmp_path / "checkpoints") == path
    # An id of the rule before (the name alone) still reads, in any directory.
    assert checkpoint_path(escaped, tmp_path / "old") == os.path.join(tmp_path, "old", name)


def test_the_id_depends_on_the_whole_path_and_keeps_the_step(tmp_path, monkeypatch):
    """Two directories, one file name: two ids; the step stays last, for ``every``; a
    relative path is the same file as its absolute one."""
    one = checkpoint_id("/a/b/epoch=1-step=20.ckpt")
    two = checkpoint_id("/a/c/epoch=1-step=20.ckpt")
    assert one != two and one.endswith("-step_3D20") and two.endswith("-step_3D20")
    monkeypatch.chdir(tmp_path)
    assert checkpoint_id("checkpoints/last.ckpt") == checkpoint_id(tmp_path / "checkpoints"
                                                                    / "last.ckpt")
    with pytest.raises(ValueError, match="saved in another directory"):
        checkpoint_path(one, "/a/c")


@pytest.mark.parametrize("cid", ["step-100_", "_41", "a_4", "a_zz", "_", "", "a_3d", "_FF",
                                 "last_2", "0123456789ab_.", "0123456789ab_._41",
                                 "0123456789AB_.last"])
def test_an_id_the_mapping_does_not_make_is_refused(cid):
    """Every '_' of a name's part starts an escape; another spelling of a name (``_41`` for
    ``A``, lower-case hex), a broken escape or bytes that are not UTF-8 are not ids of this
    mapping (a digest in upper case is no digest: the whole id is read as a name's part)."""
    if cid == "step-100_":  # but a valid one: a name without the extension
        assert checkpoint_path(cid, "/d") == "/d/step-100"
        return
    with pytest.raises(ValueError, match="not a checkpoint id that tierstore.integrations"):
        checkpoint_path(cid, "/d")


def test_a_name_whose_id_would_be_too_long_is_refused():
    room = MAX_ID_LENGTH - len(checkpoint_id("/d/x.ckpt")) + 1  # 14: the digest and '_.'
    assert len(checkpoint_id("/d/" + "a" * room + ".ckpt")) == MAX_ID_LENGTH
    with pytest.raises(ValueError, match=r"makes a tierstore id of 203 characters, and at most "
                                         r"200 are allowed .*shorter ModelCheckpoint"):
        checkpoint_id("/d/" + "=" * 63 + ".ckpt")
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
    ids = [checkpoint_id(p) for p in paths]
    monkeypatch.setenv("LIGHTNING_WORKER_FAIL_AT", ids[1])
    checkpoints = Checkpoints(_store_config(tmp_path))
    checkpoints.open()
    try:
        checkpoints.save(_state(2), ids[0], paths[0], pointer=True, pin=False)
        checkpoints.settle()
        assert pointed_id(paths[0]) == ids[0]
        checkpoints.save(_state(4), ids[1], paths[1], pointer=True, pin=False)
        with pytest.raises(CheckpointSaveFailed, match=rf"epoch=0-step=4.ckpt \(tierstore id "
                                                       rf"'{ids[1]}'\) was not saved"):
            checkpoints.settle()
        assert not os.path.exists(paths[1])
        assert checkpoints.latest() == ids[0]
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
    cid = {s: checkpoint_id(p) for s, p in path.items()}
    checkpoints = Checkpoints(_store_config(tmp_path))
    checkpoints.open()
    store = checkpoints.store
    for step in (1, 2, 3):
        checkpoints.save(_state(step), cid[step], path[step], pointer=True, pin=step == 1)
    checkpoints.settle()
    store.wait()
    assert {c.id: c.pinned for c in store.list()} == {cid[1]: True, cid[2]: False,
                                                      cid[3]: False}
    checkpoints.release(cid[1], path[1], unpin=True)
    assert not os.path.exists(path[1])
    assert {c.id: c.pinned for c in store.list()}[cid[1]] is False
    checkpoints.save(_state(4), cid[4], path[4], pointer=True, pin=True)
    checkpoints.release(cid[4], path[4], unpin=True)  # before it committed, most likely
    checkpoints.save(_state(5), cid[5], path[5], pointer=True, pin=False)
    checkpoints.close()
    with tierstore.open(_store_config(tmp_path)) as reopened:
        held = {c.id: c.pinned for c in reopened.list()}
    assert held == {cid[5]: False, cid[4]: False}
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


# --------------------------------------------------------------------------- what a path stands for

# Lightning's Trainer package -> the module tierstore's strategies for it are imported from (for
# pytorch_lightning, the module that held them first: what code written for it imports)
TRAINER_MODULES = {"lightning.pytorch": "tierstore.integrations.lightning.pytorch",
                   "pytorch_lightning": "tierstore.integrations.lightning.trainer"}


@pytest.fixture(params=sorted(TRAINER_MODULES))
def trainer_strategy(tmp_path, request):
    """tierstore's ModelParallelStrategy for the Trainer of each package, without a Trainer:
    what the Trainer would give it is set by hand. A monitored ModelCheckpoint keeps its best 1
    in best/, a periodic one keeps 1 in periodic/, both with Lightning's default names; the
    store (keep 1 on RAM, 2 on disk, overwrite) is open; the module is a Linear(8, 1) without
    bias."""
    from types import SimpleNamespace

    ModelCheckpoint = import_module(f"{request.param}.callbacks").ModelCheckpoint
    TrainerFn = import_module(f"{request.param}.trainer.states").TrainerFn
    ModelParallelStrategy = import_module(TRAINER_MODULES[request.param]).ModelParallelStrategy

    strategy = ModelParallelStrategy(tiers=_store_config(tmp_path, overwrite=True),
                                     data_parallel_size=1, tensor_parallel_size=1)
    best = ModelCheckpoint(dirpath=tmp_path / "best", monitor="loss", save_top_k=1)
    periodic = ModelCheckpoint(dirpath=tmp_path / "periodic", save_top_k=1)
    strategy._checkpoint_callbacks = lambda: [best, periodic]
    strategy._lightning_module = SimpleNamespace(
        trainer=SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.VALIDATING)),
        strict_loading=True)
    strategy.model = torch.nn.Linear(8, 1, bias=False)
    strategy._checkpoints.open()
    yield strategy, best, periodic
    strategy._checkpoints.close()


def _module_state(step):
    """What the Trainer's save gives the store for the fixture's module at ``step``."""
    return {"state_dict": {"weight": torch.full((1, 8), float(step))},
            KEY: pack({"global_step": step, "loops": {}})}


def _loaded_step(strategy, path):
    """Load Lightning's ``path`` as the Trainer does; the step its weights were saved at."""
    record = strategy.load_checkpoint(path)
    weight = strategy.model.weight.detach()
    assert torch.equal(weight, torch.full((1, 8), float(record["global_step"])))
    return record["global_step"]


def test_two_callbacks_saving_one_file_name_keep_two_checkpoints(trainer_strategy):
    """The monitored callback (best/) and the periodic one (periodic/) both name their step-100
    checkpoint ``epoch=0-step=100.ckpt``: two checkpoints, one pinned. The periodic callback
    lets its copy go (``save_top_k=1``) and saves on: ``keep`` evicts what is not pinned, and
    the best checkpoint, which its pointer still names, keeps its pin and loads."""
    strategy, best, periodic = trainer_strategy
    checkpoints = strategy._checkpoints
    name = "epoch=0-step=100.ckpt"
    kept, let_go = os.path.join(best.dirpath, name), os.path.join(periodic.dirpath, name)
    best.best_k_models[kept] = torch.tensor(0.5)
    checkpoints.save(_module_state(100), checkpoint_id(kept), kept, pointer=True, pin=True)
    other = _module_state(100)
    other["state_dict"]["weight"] = torch.full((1, 8), -1.0)  # not the best's weights
    checkpoints.save(other, checkpoint_id(let_go), let_go, pointer=True, pin=False)
    for step in (200, 300, 400):
        path = os.path.join(periodic.dirpath, f"epoch=0-step={step}.ckpt")
        checkpoints.save(_module_state(step), checkpoint_id(path), path, pointer=True, pin=False)
        strategy.remove_checkpoint(let_go)  # what ModelCheckpoint(save_top_k=1) does
        let_go = path
    checkpoints.settle()
    checkpoints.store.wait()
    held = {c.id: c.pinned for c in checkpoints.store.list()}
    assert held.get(pointed_id(kept)) is True, held
    assert sorted(os.listdir(periodic.dirpath)) == ["epoch=0-step=400.ckpt"]
    assert _loaded_step(strategy, kept) == 100


def test_a_checkpoint_of_the_earlier_id_rule_loads_by_its_pointer_and_keeps_its_pin(
        trainer_strategy):
    """Ids made from the file name alone (the rule before the directory's digest) made best/
    and periodic/'s ``epoch=0-step=100.ckpt`` one checkpoint, pinned for best/. Both pointers
    name it: removing periodic/'s leaves the pin (best/ still keeps its path), and best/'s path
    loads it, by its pointer."""
    strategy, best, periodic = trainer_strategy
    checkpoints = strategy._checkpoints
    earlier = "epoch_3D0-step_3D100"
    name = "epoch=0-step=100.ckpt"
    kept, let_go = os.path.join(best.dirpath, name), os.path.join(periodic.dirpath, name)
    best.best_k_models[kept] = torch.tensor(0.5)
    checkpoints.save(_module_state(100), earlier, kept, pointer=True, pin=True)
    checkpoints.settle()
    write_pointer(let_go, earlier)
    strategy.remove_checkpoint(let_go)
    assert not os.path.exists(let_go)
    assert {c.id: c.pinned for c in checkpoints.store.list()} == {earlier: True}
    assert _loaded_step(strategy, kept) == 100


def test_last_is_this_runs_newest_checkpoint_in_a_store_runs_share(trainer_strategy, tmp_path):
    """Another run shares the store and saved last, into its own directory, under a name this
    run uses too. ``ckpt_path="last"`` (Lightning hands the strategy this run's ``last.ckpt``)
    loads this run's newest checkpoint, whichever of its callbacks saved it; Fabric's
    ``latest_checkpoint(dirpath)`` is that directory's newest, None for a directory whose
    checkpoints ``keep`` evicted; a last name in a directory this run does not save to chooses
    from that directory alone, and one with none is refused."""
    strategy, best, periodic = trainer_strategy
    checkpoints = strategy._checkpoints
    other = str(tmp_path / "other-run")
    for directory, name, step in [(periodic.dirpath, "epoch=0-step=2.ckpt", 2),
                                  (periodic.dirpath, "last.ckpt", 2),
                                  (best.dirpath, "epoch=0-step=4.ckpt", 4),
                                  (other, "epoch=0-step=2.ckpt", 6)]:
        path = os.path.join(directory, name)
        checkpoints.save(_module_state(step), checkpoint_id(path), path, pointer=True, pin=False)
        checkpoints.settle()
    checkpoints.store.wait()  # keep: 1 on RAM, 2 on disk; periodic/'s are evicted
    assert checkpoints.latest() == checkpoint_id(os.path.join(other, "epoch=0-step=2.ckpt"))
    assert _loaded_step(strategy, os.path.join(periodic.dirpath, "last.ckpt")) == 4
    assert strategy.latest_checkpoint(best.dirpath) == os.path.join(best.dirpath,
                                                                    "epoch=0-step=4.ckpt")
    assert strategy.latest_checkpoint(periodic.dirpath) is None
    assert strategy.latest_checkpoint(other) == os.path.join(other, "epoch=0-step=2.ckpt")
    assert _loaded_step(strategy, os.path.join(other, "last.ckpt")) == 6
    with pytest.raises(CheckpointNotFound, match="the store holds none of them"):
        strategy.load_checkpoint(tmp_path / "elsewhere" / "last.ckpt")


def test_last_is_exactly_a_checkpoint_callbacks_last_name(trainer_strategy):
    """``last``, ``last-v<N>`` with the extension, as ModelCheckpoint makes them (a
    ``{metric}`` in a custom CHECKPOINT_NAME_LAST stands for its value); not every name that
    starts with ``last``."""
    strategy, best, periodic = trainer_strategy
    periodic.CHECKPOINT_NAME_LAST = "{epoch}-last"
    last = ["last.ckpt", "last-v1.ckpt", "last-v12.ckpt", "epoch=3-last.ckpt",
            "epoch=3-last-v2.ckpt"]
    others = ["lastly.ckpt", "last-1.ckpt", "last-v.ckpt", "last-v1x.ckpt", "last_epoch.ckpt",
              "last.pt", "last", "last.ckpt.tmp", "my-last.ckpt", "epoch=3-last-1.ckpt"]
    wrong = [name for name in last + others
             if strategy._is_last(os.path.join(best.dirpath, name)) != (name in last)]
    assert not wrong


# --------------------------------------------------------------------------- which package

# Lightning's module -> (tierstore's module for it, the other spelling of that Lightning module)
PACKAGES = {
    "lightning.pytorch": ("tierstore.integrations.lightning.pytorch", "pytorch_lightning"),
    "pytorch_lightning": ("tierstore.integrations.lightning.pytorch_lightning",
                          "lightning.pytorch"),
    "lightning.fabric": ("tierstore.integrations.lightning.fabric", "lightning_fabric"),
    "lightning_fabric": ("tierstore.integrations.lightning.lightning_fabric", "lightning.fabric"),
}


def _strategies(package):
    """tierstore's two strategies for Lightning module ``package``, as its module exports them."""
    module = import_module(PACKAGES[package][0])
    return module.ModelParallelStrategy, module.FSDPStrategy


def _make(cls, **kwargs):
    """A strategy of ``cls`` (no process group needed); Fabric's ModelParallelStrategy takes a
    ``parallelize_fn``."""
    if cls.__name__ == "ModelParallelStrategy" and "fabric" in cls.__module__:
        kwargs.setdefault("parallelize_fn", lambda module, mesh: module)
    return cls(tiers={"tier": []}, **kwargs)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_each_lightning_package_has_strategies_of_its_own(package):
    """Each module's strategies extend its Lightning package's (and not the other spelling's),
    keep their names and pickle by them."""
    other = PACKAGES[package][1]
    for cls in _strategies(package):
        parent = getattr(import_module(f"{package}.strategies"), cls.__name__)
        assert issubclass(cls, parent)
        assert not issubclass(cls, import_module(f"{other}.strategies").Strategy)
        assert cls.__module__ == PACKAGES[package][0] and cls.__qualname__ == parent.__name__
        assert pickle.loads(pickle.dumps(cls)) is cls
        assert f"For the {'Fabric' if 'fabric' in package else 'Trainer'} of ``{package}``" \
            in cls.__doc__


def test_the_names_code_already_imports_are_pytorch_lightnings():
    """``tierstore.integrations.lightning``'s own names and ``.trainer``'s are the strategies
    for ``pytorch_lightning``'s Trainer, as they were before ``lightning.pytorch`` had its own."""
    import tierstore.integrations.lightning as adapter
    from tierstore.integrations.lightning import trainer

    legacy = _strategies("pytorch_lightning")
    assert (adapter.ModelParallelStrategy, adapter.FSDPStrategy) == legacy
    assert (trainer.ModelParallelStrategy, trainer.FSDPStrategy) == legacy


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_the_other_packages_trainer_refuses_a_strategy_naming_the_one_to_use(package):
    """Given a strategy of ``package``, the Trainer (or Fabric) of the other spelling refuses
    it, as Lightning refuses any object not of its own classes; the message (the strategy's
    repr) names the class that Trainer takes."""
    other = PACKAGES[package][1]
    fabric = "fabric" in package
    runner = getattr(import_module(other), "Fabric" if fabric else "Trainer")
    for cls in _strategies(package):
        instead = f"{PACKAGES[other][0]}.{cls.__name__}"
        with pytest.raises(ValueError, match=rf"strategy=<{re.escape(cls.__module__)}\."
                                             rf"{cls.__name__} for {re.escape(package)}; with "
                                             rf"{re.escape(other)}, use {re.escape(instead)}>"):
            runner(strategy=_make(cls), accelerator="cpu", devices=1,
                   **({} if fabric else {"logger": False}))


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_strategy_refuses_to_gather_the_whole_state_on_rank_0(package):
    """``save_distributed_checkpoint=False`` and ``state_dict_type="full"`` (one file gathered
    on rank 0) are what saving each rank's shard through the store replaces."""
    model_parallel, fsdp = _strategies(package)
    for cls, kwargs in [(model_parallel, {"save_distributed_checkpoint": False}),
                        (fsdp, {"state_dict_type": "full"})]:
        with pytest.raises(ValueError, match="saves each rank's shard through DCP"):
            _make(cls, **kwargs)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_a_module_whose_lightning_is_not_installed_says_what_to_do(package, monkeypatch):
    """Without its Lightning package, a module's import says what to install, and where the
    other spelling's strategies are."""
    for name in (package, package.split(".")[0]):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it fails, as if absent
    module, other = PACKAGES[package]
    monkeypatch.delitem(sys.modules, module, raising=False)
    runner = "Fabric" if "fabric" in package else "Trainer"
    with pytest.raises(ImportError, match=rf"{re.escape(module)} holds tierstore's strategies "
                                          rf"for {re.escape(package)}'s {runner}, and .* is not "
                                          rf"installed: pip install '[a-z-]+>=2.6'. With "
                                          rf"{re.escape(other)}'s {runner}, import the "
                                          rf"strategies from {re.escape(PACKAGES[other][0])}$"):
        import_module(module)


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
    """``lightning.pytorch``'s Trainer with tierstore.integrations.lightning.pytorch's strategy,
    8 steps, a checkpoint every 2 (``epoch=E-step=S.ckpt``, then ``last.ckpt`` again) into a
    RAM and a disk tier. Rank 1 is killed with SIGKILL while it writes ``last.ckpt`` at step 6,
    after ``epoch=2-step=6.ckpt`` committed; torchrun ends the job. Another run sharing the store
    (its own directory) then saves ``epoch=0-step=2.ckpt``, the store's newest. Restarted with
    ``ckpt_path="last"``, the job resumes from step 6 (its own newest complete checkpoint: not
    the last.ckpt of step 4, not the half-written one, and not the other run's) and ends with
    parameters and Adam state bitwise equal to the job run without interruption, which equal
    those of the same job with Lightning's own checkpointing."""
    tmp_path = type(tmp_path)(os.path.realpath(tmp_path))  # as Lightning's dirpath sees it
    killed = subprocess.run(torchrun_command("lightning_worker.py", tmp_path, "killed@lightning"),
                            env=script_env(), capture_output=True, text=True, timeout=200)
    report = f"--- stdout\n{killed.stdout}\n--- stderr\n{killed.stderr[-6000:]}"
    killed_last = checkpoint_id(tmp_path / "killed" / "checkpoints" / "last.ckpt")
    assert killed.returncode != 0 and \
        f"RANK 1 KILLED writing save 3 of {killed_last}" in killed.stdout, report
    assert "exitcode  : -9" in killed.stderr, report  # torchrun saw rank 1 die of SIGKILL
    step_6 = checkpoint_id(tmp_path / "killed" / "checkpoints" / "epoch=2-step=6.ckpt")
    with _store(tmp_path / "killed") as store:
        assert store.latest() == step_6, report
    assert not (tmp_path / "killed-rank0.pt").exists()

    run_torchrun("lightning_worker.py", tmp_path, "intruder@lightning", "resumed@lightning",
                 "tierstore@lightning", "default@lightning", timeout=200)
    assert _started_at(tmp_path, "intruder") == 0
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
    checkpoints = root / "checkpoints"
    ids = {name: checkpoint_id(checkpoints / name)
           for name in ("epoch=3-step=8.ckpt", "epoch=0-step=2.ckpt", "last.ckpt")}
    assert ids["epoch=3-step=8.ckpt"] in held
    assert not {ids["epoch=0-step=2.ckpt"], ids["last.ckpt"]} & set(held)
    assert os.path.islink(checkpoints / "last.ckpt")
    assert pointed_id(checkpoints / "last.ckpt") == ids["epoch=3-step=8.ckpt"]
    pointers = {name: pointed_id(checkpoints / name) for name in os.listdir(checkpoints)
                if name != "last.ckpt"}
    assert {checkpoint_id(checkpoints / name) for name in pointers} == set(held)
    assert all(pointers[n] == checkpoint_id(checkpoints / n) for n in pointers), pointers


@pytest.mark.timeout(240)
def test_pytorch_lightning_fsdp1_and_fabric_strategies_checkpoint_through_the_store(tmp_path):
    """``pytorch_lightning``'s Trainer with ``tierstore.integrations.lightning``'s own
    ModelParallelStrategy (the import code written for it has): 4 steps, then resumed from
    "last" to 8, bitwise equal to Lightning's own ModelParallelStrategy running the 8 steps.
    FSDPStrategy (FSDP1, CPU): 4 steps under ``pytorch_lightning``, resumed from "last" under
    ``lightning.pytorch`` (a job moving to the new package name keeps its checkpoints), bitwise
    equal to Lightning's own FSDPStrategy. Fabric's ModelParallelStrategy and FSDPStrategy under
    ``lightning.fabric`` and ``lightning_fabric``: ``fabric.save`` twice, ``fabric.load`` of the
    newest into fresh objects gives the saved state back, and the rest of the state dict as it
    was (an empty dict, an int key). One launch: each run takes a second or two, the launch
    itself most of the time."""
    out = run_torchrun("lightning_worker.py", tmp_path, "mp-half@pytorch_lightning",
                       "mp-resumed@pytorch_lightning", "default@pytorch_lightning",
                       "fsdp1-half@pytorch_lightning", "fsdp1-resumed@lightning",
                       "fsdp1-default@pytorch_lightning", "fabric@lightning",
                       "fabric@pytorch_lightning", timeout=200)
    assert "MISMATCH" not in out
    for kind in ("mp", "fsdp1"):
        assert _started_at(tmp_path, f"{kind}-half") == 0
        assert _started_at(tmp_path, f"{kind}-resumed") == 4
    _assert_bitwise_equal(_final(tmp_path, "mp-resumed"), _final(tmp_path, "default"),
                          "pytorch_lightning's ModelParallelStrategy resumed against its own")
    _assert_bitwise_equal(_final(tmp_path, "fsdp1-resumed"), _final(tmp_path, "fsdp1-default"),
                          "FSDP1 resumed from last under lightning.pytorch against Lightning's own")
    for package in ("lightning", "pytorch_lightning"):
        for kind in ("fsdp2", "fsdp1"):
            directory = tmp_path / f"fabric-{kind}-{package}" / "checkpoints"
            assert sorted(os.listdir(directory)) == ["step=2.ckpt", "step=4.ckpt"], directory
