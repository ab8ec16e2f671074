"""Lightning training runs for tests/test_lightning.py, under torchrun (2 ranks, CPU, gloo).

    torchrun ... lightning_worker.py ROOT RUN[@PACKAGE] [RUN[@PACKAGE] ...]

PACKAGE is the Lightning package the run imports its Trainer, LightningModule, callbacks and Fabric
from, and the tierstore module it takes the strategies from (``PACKAGES``): ``lightning``
(``lightning.pytorch`` and ``lightning.fabric``, with ``tierstore.integrations.lightning.pytorch``
and ``.fabric``; the default) or ``pytorch_lightning`` (``pytorch_lightning`` and
``lightning_fabric``, with the names code written for them imports:
``tierstore.integrations.lightning``'s own, and ``.lightning_fabric``). The two are distinct class
hierarchies, so one process runs both; a run may resume what a run of the other package saved.

Each RUN is one training job of a tiny MLP (Adam, a synthetic dataset of 16 rows, 2 batches of 4
per rank and epoch, 8 steps), run one after the other in this process, each from the same seed:

- ``tierstore``: the Trainer with tierstore's ModelParallelStrategy (FSDP2 ``fully_shard`` in
  ``configure_model``), a RAM tier and a disk tier, ``ModelCheckpoint(every_n_train_steps=2,
  save_last="link")`` and a second one keeping the best 2 by ``train_loss``; writes its
  ``best_k_models`` to ROOT/tierstore/best.json.
- ``killed``: the same job into ROOT/killed, with ``save_last=True`` (a second save of every
  checkpoint as ``last.ckpt``) and lazy staging; rank 1 kills itself with SIGKILL while writing
  its file of ``last.ckpt`` at step 6 (a tierstore phase hook of this module, below), after
  ``epoch=2-step=6.ckpt`` committed. The job does not finish.
- ``intruder``: another run sharing ROOT/killed's store, with checkpoints of its own
  (ROOT/intruder/checkpoints): 2 steps, one save, ``epoch=0-step=2.ckpt`` like the killed job's
  first, and newer than all of the killed job's.
- ``resumed``: the same job again into ROOT/killed, with ``ckpt_path="last"``: it resumes from
  its own newest checkpoint, not the intruder's.
- ``default``: Lightning's own ModelParallelStrategy (DCP to a directory), same callbacks.
- ``mp-half``, ``mp-resumed``: ModelParallelStrategy to step 4 with tierstore (ROOT/mp), then
  resumed from "last" to step 8 (to compare with ``default``).
- ``fsdp1-half``, ``fsdp1-resumed``, ``fsdp1-default``: the same with FSDPStrategy (FSDP1, wrapped
  in ``configure_model`` with ``device_id=cpu``, since Lightning's own wrapping needs an
  accelerator), into ROOT/fsdp1; and Lightning's own.
- ``fabric``: Fabric's ModelParallelStrategy and FSDPStrategy from tierstore: save at steps 2 and
  4, load the newest into freshly made objects, compare (into ROOT/fabric-fsdp2-PACKAGE and
  ROOT/fabric-fsdp1-PACKAGE).

Every finished Trainer run writes its rank's final parameters and Adam state (local shards) to
ROOT/<run>-rank<r>.pt, which the test compares byte for byte, and the step it started from to
ROOT/<run>-start.json (<run> without its package), and rank 0 prints what each run took. A line
with MISMATCH says what a run found wrong.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import warnings
from importlib import import_module

import torch
from torch import nn

import tierstore
from tierstore import Phase
from tierstore.integrations.lightning.paths import checkpoint_id

STEPS = 8
EVERY = 2

# --------------------------------------------------------------------------- the two packages
# PACKAGE -> (Lightning's Trainer package, tierstore's module for it, Lightning's Fabric package,
# tierstore's module for it)
PACKAGES = {
    "lightning": ("lightning.pytorch", "tierstore.integrations.lightning.pytorch",
                  "lightning.fabric", "tierstore.integrations.lightning.fabric"),
    "pytorch_lightning": ("pytorch_lightning", "tierstore.integrations.lightning",
                          "lightning_fabric", "tierstore.integrations.lightning.lightning_fabric"),
}


class Lightning:
    """One package's modules: ``pl`` (the Trainer's), ``tiered`` (tierstore's strategies for
    it), ``fabric`` (Fabric's) and ``tiered_fabric``."""

    def __init__(self, package: str):
        self.name = package
        self.pl, self.tiered, self.fabric, self.tiered_fabric = (
            import_module(name) for name in PACKAGES[package])


L = Lightning("lightning")  # the package of the run in progress (run_one sets it)


# --------------------------------------------------------------------------- faults
# This module is also a tierstore plugin ([store] plugins = ["lightning_worker"], or
# "scripts.lightning_worker" from a test's own process). KILL_ENV = "<id>:<n>": rank 1 kills
# itself with SIGKILL while writing its file of the n-th save of checkpoint <id>. FAIL_ENV =
# "<id>": writing a file of <id> fails, on every rank.
KILL_ENV = "LIGHTNING_WORKER_KILL_AT"
FAIL_ENV = "LIGHTNING_WORKER_FAIL_AT"
_saves_begun: dict[str, int] = {}


@tierstore.hookimpl
def tierstore_phase(phase, checkpoint_id, tier, rank, detail):
    if phase == Phase.SAVE_BEGIN:
        _saves_begun[checkpoint_id] = _saves_begun.get(checkpoint_id, 0) + 1
    if phase != Phase.WRITE_FILE:
        return
    if checkpoint_id == os.environ.get(FAIL_ENV):
        raise OSError(f"{FAIL_ENV}: writing {checkpoint_id} fails")
    kill_id, _, nth = os.environ.get(KILL_ENV, "").partition(":")
    if rank == 1 and checkpoint_id == kill_id and _saves_begun.get(kill_id) == int(nth or 1):
        print(f"RANK 1 KILLED writing save {nth} of {checkpoint_id}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------- the job

def tiers(root: str, *, kill: bool = False, lazy: bool = False) -> dict:
    """A RAM tier and a disk tier under ``root``; ``last.ckpt`` is saved again at every save,
    hence overwrite. ``lazy``: lazy staging (``async_save`` returns before the copy; the
    strategy's optimizer hook makes the step wait for it)."""
    store: dict = {"overwrite": True}
    if kill:
        store["plugins"] = ["lightning_worker"]
    if lazy:
        store["staging"] = {"name": "cpu", "lazy": True}
    return {"store": store, "tier": [
        {"name": "ram", "backend": "memory", "path": f"{root}/ram", "keep": 2},
        {"name": "disk", "backend": "local", "path": f"{root}/disk", "keep": 3},
    ]}


def data():
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1234)
    x, y = torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)


def lightning_module(sharding: str):
    class Net(L.pl.LightningModule):
        def __init__(self, width: int = 32):
            super().__init__()
            self.save_hyperparameters()
            self.layers = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width),
                                        nn.ReLU(), nn.Linear(width, 4))

        def configure_model(self):
            if sharding == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for layer in self.layers:
                    if isinstance(layer, nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(self.layers, mesh=mesh)
            elif not isinstance(self.layers, FSDP1):
                self.layers = FSDP1(self.layers, device_id=torch.device("cpu"),
                                    use_orig_params=True)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.layers(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    return Net()


def final_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's parameters and Adam state, local shards, by parameter name."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    names = {p: n for n, p in module.named_parameters()}
    out = {f"param.{n}": local(p) for n, p in module.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            out[f"optim.{names[p]}.{key}"] = local(value)
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and every byte (NaNs and -0.0 included)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def record(root: str, run: str):
    """A callback writing what the test checks: the step training starts from (rank 0) and,
    at the end, this rank's final state."""

    rank = int(os.environ["RANK"])  # set by torchrun; the process group comes with fit

    class Record(L.pl.Callback):
        def on_train_start(self, trainer, pl_module):
            if rank == 0:
                with open(f"{root}/{run}-start.json", "w") as f:
                    json.dump({"global_step": trainer.global_step}, f)

        def on_train_end(self, trainer, pl_module):
            torch.save(final_state(pl_module, trainer.optimizers[0]),
                       f"{root}/{run}-rank{rank}.pt")

    return Record()


def train(root: str, run: str, strategy, dirpath: str, *, ckpt_path=None, max_steps=STEPS,
          monitor: bool = False, save_last: bool | str = True) -> object:
    pl = L.pl
    ModelCheckpoint = pl.callbacks.ModelCheckpoint

    pl.seed_everything(7, verbose=False)
    callbacks = [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=EVERY, save_top_k=-1,
                                 save_last=save_last)]
    if monitor:
        callbacks.append(ModelCheckpoint(dirpath=dirpath, every_n_train_steps=EVERY,
                                         save_top_k=2, monitor="train_loss",
                                         filename="best-{step}"))
    callbacks.append(record(root, run))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps,
                         callbacks=callbacks, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, default_root_dir=root)
    sharding = "fsdp1" if run.startswith("fsdp1") else "fsdp2"
    trainer.fit(lightning_module(sharding), train_dataloaders=data(), ckpt_path=ckpt_path)
    return trainer


def model_parallel(tiered: dict | None):
    if tiered is None:
        return L.pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    return L.tiered.ModelParallelStrategy(tiers=tiered, data_parallel_size=2,
                                          tensor_parallel_size=1)


def fsdp1(tiered: dict | None):
    FSDPStrategy = L.pl.strategies.FSDPStrategy
    if tiered is None:
        # Lightning refuses its FSDPStrategy without an accelerator, by its exact type: a
        # subclass with nothing else changed runs it on the CPU.
        class CpuFSDPStrategy(FSDPStrategy):
            pass

        return CpuFSDPStrategy(state_dict_type="sharded")
    return L.tiered.FSDPStrategy(tiers=tiered)


def run_one(root: str, run: str) -> None:
    global L
    run, _, package = run.partition("@")
    L = Lightning(package or "lightning")
    if run == "tierstore":
        trainer = train(root, run, model_parallel(tiers(f"{root}/tierstore")),
                        f"{root}/tierstore/checkpoints", monitor=True, save_last="link")
        if int(os.environ["RANK"]) == 0:
            best = trainer.checkpoint_callbacks[1].best_k_models
            with open(f"{root}/tierstore/best.json", "w") as f:
                json.dump(sorted(best), f)
    elif run == "killed":
        # last.ckpt's save at step 6 (Lightning makes the callback's dirpath a real path)
        last = os.path.join(os.path.realpath(f"{root}/killed/checkpoints"), "last.ckpt")
        os.environ[KILL_ENV] = f"{checkpoint_id(last)}:3"
        train(root, run, model_parallel(tiers(f"{root}/killed", kill=True, lazy=True)),
              f"{root}/killed/checkpoints")
    elif run == "intruder":
        train(root, run, model_parallel(tiers(f"{root}/killed")), f"{root}/intruder/checkpoints",
              max_steps=EVERY, save_last=False)
    elif run == "resumed":
        train(root, run, model_parallel(tiers(f"{root}/killed", lazy=True)),
              f"{root}/killed/checkpoints",
              ckpt_path="last")
    elif run == "default":
        train(root, run, model_parallel(None), f"{root}/default/checkpoints")
    elif run in ("mp-half", "fsdp1-half", "mp-resumed", "fsdp1-resumed"):
        kind, _, part = run.partition("-")
        strategy = (model_parallel if kind == "mp" else fsdp1)(tiers(f"{root}/{kind}"))
        if part == "half":
            train(root, run, strategy, f"{root}/{kind}/checkpoints", max_steps=STEPS // 2)
        else:
            train(root, run, strategy, f"{root}/{kind}/checkpoints", ckpt_path="last")
    elif run == "fsdp1-default":
        train(root, run, fsdp1(None), f"{root}/fsdp1-default/checkpoints")
    elif run == "fabric":
        fabric_runs(root)
    else:
        raise SystemExit(f"unknown run {run!r}")


# --------------------------------------------------------------------------- Fabric

def fabric_runs(root: str) -> None:
    """Fabric's two strategies: save at steps 2 and 4, load the newest into fresh objects."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.fsdp import fully_shard

    FSDPStrategy = L.tiered_fabric.FSDPStrategy
    ModelParallelStrategy = L.tiered_fabric.ModelParallelStrategy

    def parallelize(model, mesh):
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["data_parallel"])
        return fully_shard(model, mesh=mesh["data_parallel"])

    def mlp():
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    kinds = {
        f"fabric-fsdp2-{L.name}": (lambda t: ModelParallelStrategy(parallelize, tiers=t,
                                                         data_parallel_size=2,
                                                         tensor_parallel_size=1), mlp),
        f"fabric-fsdp1-{L.name}": (lambda t: FSDPStrategy(tiers=t),
                         lambda: FSDP1(mlp(), device_id=torch.device("cpu"),
                                       use_orig_params=True)),
    }
    Fabric = L.fabric.Fabric

    for name, (strategy, make) in kinds.items():
        torch.manual_seed(0)
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy(tiers(f"{root}/{name}")))
        fabric.launch()
        model = fabric.setup_module(make())
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
        dirpath = f"{root}/{name}/checkpoints"
        for step in range(1, 5):
            x = torch.randn(4, 16)
            loss = model(x).square().mean()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if step % 2 == 0:
                fabric.save(f"{dirpath}/step={step}.ckpt",
                            {"model": model, "optimizer": optimizer, "step": step,
                             "notes": {"empty": {}, 3: "int key"}})
        want = final_state(model, optimizer)
        newest_path = fabric.strategy.latest_checkpoint(dirpath)
        torch.manual_seed(1)  # other initial values, which the load must replace
        model2 = fabric.setup_module(make())
        optimizer2 = fabric.setup_optimizers(torch.optim.Adam(model2.parameters(), lr=1e-2))
        state = {"model": model2, "optimizer": optimizer2, "step": 0}
        rest = fabric.load(newest_path, state)
        got = final_state(model2, optimizer2)
        problems = [k for k in want if k in got and not same_bytes(want[k], got[k])]
        if (newest_path != f"{dirpath}/step=4.ckpt" or state["step"] != 4 or problems
                or set(want) != set(got) or rest != {"notes": {"empty": {}, 3: "int key"}}):
            print(f"MISMATCH {name}: newest={newest_path} step={state['step']} rest={rest} "
                  f"differ={problems} keys={sorted(set(want) ^ set(got))}", flush=True)
        fabric.strategy.teardown()


def main() -> int:
    warnings.filterwarnings("ignore")
    # A rank stuck in a collective prints every thread's stack and ends, before the test's own
    # timeout (200 s a launch) would end it with nothing to show.
    faulthandler.dump_traceback_later(190, exit=True)
    root, runs = sys.argv[1], sys.argv[2:]
    for run in runs:
        started = time.monotonic()
        run_one(root, run)
        if os.environ["RANK"] == "0":  # what each run costs, in the test's output
            print(f"RUN {run}: {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    from worker_common import run_worker

    problems: list[str] = []
    run_worker(main, problems, "PROBLEM")
