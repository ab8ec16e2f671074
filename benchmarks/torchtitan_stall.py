"""torchtitan's checkpoint stall: the time its training loop spends in ``checkpointer.save`` (and
in ``maybe_wait_for_staging`` before the optimizer step), with torchtitan's own DCP checkpoint
manager against tierstore's (``tierstore.integrations.torchtitan``), in one process and one run.

What is trained
---------------
A stack of ``--layers`` square ``Linear`` layers (fp32) whose parameters and AdamW moments come
to about ``--state-mib`` MiB, with torchtitan's own ``OptimizersContainer`` (``default_adamw``,
``foreach``) and ``LRSchedulersContainer``, and the checkpoint manager that
``config.checkpoint.build(...)`` makes, given what the trainer gives it. Each step is the
trainer's: forward and backward on a fixed batch, ``maybe_wait_for_staging()``,
``optimizers.step()``, ``lr_schedulers.step()``, ``save(step)`` with ``interval = 1`` (a save
every step). One process, a one-rank gloo group (torchtitan's async modes make a gloo group of
their own; tierstore's store makes its own too).

Contenders, each with components of its own built from the same seed; in each round their jobs
run side by side, step by step (every contender takes step *k*, in an order that turns each
step, before any takes step *k+1*), so that what else loads the machine falls on all alike:

- ``torchtitan async``: torchtitan's ``CheckpointManager``, ``async_mode = "async"`` (DCP's
  default staging, fresh buffers every save), files in ``<dir>/torchtitan``, ``keep_latest_k =
  2``;
- ``tierstore async``: ``TierstoreCheckpointManager``, ``async_mode = "async"`` (eager staging
  into reused buffers), a ``memory`` tier in ``<dir>/tierstore/ram`` (``keep = 2``) and a
  ``local`` tier ``<dir>/tierstore/disk`` taking every 5th step (``keep = 2``);
- ``tierstore async_with_pinned_mem``: the same with lazy staging (``save`` returns at once, the
  copy runs beside the next forward and backward, and ``maybe_wait_for_staging`` waits for what
  is left of it);
- ``torchtitan async_with_pinned_mem``, where it runs: its ``DefaultStager`` asks for pinned
  memory and non-blocking copies, which need CUDA; without it the contender is reported as not
  run, with torchtitan's error.

**Stall** is the median over the timed steps (``--steps`` after ``--warmup``) of the time in
``save``; **previous** is the part of it spent waiting for the previous save to finish (both
managers keep one save in flight: a save whose writes outlast a step makes the next one wait);
**blocked** adds the time in ``maybe_wait_for_staging``: all the training loop waits for
checkpointing. The ratios are each contender's stall against ``torchtitan async`` in the
same round, and their median. **Step work** is the median time of forward, backward and the
optimizer step: it shows how loaded the machine was in each round (on a shared 2-core machine
it varies from moment to moment, which is why the contenders run step by step side by side).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
import warnings

import torch
import torch.distributed as dist

from harness import GB, median, parser, progress_log, rotated, scratch

CONTENDERS = ("torchtitan async", "tierstore async", "tierstore async_with_pinned_mem",
              "torchtitan async_with_pinned_mem")

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
every = 5
keep = 2
"""


def width_of(args: argparse.Namespace) -> int:
    """The layers' width that makes params + AdamW moments about ``--state-mib``."""
    return max(64, round(math.sqrt(args.state_mib * (1 << 20) / 4 / 3 / args.layers) / 64) * 64)


def state_bytes(args: argparse.Namespace) -> int:
    """Bytes of params (weights and biases) and the two AdamW moments."""
    width = width_of(args)
    return args.layers * (width * width + width) * 4 * 3


def build_job(args: argparse.Namespace, contender: str, root: str):
    """Model, torchtitan's containers and the contender's checkpointer, as the trainer builds
    them; returns (model, optimizers, lr_schedulers, checkpointer, batch)."""
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from tierstore.integrations.torchtitan import TierstoreCheckpointManager

    torch.manual_seed(0)
    width = width_of(args)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(args.layers)])
    optimizer_config = default_adamw(lr=1e-5)
    optimizer_config.implementation = "foreach"
    optimizers = optimizer_config.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(
        optimizers=optimizers, training_steps=args.warmup + args.steps)
    manager, async_mode = contender.split()
    common = {"enable": True, "interval": 1, "async_mode": async_mode,
              "initial_load_model_only": False}
    if manager == "tierstore":
        os.makedirs(root)
        tiers = os.path.join(root, "tiers.toml")
        with open(tiers, "w") as f:
            f.write(TIERS.replace("{root}", root))
        config = TierstoreCheckpointManager.Config(tiers=tiers, **common)
    else:
        config = CheckpointManager.Config(folder=root, keep_latest_k=2, **common)
    checkpointer = config.build(dataloader=None, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=lr_schedulers, states={}, sd_adapter=None)
    batch = torch.randn(args.batch, width, generator=torch.Generator().manual_seed(1))
    return model, optimizers, lr_schedulers, checkpointer, batch


class Job:
    """One contender's training job; :meth:`step` runs one of the trainer's steps and times
    it."""

    def __init__(self, args: argparse.Namespace, contender: str, root: str):
        self.contender, self.root = contender, root
        (self.model, self.optimizers, self.lr_schedulers, self.checkpointer,
         self.batch) = build_job(args, contender, root)

    def step(self, step: int) -> dict[str, float]:
        """Seconds: ``stall`` in ``save`` (the trainer's call), ``previous`` the part of it that
        waited for the previous save to finish (timed apart by calling
        ``maybe_wait_for_saving`` first, as ``save`` itself does), ``staging`` in
        ``maybe_wait_for_staging``, ``work`` in forward, backward and the optimizer step."""
        t0 = time.perf_counter()
        self.model(self.batch).square().mean().backward()
        t1 = time.perf_counter()
        self.checkpointer.maybe_wait_for_staging()
        t2 = time.perf_counter()
        self.optimizers.step()
        self.optimizers.zero_grad()
        self.lr_schedulers.step()
        t3 = time.perf_counter()
        self.checkpointer.maybe_wait_for_saving()
        t4 = time.perf_counter()
        self.checkpointer.save(step)
        t5 = time.perf_counter()
        return {"stall": t5 - t3, "previous": t4 - t3, "staging": t2 - t1,
                "work": (t1 - t0) + (t3 - t2)}

    def close(self) -> None:
        """Wait for the last save, close the checkpointer, remove the checkpoints."""
        try:
            self.checkpointer.maybe_wait_for_saving()
            self.checkpointer.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def run_round(args: argparse.Namespace, rnd: int, parent: str, not_run: dict[str, str],
              log) -> dict[str, list[dict[str, float]]]:
    """One round: every contender's job built, then step by step each takes its step (in an
    order that turns round every step), so that what else loads the machine falls on all of
    them alike. A contender that cannot save here goes to ``not_run``."""
    jobs = {c: Job(args, c, os.path.join(parent, f"{rnd}-{c.replace(' ', '-')}"))
            for c in CONTENDERS if c not in not_run}
    timed: dict[str, list[dict[str, float]]] = {c: [] for c in jobs}
    try:
        for step in range(1, args.warmup + args.steps + 1):
            for contender in rotated(tuple(jobs), step):
                try:
                    record = jobs[contender].step(step)
                except AssertionError as exc:  # torchtitan's DefaultStager without CUDA
                    not_run[contender] = str(exc)
                    log(f"round {rnd + 1}: {contender}: not run here: {exc}")
                    jobs.pop(contender).close()
                    timed.pop(contender)
                    continue
                if step > args.warmup:
                    timed[contender].append(record)
    finally:
        for job in jobs.values():
            job.close()
    return timed


def medians(steps: list[dict[str, float]]) -> dict[str, float]:
    """A round's medians over its timed steps; ``blocked`` is stall + staging wait."""
    out = {k: median(s[k] for s in steps) for k in steps[0]}
    out["blocked"] = median(s["stall"] + s["staging"] for s in steps)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--state-mib", type=int, default=48,
                   help="parameters + AdamW moments in MiB (default 48)")
    p.add_argument("--layers", type=int, default=4, help="Linear layers (default 4)")
    p.add_argument("--batch", type=int, default=1024,
                   help="batch rows (default 1024: a step of a few hundred ms on 2 cores, "
                        "longer than a save's writes, so a save does not wait for the last)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round (default 10)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps first (default 2): first-save allocations and imports")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds, each with fresh jobs for every contender (default 5)")
    p.add_argument("--dir", default=None,
                   help="where the checkpoints go (default: a new directory in the temp dir)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = progress_log(args.quiet)
    warnings.filterwarnings("ignore", category=UserWarning)
    try:
        import torchtitan  # noqa: F401
    except ModuleNotFoundError:
        raise SystemExit("torchtitan is not installed: pip install 'tierstore[torchtitan]' (or "
                         "make test's set-up: tyro and spmd-types, then torchtitan with "
                         "--no-deps)") from None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    results: dict[str, list[list[dict[str, float]]]] = {c: [] for c in CONTENDERS}
    not_run: dict[str, str] = {}
    started = time.perf_counter()
    try:
        with scratch("torchtitan-stall-", args.dir) as parent:
            for rnd in range(args.rounds):
                for contender, steps in run_round(args, rnd, parent, not_run, log).items():
                    results[contender].append(steps)
                    m = medians(steps)
                    log(f"round {rnd + 1}: {contender}: stall {m['stall'] * 1e3:.1f} ms per "
                        f"save ({m['previous'] * 1e3:.1f} waiting for the previous one), blocked "
                        f"{m['blocked'] * 1e3:.1f} ms; the step's own work "
                        f"{m['work'] * 1e3:.0f} ms")
    finally:
        dist.destroy_process_group()

    state = state_bytes(args)
    print(f"\ntorchtitan checkpoint stall, {state / (1 << 20):.0f} MiB of params + AdamW state, "
          f"a save every step, {args.steps} timed steps x {args.rounds} rounds, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}; medians per round, in ms")
    print(f"{'round':>5}  {'contender':34} {'stall':>7} {'previous':>9} {'blocked':>8} "
          f"{'vs torchtitan':>14} {'step work':>10}")
    base = [medians(r)["stall"] for r in results["torchtitan async"]]
    ratios: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    for rnd in range(args.rounds):
        for contender in CONTENDERS:
            if contender in not_run:
                continue
            m = medians(results[contender][rnd])
            ratios[contender].append(m["stall"] / base[rnd])
            print(f"{rnd + 1:>5}  {contender:34} {m['stall'] * 1e3:7.1f} "
                  f"{m['previous'] * 1e3:9.1f} {m['blocked'] * 1e3:8.1f} "
                  f"{ratios[contender][-1]:13.2f}x {m['work'] * 1e3:10.0f}")
    print("\nstall against torchtitan async, median of the rounds:")
    for contender in CONTENDERS:
        if contender in not_run:
            print(f"  {contender}: not run here: {not_run[contender]}")
        else:
            print(f"  {contender}: {median(ratios[contender]):.2f}x "
                  f"(per round: {', '.join(f'{x:.2f}' for x in ratios[contender])})")
    copy_s = state / GB / 17.0  # DESIGN.md: a memory copy runs at about 17 GB/s here
    print(f"(stall: the time in save; previous: the part of it spent waiting for the previous "
          f"save; blocked: stall + maybe_wait_for_staging; one memory copy of the state takes "
          f"about {copy_s * 1e3:.1f} ms at 17 GB/s; total {time.perf_counter() - started:.0f} s)")
    return 0


def _cell(xs: list[float], digits: int = 1) -> str:
    return " ".join(f"{x * 1e3:.{digits}f}" for x in xs)


if __name__ == "__main__":
    sys.exit(main())
