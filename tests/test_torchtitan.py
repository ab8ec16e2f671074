"""torchtitan checkpointing through tierstore (``tierstore.integrations.torchtitan``).

torchtitan's trainer needs CUDA, so the job here is its training loop without the trainer
around it (tests/scripts/torchtitan_worker.py): torchtitan's optimizer and LR-scheduler
containers and its checkpoint manager, built from their configs as the trainer builds them, a
small FSDP2 model over 2 ranks (torchrun, gloo, CPU), and the trainer's calls in its order.

- A rank SIGKILLed mid-run: the job restarts, resumes from the newest checkpoint (lazy staging,
  "ram" + "disk" tiers) and ends bit for bit where an uninterrupted run (eager staging) ends,
  and where the same run with torchtitan's own checkpointing ends.
- In one process: the config alone chooses the manager; ``interval``, the model-only last save,
  ``load_step`` and ``exclude_from_loading`` keep their meaning; nothing lands in
  ``checkpoint.folder``.
- The rules of ``settings``: ``async_mode`` chooses eager or lazy staging and wins over the
  TOML; ``keep_latest_k`` against the tiers' ``keep``.

The torchtitan tests skip where torchtitan is not installed; ``make test`` installs it: ``tyro``
and ``spmd-types``, what its checkpoint manager and optimizer containers import, then
``torchtitan`` itself with ``--no-deps`` (see the Makefile).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import assert_trees_equal, run_torchrun, script_env, torchrun_command

import tierstore
from tierstore.integrations.torchtitan.settings import store_settings

needs_torchtitan = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (make test installs it: pip install 'tyro>=1,<2' "
           "spmd-types==0.2.3, then pip install --no-deps torchtitan==0.3.0)")

TIERS = """\
[[tier]]
name = "ram"
backend = "memory"
path = "{root}/ram"
keep = 2

[[tier]]
name = "disk"
backend = "local"
path = "{root}/disk"
every = 2
"""

#: the step in which rank 1 kills itself (steps 1..6; a save every step)
KILL_AT = 4


def write_tiers(root, text: str = TIERS) -> str:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "tiers.toml"
    path.write_text(text.replace("{root}", str(root)))
    return str(path)


def final_state(out) -> list[dict]:
    """Each rank's state at the end of a run, as the worker saved it."""
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def run_killed(root, out, manager: str, async_mode: str) -> str:
    """The worker with rank 1 SIGKILLed in step ``KILL_AT``; the job must fail for it."""
    proc = subprocess.run(
        torchrun_command("torchtitan_worker.py", root, out, manager, async_mode),
        env=script_env(TT_KILL_AT_STEP=str(KILL_AT)), capture_output=True, text=True,
        timeout=120, start_new_session=True)
    report = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-8000:]}"
    assert proc.returncode != 0, f"the job went on with a rank killed\n{report}"
    assert "exitcode  : -9" in proc.stderr, f"rank 1 was not SIGKILLed\n{report}"
    assert not (out / "rank0.pt").exists(), report
    return proc.stdout


@needs_torchtitan
@pytest.mark.timeout(300)
def test_a_rank_killed_mid_run_resumes_bitwise_and_trains_as_torchtitan_does(tmp_path):
    # 1: uninterrupted, tierstore, eager staging (async_mode = "async")
    clean = tmp_path / "clean"
    write_tiers(clean)
    run_torchrun("torchtitan_worker.py", clean, clean / "out", "tierstore", "async", timeout=120)
    reference = final_state(clean / "out")

    # 2: tierstore, lazy staging (async_mode = "async_with_pinned_mem"); rank 1 dies in step
    # 4, after step 2's save committed (one save in flight: step 3's may not have), and the job
    # is started again, as a scheduler would.
    killed = tmp_path / "killed"
    write_tiers(killed)
    run_killed(killed, killed / "out", "tierstore", "async_with_pinned_mem")
    with tierstore.open(str(killed / "tiers.toml"), read_only=True) as store:
        newest = store.latest()
    assert newest in (f"step-{KILL_AT - 2}", f"step-{KILL_AT - 1}"), newest
    out = run_torchrun("torchtitan_worker.py", killed, killed / "out", "tierstore",
                       "async_with_pinned_mem", timeout=120)
    for rank in range(2):
        assert f"RANK {rank} NEWEST {newest} RESUMED FROM {newest}" in out, out
    resumed = final_state(killed / "out")
    for rank in range(2):
        assert resumed[rank]["train_state"]["step"] == 6
        assert_trees_equal(resumed[rank], reference[rank], f"rank {rank}, killed and resumed")

    # 3: torchtitan's own checkpointing (its CheckpointManager, async_mode = "async", files in
    # checkpoint.folder): the same training, to the bit. The adapter changes where bytes go.
    own = tmp_path / "own"
    own.mkdir()
    run_torchrun("torchtitan_worker.py", own, own / "out", "default", "async", timeout=120)
    assert sorted(os.listdir(own / "checkpoint")) == [f"step-{s}" for s in range(1, 7)]
    for rank, state in enumerate(final_state(own / "out")):
        assert_trees_equal(state, reference[rank], f"rank {rank}, torchtitan's checkpointing")


# --------------------------------------------------------------------------- in one process

class Batches:
    """A stateful data loader: its state is how many batches it gave."""

    def __init__(self):
        self.position = 0

    def next(self):
        gen = torch.Generator().manual_seed(self.position)
        self.position += 1
        return torch.randn(4, 8, generator=gen)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state_dict):
        self.position = state_dict["position"]


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state_dict):
        self.step = state_dict["step"]


def build(config, tmp_path, seed: int):
    """A model, torchtitan's containers and the checkpointer ``config.build`` makes of them,
    with the arguments the trainer passes."""
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    optimizer_config = default_adamw(lr=1e-2)
    optimizer_config.implementation = "foreach"
    optimizers = optimizer_config.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers,
                                                                       training_steps=5)
    job = {"model": model, "optimizers": optimizers, "lr_schedulers": lr_schedulers,
           "batches": Batches(), "train_state": TrainState()}
    job["checkpointer"] = config.build(
        dataloader=job["batches"], model_parts=[model], optimizers=optimizers,
        lr_schedulers=lr_schedulers, states={"train_state": job["train_state"]},
        sd_adapter=None, base_folder=str(tmp_path))
    return job


def train(job, steps: int) -> dict[int, dict]:
    """``steps`` steps of the trainer's loop; the model's state after each, by step."""
    snapshots = {}
    for _ in range(steps):
        job["train_state"].step += 1
        step = job["train_state"].step
        job["optimizers"].zero_grad()
        job["model"](job["batches"].next()).square().mean().backward()
        job["checkpointer"].maybe_wait_for_staging()
        job["optimizers"].step()
        job["lr_schedulers"].step()
        job["checkpointer"].save(step, last_step=(step == 5))
        snapshots[step] = {k: v.clone() for k, v in job["model"].state_dict().items()}
    return snapshots


@needs_torchtitan
@pytest.mark.parametrize("async_mode", ["disabled", "async", "async_with_pinned_mem"])
def test_the_config_alone_chooses_the_manager_and_torchtitans_fields_keep_their_meaning(
        tmp_path, async_mode):
    from tierstore.integrations.torchtitan import TierstoreCheckpointManager

    tiers = write_tiers(tmp_path / "tiers")
    config = TierstoreCheckpointManager.Config(enable=True, tiers=tiers, interval=2,
                                               async_mode=async_mode,
                                               initial_load_model_only=False)
    job = build(config, tmp_path, seed=0)
    checkpointer = job["checkpointer"]
    assert type(checkpointer) is TierstoreCheckpointManager
    assert checkpointer.load() is False  # an empty store: a fresh start
    snapshots = train(job, 5)
    checkpointer.close()

    with tierstore.open(tiers, read_only=True) as store:
        # interval = 2, and the last step; newest first, each on the tiers its every/keep say
        assert {c.id: c.tiers for c in store.list()} == {
            "step-5": ["ram"], "step-4": ["ram", "disk"], "step-2": ["disk"]}
        # the last save holds the model only (last_save_model_only, torchtitan's default)
        last = store.inspect("step-5")
        assert sorted(t.fqn for t in last.tensors) == ["0.bias", "0.weight", "2.bias",
                                                       "2.weight"], last
        assert not last.objects, last
        full = store.inspect("step-4")
        assert any(t.fqn.startswith("optimizer.") for t in full.tensors), full
        assert {"train_state.step", "dataloader.position"} <= set(full.objects), full
    assert not (tmp_path / "checkpoint").exists(), "the checkpoints went to checkpoint.folder"

    # load_step = 4 with the data loader's state excluded: the rest comes back as it was then.
    config = TierstoreCheckpointManager.Config(enable=True, tiers=tiers, load_step=4,
                                               exclude_from_loading=["dataloader"],
                                               initial_load_model_only=False)
    job = build(config, tmp_path, seed=1)
    assert job["checkpointer"].load(step=config.load_step) is True
    assert job["train_state"].step == 4
    assert job["batches"].position == 0, "exclude_from_loading did not exclude the dataloader"
    assert_trees_equal(job["model"].state_dict(), snapshots[4], "the model loaded from step-4")
    assert job["lr_schedulers"].state_dict()["last_epoch"] == 4
    job["checkpointer"].close()


@needs_torchtitan
def test_a_first_start_loads_initial_load_path_and_a_restart_the_store(tmp_path):
    from torchtitan.components.checkpointer import CheckpointManager

    from tierstore.integrations.torchtitan import TierstoreCheckpointManager

    # A checkpoint in files, from torchtitan's own manager (step 2 of another run).
    files = CheckpointManager.Config(enable=True, folder=str(tmp_path / "files"), interval=2,
                                     keep_latest_k=0, initial_load_model_only=False)
    job = build(files, tmp_path, seed=0)
    snapshots = train(job, 2)
    job["checkpointer"].close()

    tiers = write_tiers(tmp_path / "tiers")
    config = TierstoreCheckpointManager.Config(
        enable=True, tiers=tiers, interval=1,
        initial_load_path=str(tmp_path / "files" / "step-2"), initial_load_model_only=True)
    job = build(config, tmp_path, seed=1)
    assert job["checkpointer"].load() is True  # the store is empty: initial_load_path, model only
    assert_trees_equal(job["model"].state_dict(), snapshots[2], "the model of initial_load_path")
    assert job["train_state"].step == 0
    train(job, 1)
    job["checkpointer"].close()

    job = build(config, tmp_path, seed=2)
    assert job["checkpointer"].load() is True  # now the store's step-1 wins
    assert job["train_state"].step == 1 and job["batches"].position == 1
    job["checkpointer"].close()


@needs_torchtitan
def test_a_manager_without_tiers_or_with_a_wrong_toml_says_what_to_do(tmp_path):
    from tierstore.integrations.torchtitan import TierstoreCheckpointManager

    with pytest.raises(ValueError, match="checkpoint.tiers is empty"):
        TierstoreCheckpointManager.Config(enable=True)
    TierstoreCheckpointManager.Config()  # checkpointing disabled: no tiers needed

    bad = write_tiers(tmp_path / "bad", TIERS.replace('backend = "local"', 'backend = "nvme"'))
    for mode in ("async", "async_with_pinned_mem"):  # the file as it is, and a changed copy
        config = TierstoreCheckpointManager.Config(enable=True, tiers=bad, async_mode=mode,
                                                   initial_load_model_only=False)
        with pytest.raises(tierstore.ConfigError, match=r"unknown backend 'nvme'") as info:
            build(config, tmp_path, seed=0)
        assert str(info.value).startswith(bad), info.value


def test_importing_tierstore_or_the_integration_imports_no_torchtitan():
    code = ("import sys, tierstore, tierstore.integrations.torchtitan; "
            "assert 'torchtitan' not in sys.modules, 'torchtitan was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- settings

def test_async_mode_chooses_eager_or_lazy_staging_and_wins_over_the_toml(tmp_path):
    plain = write_tiers(tmp_path / "plain")
    # eager is tierstore's default: the file goes to tierstore.open as it is
    assert store_settings(plain, "async").config == plain
    assert store_settings(plain, "disabled").config == plain
    lazy = store_settings(plain, "async_with_pinned_mem")
    assert lazy.config["store"]["staging"] == {"name": "cpu", "lazy": True}
    assert lazy.config["tier"][0]["name"] == "ram" and not lazy.warnings
    assert plain in lazy.changed and "lazy = true" in lazy.changed

    # the TOML's staging plugin and its other options stay; a contrary lazy draws a warning
    said = write_tiers(tmp_path / "said", textwrap.dedent("""\
        [store]
        staging = { name = "cpu", lazy = true, max_staging_bytes = 1048576 }
        """) + TIERS)
    eager = store_settings(said, "async")
    assert eager.config["store"]["staging"] == {"name": "cpu", "lazy": False,
                                                "max_staging_bytes": 1048576}
    [warning] = eager.warnings
    assert "async_mode = 'async'" in warning and "async_mode wins" in warning
    assert store_settings(said, "async_with_pinned_mem").config == said
    assert store_settings(said, "disabled").config == said

    # what tierstore must report itself (with the file and line) is left to it
    missing = str(tmp_path / "missing.toml")
    assert store_settings(missing, "async_with_pinned_mem").config == missing
    with pytest.raises(ValueError, match="async_mode 'sometimes'"):
        store_settings(plain, "sometimes")


def test_keep_latest_k_deletes_nothing_and_says_so_when_the_tiers_keep_otherwise(tmp_path):
    tiers = write_tiers(tmp_path)
    assert store_settings(tiers, "async", keep_latest_k=0).warnings == []
    [warning] = store_settings(tiers, "async", keep_latest_k=10).warnings
    assert "keep_latest_k = 10 deletes nothing" in warning and "ram: 2, disk: all" in warning
    both = write_tiers(tmp_path, TIERS.replace("keep = 2", "keep = 3") + "keep = 3\n")
    assert store_settings(both, "async", keep_latest_k=3).warnings == []
