"""PyTorch's async-checkpoint recipe (recipes_source/distributed_async_checkpoint_recipe.rst) on
CPU with tierstore as the storage writer: 2 ranks under torchrun, gloo, FSDP2 (``fully_shard``)
instead of FSDP1, the recipe's ToyModel and Adam, 10 steps, ``dcp.async_save`` after every step
with one save in flight, on ``store.process_group`` while the training's all-gathers and
reduce-scatters keep running on the default group. Tiers: "ram" (``keep = 3``) and "disk".

The worker (tests/scripts/async_recipe_worker.py) checks on every rank: step-9 on both tiers
after ``store.wait()``, at most 3 checkpoints in "ram", every step on "disk", ``store.latest()``
is "step-9", and a fresh model + optimizer loaded from it equal the trained ones bit for bit
(model shards, Adam's moments and step count, param groups); every older checkpoint equals the
state of its own step.
"""

from __future__ import annotations

import os

import pytest
from helpers import run_torchrun

import tierstore


def run_recipe(root, *args: str) -> str:
    """Both ranks of the worker under torchrun; returns their stdout, failing the test unless
    torchrun exited 0, no line says MISMATCH and both ranks printed ``RANK <r> OK``."""
    return run_torchrun("async_recipe_worker.py", root, *args, timeout=240)


@pytest.mark.timeout(300)
def test_async_recipe_with_fsdp2_saves_every_step_and_restores_bitwise(tmp_path):
    root = tmp_path / "tiers"
    out = run_recipe(root)
    for rank in range(2):
        assert f"RANK {rank} TRAINED 10 STEPS" in out, out

    # Seen afterwards from a plain process: the newest 3 in "ram", all 10 on "disk", each
    # checkpoint written by a world of 2, intact, and nothing hidden left behind.
    config = {"tier": [{"name": "ram", "backend": "local", "path": str(root / "ram")},
                       {"name": "disk", "backend": "local", "path": str(root / "disk")}]}
    with tierstore.open(config) as store:
        tiers = {c.id: c.tiers for c in store.list()}
        assert tiers == {f"step-{s}": ["ram", "disk"] if s >= 7 else ["disk"]
                         for s in range(10)}, tiers
        assert store.latest() == "step-9"
        report = store.verify("step-9")
        assert report.ok and report.tiers == ["ram", "disk"], report
    for tier in ("ram", "disk"):
        assert not [n for n in os.listdir(root / tier) if n.startswith(".")], tier
        names = os.listdir(root / tier / "step-9")
        assert any(n.startswith("__0_") for n in names) and any(
            n.startswith("__1_") for n in names), names


@pytest.mark.timeout(300)
def test_every_ranks_wait_covers_the_drains_of_the_last_save(tmp_path):
    """The same job with a slow last drain to "disk" (1 s before it commits): on every rank,
    ``store.list()`` right after that rank's own ``store.wait()`` shows step-9 on "disk" too.
    Rank 1 runs no drain itself (rank 0 commits the shared tiers), so this checks that
    ``store.wait(all_ranks=True)`` waits for the whole job's drains on every rank."""
    run_recipe(tmp_path / "tiers", "slow-drain")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["lazy", "lazy-budget"])
def test_the_recipe_with_lazy_staging_and_the_optimizer_hook_restores_bitwise(tmp_path, mode):
    """The recipe as the lazy training loop of docs/async-saves.md writes it: ``lazy = true``
    and ``store.hook_optimizer(optimizer)``, no other wait for the staging (the next step's forward
    and backward run while the state is copied), and with a budget of a quarter of a rank's
    state (waves spilled to "ram"). Every checkpoint holds the state of its own step."""
    root = tmp_path / "tiers"
    out = run_recipe(root, mode)
    for rank in range(2):
        assert f"RANK {rank} TRAINED 10 STEPS" in out, out
    for tier in ("ram", "disk"):
        assert not [n for n in os.listdir(root / tier) if n.startswith(".")], tier
