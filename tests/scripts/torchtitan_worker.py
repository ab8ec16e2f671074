"""torchtitan's training loop, checkpointed by its own checkpoint manager or by tierstore's.

Run under ``torchrun --nproc-per-node=2`` (gloo, CPU) by tests/test_torchtitan.py.
argv: ROOT OUT MANAGER ASYNC_MODE. MANAGER "tierstore" (``TierstoreCheckpointManager``, tiers
from ROOT/tiers.toml) or "default" (torchtitan's ``CheckpointManager``, files in
ROOT/checkpoint); ASYNC_MODE is ``checkpoint.async_mode``.

torchtitan's trainer needs CUDA (its device is "cuda" wherever no accelerator is found), so this
worker is its training loop without the trainer around it: the same components built from their
configs as the trainer builds them (``OptimizersContainer`` from ``default_adamw``,
``LRSchedulersContainer``, the checkpoint manager from ``config.checkpoint.build(...)`` with the
same arguments, ``ModelWrapper`` inside it), a small model sharded with FSDP2 over the 2 ranks,
a stateful data loader keyed by rank as torchtitan's is, a train state like the trainer's, and
the trainer's calls in its order: ``load(step=load_step)`` once, then each step forward,
backward, ``maybe_wait_for_staging()``, ``optimizers.step()``, ``lr_schedulers.step()``,
``save(step, last_step=...)``.

With TT_KILL_AT_STEP=K, rank 1 SIGKILLs itself in step K, after its backward and before its
optimizer step (an async save of step K-1 may be in flight); torchrun then stops rank 0 and
fails. The same command again (a scheduler's restart) resumes from the newest checkpoint and
trains on to the end. Each rank prints the newest checkpoint the store lists before the load
(tierstore) and the step it resumed from.

At the end each rank saves its exact state with ``torch.save`` into OUT/rank<r>.pt: the local
shards of the parameters, the optimizer's state (FQN-keyed, as torchtitan flattens it), the LR
scheduler, the train state and the data loader's position; the test compares them bit for bit
between runs. Prints ``RANK <r> OK`` at the end, problems as ``RANK <r> PROBLEM: ...``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from worker_common import run_worker

from tierstore.integrations.torchtitan import TierstoreCheckpointManager

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

WORLD = 2
STEPS = 6
SEED = 0

problems: list[str] = []


class TinyModel(nn.Module):
    """Two linear layers around a LayerNorm; every parameter is sharded over the ranks."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.out = nn.Linear(64, 32)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.inp(x))))


class Batches(Stateful):
    """Each rank's batches, a pure function of (rank, position); its state is the position,
    keyed by rank as torchtitan's data loader keys its state (``dp_rank_<r>``), so that each
    rank's position is a checkpoint item of its own."""

    def __init__(self, rank: int):
        self.rank = rank
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 * self.rank + self.position)
        self.position += 1
        return torch.randn(8, 32, generator=gen), torch.randn(8, 32, generator=gen)

    def state_dict(self):
        return {f"dp_rank_{self.rank}": self.position}

    def load_state_dict(self, state_dict):
        self.position = state_dict[f"dp_rank_{self.rank}"]


class TrainState(Stateful):
    """The trainer's own state in a checkpoint (``states={"train_state": trainer}``)."""

    def __init__(self):
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict):
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


def checkpoint_config(manager: str, root: str, async_mode: str):
    # initial_load_model_only=False: torchtitan's default warns that it means nothing here.
    common = {"enable": True, "folder": "checkpoint", "interval": 1, "async_mode": async_mode,
              "initial_load_model_only": False}
    if manager == "tierstore":
        return TierstoreCheckpointManager.Config(tiers=f"{root}/tiers.toml", **common)
    return CheckpointManager.Config(**common)


def local(tree):
    """``tree`` with every DTensor replaced by a copy of this rank's local shard."""
    if isinstance(tree, DTensor):
        return tree.to_local().detach().clone()
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local(v) for v in tree)
    return tree


def main() -> int:
    root, out, manager, async_mode = sys.argv[1:5]
    kill_at = int(os.environ.get("TT_KILL_AT_STEP", "0"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD, dist.get_world_size()
    mesh = init_device_mesh("cpu", (WORLD,))

    torch.manual_seed(SEED)  # one logical model on every rank, then sharded
    model = TinyModel()
    for layer in (model.inp, model.norm, model.out):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer_config = default_adamw(lr=1e-2)
    optimizer_config.implementation = "foreach"  # "fused" is the CUDA default
    optimizers = optimizer_config.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5).build(
        optimizers=optimizers, training_steps=STEPS)
    batches, train_state = Batches(rank), TrainState()
    config = checkpoint_config(manager, root, async_mode)
    checkpointer = config.build(dataloader=batches, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=lr_schedulers, states={"train_state": train_state},
                                sd_adapter=None, base_folder=root)

    newest = None
    if manager == "tierstore":
        listed = [c.id for c in checkpointer.store.list()]
        newest = max(listed, key=lambda c: int(c.split("-")[1]), default=None)
    checkpointer.load(step=config.load_step)
    resumed = train_state.step
    print(f"RANK {rank} NEWEST {newest} RESUMED FROM step-{resumed}", flush=True)
    if newest is not None and newest != f"step-{resumed}":
        problems.append(f"resumed from step-{resumed}, the store's newest is {newest}")

    stalls = []
    while train_state.step < STEPS:
        train_state.step += 1
        optimizers.zero_grad()
        x, y = batches.next()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        train_state.ntokens_seen += x.shape[0]
        if rank == 1 and train_state.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        begin = time.perf_counter()
        checkpointer.save(train_state.step, last_step=(train_state.step == STEPS))
        stalls.append(time.perf_counter() - begin)

    state = {"model": local(model.state_dict()), "optim": local(optimizers.state_dict()),
             "lr_schedulers": lr_schedulers.state_dict(), "train_state": train_state.state_dict(),
             "dataloader": batches.state_dict()}
    os.makedirs(out, exist_ok=True)
    torch.save(state, os.path.join(out, f"rank{rank}.pt"))
    print(f"RANK {rank} TRAINED TO STEP {train_state.step} FROM STEP {resumed}; save stalls "
          + " ".join(f"{s * 1000:.1f}" for s in stalls) + " ms", flush=True)
    checkpointer.close()
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
