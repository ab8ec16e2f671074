"""Lightning's checkpoint stall: how long a Trainer's training loop waits for each checkpoint
with Lightning's own ``ModelParallelStrategy`` against tierstore's
(``tierstore.integrations.lightning``), in one torchrun job (2 ranks, CPU, gloo) and one run.

    .venv/bin/python benchmarks/lightning_stall.py                 # 48 MiB of state, 3 rounds
    .venv/bin/python benchmarks/lightning_stall.py --state-mib 16 --rounds 5 --json /tmp/l.json

What is trained
---------------
A ``LightningModule`` holding ``--layers`` square ``Linear`` layers (fp32) sharded with FSDP2
(``fully_shard`` in ``configure_model``), ``torch.optim.Adam``: parameters and Adam's two moments
come to about ``--state-mib`` MiB over both ranks. A step is forward and backward on a fixed batch
of random rows and the optimizer step. ``ModelCheckpoint(every_n_train_steps=--every,
save_top_k=1)`` (Lightning's default top-k: each save removes the one before) checkpoints
``--warmup`` + ``--saves`` times per fit.

Contenders, each a fresh ``Trainer.fit`` from the same seed, in turn within each round (the first
one alternating):

- ``lightning``: Lightning's own ``ModelParallelStrategy``: ``dcp.save`` into a directory under
  ``--dir`` (a disk filesystem), ``meta.pt`` beside it; the previous checkpoint ``rmtree``-ed;
- ``tierstore``: tierstore's ``ModelParallelStrategy`` with a ``memory`` tier (``keep = 2``) in
  ``/dev/shm`` and a ``local`` tier under ``--dir`` taking every 5th step (``keep = 2``):
  ``dcp.async_save`` through the store's writer (eager staging into reused buffers); the previous
  checkpoint's pointer file removed (``keep`` evicts the checkpoint).

**Stall** per save: the time ``ModelCheckpoint.on_train_batch_end`` takes at a step that saves
(``trainer.save_checkpoint``: Lightning's state dicts, the strategy's save and its barrier; then
the removal of the previous checkpoint), the slower rank's, median over the ``--saves`` timed
saves of every round. Within it, ``save_checkpoint`` (``trainer.save_checkpoint``) and
``strategy`` (the strategy's ``save_checkpoint`` alone: what differs between the two, without
Lightning's collection of the state dicts) are reported too. The first ``--warmup`` saves of
each fit are not timed. **Fit** is the wall time of ``trainer.fit`` (tierstore's includes waiting,
at teardown, for the last save and its copy to the disk tier).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
from torch import nn

from harness import barrier, finish_rank, max_over_ranks, parser, relaunch, torchrun_main

CONTENDERS = ("lightning", "tierstore")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--state-mib", type=int, default=48,
                   help="parameters + Adam moments over both ranks, MiB (default 48)")
    p.add_argument("--layers", type=int, default=4, help="Linear layers (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="fits per contender (default 3)")
    p.add_argument("--every", type=int, default=2, help="steps between saves (default 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed saves per fit (default 2)")
    p.add_argument("--saves", type=int, default=6, help="timed saves per fit (default 6)")
    p.add_argument("--batch", type=int, default=64, help="rows per step and rank (default 64)")
    p.add_argument("--dir", default=tempfile.gettempdir(),
                   help="where checkpoints on disk go (default: the system temp dir)")
    p.add_argument("--json", help="also write the report here")
    return p.parse_args(argv)


# -- one rank ------------------------------------------------------------------------------------

def worker(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning_fabric").setLevel(logging.ERROR)
    rank = int(os.environ["RANK"])
    work = os.path.join(args.dir, f"lightning-stall-{os.environ['TORCHELASTIC_RUN_ID']}")
    shm = os.path.join("/dev/shm", os.path.basename(work))
    results: dict[str, dict[str, list[float]]] = {
        c: {"stall": [], "save": [], "strategy": [], "fit": []} for c in CONTENDERS}
    try:
        for round_ in range(args.rounds):
            order = CONTENDERS if round_ % 2 == 0 else CONTENDERS[::-1]
            for contender in order:
                root = os.path.join(work, f"{contender}-{round_}")
                stalls, saves, in_strategy, fit = fit_once(args, contender, root,
                                                           os.path.join(shm, f"ram-{round_}"))
                results[contender]["stall"] += stalls
                results[contender]["save"] += saves
                results[contender]["strategy"] += in_strategy
                results[contender]["fit"].append(fit)
                if rank == 0:
                    print(f"round {round_} {contender:9s}: stall median "
                          f"{statistics.median(stalls) * 1e3:7.1f} ms, fit {fit:.2f} s",
                          file=sys.stderr, flush=True)
                barrier()
                if rank == 0:
                    shutil.rmtree(root, ignore_errors=True)
    finally:
        barrier()
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
    if rank == 0:
        report(args, results)
    return finish_rank(rank, 0)


def timing(fn, seconds: list[float]):
    """``fn`` that appends each call's duration to ``seconds`` (raised or not)."""
    def call(*a, **kw):
        started = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            seconds.append(time.perf_counter() - started)

    return call

def fit_once(args, contender: str, root: str, ram: str
             ) -> tuple[list[float], list[float], list[float], float]:
    """One ``Trainer.fit``; the stalls, ``trainer.save_checkpoint`` and
    ``strategy.save_checkpoint`` times of its timed saves (the slower rank's each), and its
    wall time."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.strategies import ModelParallelStrategy

    from tierstore.integrations.lightning import ModelParallelStrategy as TieredStrategy

    if contender == "lightning":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        strategy = TieredStrategy(tiers={"tier": [
            {"name": "ram", "backend": "memory", "path": ram, "keep": 2},
            {"name": "disk", "backend": "local", "path": f"{root}/disk", "every": 5,
             "keep": 2}]}, data_parallel_size=2, tensor_parallel_size=1)
    checkpoint = ModelCheckpoint(dirpath=f"{root}/checkpoints", every_n_train_steps=args.every,
                                 save_top_k=1)
    stalls, saves = time_saves(checkpoint)
    in_strategy: list[float] = []
    pl.seed_everything(0, verbose=False)
    steps = args.every * (args.warmup + args.saves)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps,
                         callbacks=[checkpoint], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, default_root_dir=root)
    trainer.save_checkpoint = timing(trainer.save_checkpoint, saves)
    strategy.save_checkpoint = timing(strategy.save_checkpoint, in_strategy)
    started = time.perf_counter()
    trainer.fit(model(args), train_dataloaders=data(args, steps))
    fit = time.perf_counter() - started
    # a stall is the slower rank's
    return (max_over_ranks(stalls[args.warmup:]), max_over_ranks(saves[args.warmup:]),
            max_over_ranks(in_strategy[args.warmup:]), max_over_ranks([fit])[0])


def time_saves(checkpoint) -> tuple[list[float], list[float]]:
    """Time ``checkpoint.on_train_batch_end`` at the steps where it saved."""
    stalls: list[float] = []
    saves: list[float] = []
    original = checkpoint.on_train_batch_end

    def on_train_batch_end(trainer, *a, **kw):
        count = len(saves)
        started = time.perf_counter()
        original(trainer, *a, **kw)
        if len(saves) > count:  # it saved
            stalls.append(time.perf_counter() - started)

    checkpoint.on_train_batch_end = on_train_batch_end
    return stalls, saves


def model(args):
    import pytorch_lightning as pl
    from torch.distributed.fsdp import fully_shard

    width = int(math.sqrt(args.state_mib * (1 << 20) / 12 / args.layers))

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(args.layers)])

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for layer in self.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.layers, mesh=mesh)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.layers(x).square().mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    return Net()


def data(args, steps: int):
    from torch.utils.data import DataLoader, TensorDataset

    width = int(math.sqrt(args.state_mib * (1 << 20) / 12 / args.layers))
    rows = torch.randn(args.batch * 2, width, generator=torch.Generator().manual_seed(0))
    # every step the same rows again: the data costs nothing beside the model
    return DataLoader(TensorDataset(rows.repeat(steps, 1)), batch_size=args.batch)


def report(args, results) -> None:
    def ms(xs):
        return round(statistics.median(xs) * 1e3, 1)

    rows = {c: {"stall_ms": ms(r["stall"]), "save_checkpoint_ms": ms(r["save"]),
                "strategy_ms": ms(r["strategy"]),
                "fit_s": round(statistics.median(r["fit"]), 2), "saves": len(r["stall"])}
            for c, r in results.items()}
    ratio = rows["tierstore"]["stall_ms"] / rows["lightning"]["stall_ms"]
    summary = {"config": {k: v for k, v in vars(args).items() if k != "json"},
               "contenders": rows, "stall_ratio_tierstore_to_lightning": round(ratio, 3)}
    print(f"\nLightning ModelParallelStrategy, 2 ranks, {args.state_mib} MiB of state, "
          f"a save every {args.every} steps, {args.rounds} rounds")
    print(f"{'contender':10s} {'stall/save':>11s} {'save_checkpoint':>16s} {'strategy':>11s} "
          f"{'fit':>8s}")
    for c, r in rows.items():
        print(f"{c:10s} {r['stall_ms']:8.1f} ms {r['save_checkpoint_ms']:13.1f} ms "
              f"{r['strategy_ms']:8.1f} ms {r['fit_s']:6.2f} s")
    print(f"stall, tierstore / lightning: {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


# -- the launcher ----------------------------------------------------------------------------

def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this script under torchrun, 2 ranks on this machine."""
    return relaunch(__file__, argv, 2)


def main(argv: list[str] | None = None) -> int:
    """Under torchrun: be one rank. Otherwise: launch torchrun with these arguments."""
    return torchrun_main(argv, parse_args, worker, launch)


if __name__ == "__main__":
    sys.exit(main())
