"""PyTorch's async-checkpoint recipe on CPU, with tierstore as the storage writer.

Run under ``torchrun --nproc-per-node=2`` (gloo, CPU) by tests/test_async_recipe.py.
argv: ROOT [MODE]. ROOT holds the tier roots. MODE "recipe" (the default) or "slow-drain": the
same job with the drain of the last checkpoint to "disk" slowed down (1 s before its commit, as a
slow disk or object store would), which makes every rank check ``store.list()`` right after its
own ``store.wait()`` (see the test module). "lazy": lazy staging, with the optimizer hooked to
the store (``store.hook_optimizer``) and no other wait for the staging, as the training loop of
docs/async-saves.md; "lazy-budget": the same with ``max_staging_bytes`` a quarter of a rank's
state (waves).

The recipe (recipes_source/distributed_async_checkpoint_recipe.rst) with FSDP2
(``fully_shard``) instead of FSDP1: its ToyModel and Adam, 10 training steps, ``dcp.async_save``
after every step with one save in flight (the previous future is waited for before the next
save). The training keeps all-gathering and reduce-scattering on the default group while the
saves run in DCP's background thread on ``store.process_group``.

Each rank snapshots its exact model and optimizer state (local shards) after every step. After
the last save and ``store.wait()``: step-9 is on both tiers, "ram" holds at most 3 checkpoints,
``store.latest()`` is "step-9" on every rank, and a fresh model + optimizer (another seed, one
step of its own) loaded from it equals the snapshot of step 9 bit for bit; every older checkpoint
is loaded and compared with its snapshot too (the training went on while those were saved).

Prints one line per problem and exits 1 when there is any; prints "RANK <r> OK" otherwise.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh
from worker_common import StagedEvents, run_worker, snapshot

import tierstore
from tierstore.events import Phase

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

WORLD = 2
STEPS = 10
RAM_KEEP = 3

SLOW_DRAIN_S = 1.0
#: "lazy-budget": bytes of staging memory, about a quarter of a rank's model and Adam state
BUDGET = 616

problems: list[str] = []


def fail(msg: str) -> None:
    problems.append(msg)


class AppState(Stateful):
    """The recipe's wrapper: DCP calls state_dict / load_state_dict on it."""

    def __init__(self, model, optimizer=None):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(16, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def build(seed: int, mesh):
    """The recipe's model under FSDP2 (each Linear its own unit, then the root) and Adam."""
    torch.manual_seed(seed)  # same on every rank: one logical model, sharded
    model = ToyModel()
    fully_shard(model.net1, mesh=mesh)
    fully_shard(model.net2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, optimizer


def train_step(model, optimizer, gen: torch.Generator) -> None:
    optimizer.zero_grad()
    model(torch.rand(8, 16, generator=gen)).sum().backward()
    optimizer.step()


def state_of(model, optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return snapshot({"model": model_sd, "optim": optim_sd})


def differences(actual, expected, path: str = "") -> list[str]:
    """Every place where ``actual`` is not exactly ``expected`` (tensors: dtype, shape, bits)."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return [f"{path}: {type(actual).__name__}, expected a tensor"]
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            return [(f"{path}: {actual.dtype} {tuple(actual.shape)}, "
                     f"expected {expected.dtype} {tuple(expected.shape)}")]
        if not torch.equal(actual, expected):
            return [(f"{path}: values differ (max abs diff "
                     f"{(actual.double() - expected.double()).abs().max().item():.3g})")]
        return []
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(actual) != set(expected):
            keys = sorted(map(str, actual)) if isinstance(actual, dict) else type(actual).__name__
            return [f"{path}: keys {keys}, expected {sorted(map(str, expected))}"]
        out = []
        for k in expected:
            out += differences(actual[k], expected[k], f"{path}/{k}")
        return out
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return [f"{path}: {actual!r:.200}, expected {expected!r:.200}"]
        out = []
        for i, (a, e) in enumerate(zip(actual, expected)):
            out += differences(a, e, f"{path}[{i}]")
        return out
    if type(actual) is not type(expected) or actual != expected:
        return [f"{path}: {actual!r:.200}, expected {expected!r:.200}"]
    return []


def count_leaves(sd) -> int:
    if isinstance(sd, dict):
        return sum(count_leaves(v) for v in sd.values())
    if isinstance(sd, (list, tuple)):
        return sum(count_leaves(v) for v in sd)
    return 1


class SlowLastDrain:
    """Sleeps before the drain of the last checkpoint commits on "disk"."""

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail):
        if phase == Phase.DRAIN_COMMIT and checkpoint_id == f"step-{STEPS - 1}":
            time.sleep(SLOW_DRAIN_S)


def check_listing(listed, root: str, when: str) -> None:
    """step-9 on both tiers, the newest 3 in "ram", every checkpoint on "disk"."""
    tiers_of = {c.id: c.tiers for c in listed}
    last = f"step-{STEPS - 1}"
    if tiers_of.get(last) != ["ram", "disk"]:
        fail(f"{when}: {last} is on tiers {tiers_of.get(last)}, expected ['ram', 'disk']")
    in_ram = [c.id for c in listed if "ram" in c.tiers]
    if len(in_ram) > RAM_KEEP:
        fail(f"{when}: tier 'ram' holds {len(in_ram)} checkpoints {in_ram}, keep = {RAM_KEEP}")
    elif in_ram != [f"step-{s}" for s in range(STEPS - 1, STEPS - 1 - RAM_KEEP, -1)]:
        fail(f"{when}: tier 'ram' holds {in_ram}, expected the newest {RAM_KEEP}")
    on_ram_dir = sorted(n for n in os.listdir(f"{root}/ram") if not n.startswith("."))
    if len(on_ram_dir) > RAM_KEEP:
        fail(f"{when}: the ram tier's directory holds {on_ram_dir}, keep = {RAM_KEEP}")
    on_disk = sorted((c.id for c in listed if "disk" in c.tiers), key=lambda c: int(c[5:]))
    if on_disk != [f"step-{s}" for s in range(STEPS)]:
        fail(f"{when}: tier 'disk' holds {on_disk}, expected every step-0..step-{STEPS - 1}")


def upload_future(response):
    """async_save returns a Future, or an AsyncSaveResponse when the stager stages in the
    background; the save is done when its upload completes."""
    return getattr(response, "upload_completion", response)


def main() -> int:
    root = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "recipe"
    assert mode in ("recipe", "slow-drain", "lazy", "lazy-budget"), mode
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD, dist.get_world_size()
    mesh = init_device_mesh("cpu", (WORLD,))
    staging = {"name": "cpu", "lazy": mode.startswith("lazy")}
    if mode == "lazy-budget":
        staging["max_staging_bytes"] = BUDGET
    stagings = StagedEvents()
    store = tierstore.open({"store": {"staging": staging}, "tier": [
        {"name": "ram", "backend": "local", "path": f"{root}/ram", "keep": RAM_KEEP},
        {"name": "disk", "backend": "local", "path": f"{root}/disk"},
    ]}, plugins=[stagings, *([SlowLastDrain()] if mode == "slow-drain" else [])])
    pg = store.process_group
    if pg is None:
        fail("store.process_group is None under torch.distributed")
    elif pg == dist.group.WORLD:
        fail("store.process_group is the default group")

    model, optimizer = build(seed=0, mesh=mesh)
    if staging["lazy"]:
        # The only wait for the staging: the optimizer step, which changes the state in place.
        store.hook_optimizer(optimizer)
    if not isinstance(model.net1.weight, DTensor):
        fail(f"fully_shard left net1.weight a {type(model.net1.weight).__name__}")
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches

    snapshots: dict[str, dict] = {}
    checkpoint_future = None
    started = time.perf_counter()
    overlapped = 0  # steps whose training ran while the previous save was still in flight
    for step in range(STEPS):
        train_step(model, optimizer, data)
        snapshots[f"step-{step}"] = state_of(model, optimizer)

        # The recipe: wait for the previous checkpoint, one request in flight at a time.
        if checkpoint_future is not None:
            overlapped += not checkpoint_future.done()
            checkpoint_future.result()
        checkpoint_future = upload_future(dcp.async_save(
            {"app": AppState(model, optimizer)}, storage_writer=store.writer(),
            checkpoint_id=f"step-{step}", process_group=pg))
    checkpoint_future.result()
    if [e.detail["lazy"] for e in stagings.events] != [staging["lazy"]] * STEPS:
        fail(f"stagings {[e.detail for e in stagings.events]}, expected {STEPS} with lazy = "
             f"{staging['lazy']}")
    if mode == "lazy-budget" and not all(e.detail["waves"] > 1 for e in stagings.events):
        fail(f"budgeted stagings took waves {[e.detail['waves'] for e in stagings.events]}")
    # Drains of a shared first tier run on rank 0; all_ranks=True returns on every rank once
    # they are done everywhere ("slow-drain" checks that on every rank).
    store.wait(all_ranks=(mode == "slow-drain"))
    print(f"RANK {rank} TRAINED {STEPS} STEPS WITH ASYNC SAVES IN "
          f"{time.perf_counter() - started:.2f} s; {overlapped} of {STEPS - 1} saves were still "
          f"in flight when the next step's training had finished", flush=True)

    # The training really ran collectives and the shards really differ between ranks: the
    # ranks' local shards of net1.weight are different rows of one logical matrix.
    final = snapshots[f"step-{STEPS - 1}"]
    if final["model"]["net1.weight"].shape != (16 // WORLD, 16):
        fail(f"local shard of net1.weight is {tuple(final['model']['net1.weight'].shape)}, "
             f"expected {(16 // WORLD, 16)}")
    if differences(final, snapshots["step-0"]) == []:
        fail("the state did not change between step 0 and the last step")
    steps = final["optim"]["state"]["net1.weight"]["step"]
    if float(steps) != STEPS:
        fail(f"Adam's step count is {steps}, expected {STEPS}")

    # What is stored after store.wait(). The drains of a checkpoint on a shared first tier run on
    # rank 0 (the coordinator, which commits it); in "recipe" mode only rank 0 checks right after
    # its own wait(), every rank checks once every rank's wait() has returned. In "slow-drain"
    # mode every rank checks right after its own wait().
    listed = store.list()
    print(f"RANK {rank} LIST AFTER WAIT "
          + " ".join(f"{c.id}:{'+'.join(c.tiers)}" for c in listed), flush=True)
    if store.pending():
        fail(f"copies still pending after store.wait(): {store.pending()}")
    if mode == "slow-drain" or rank == 0:
        check_listing(listed, root, f"rank {rank} right after store.wait()")
    dist.barrier()
    check_listing(store.list(), root, "after every rank's store.wait()")
    last = f"step-{STEPS - 1}"

    ckpt = store.latest()
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, ckpt)
    if everyone != [last] * WORLD:
        fail(f"latest() per rank: {everyone}, expected {last!r} on every rank")

    # A fresh model and optimizer: other initial values, and one step of their own so Adam's
    # state exists (with step 1, not 10).
    new_model, new_opt = build(seed=12345, mesh=mesh)
    train_step(new_model, new_opt, torch.Generator().manual_seed(7 + rank))
    before = state_of(new_model, new_opt)
    if count_leaves(before) != count_leaves(final):
        fail(f"the fresh state has {count_leaves(before)} leaves, the trained one "
             f"{count_leaves(final)}")
    changed = differences(before, final)
    if not any("/model/" in d for d in changed) or not any("/step" in d for d in changed):
        fail(f"the fresh model/optimizer already equal the trained ones: {changed}")

    dcp.load({"app": AppState(new_model, new_opt)}, storage_reader=store.reader(),
             checkpoint_id=ckpt or last, process_group=pg)
    for d in differences(state_of(new_model, new_opt), final, f"load {ckpt}"):
        fail(d)

    # The fresh model trains on from the loaded state exactly like the original one does.
    train_step(model, optimizer, torch.Generator().manual_seed(99 + rank))
    train_step(new_model, new_opt, torch.Generator().manual_seed(99 + rank))
    for d in differences(state_of(new_model, new_opt), state_of(model, optimizer),
                         "one more step after the load"):
        fail(d)

    # Every older checkpoint holds the state of its own step, though the training went on
    # while it was being written (step-7, step-8 from ram, the others from disk).
    for step in range(STEPS - 1):
        cid = f"step-{step}"
        m, o = build(seed=54321, mesh=mesh)
        train_step(m, o, torch.Generator().manual_seed(3))
        dcp.load({"app": AppState(m, o)}, storage_reader=store.reader(), checkpoint_id=cid,
                 process_group=pg)
        for d in differences(state_of(m, o), snapshots[cid], f"load {cid}"):
            fail(d)

    dist.barrier()
    store.close()
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "MISMATCH")
