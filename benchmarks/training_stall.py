"""Training stall: what a save on every step costs a real CPU training loop, tierstore's eager,
lazy and memory-budgeted staging against stock DCP (default staging and async staging), in one
process and one run.

Why
---
``staging.py`` times ``dcp.async_save`` on a state dict that nothing else touches. In training
the save shares the machine with the forward and backward passes, and what matters is how long
the *training thread* waits, and how much longer each step gets. Stock DCP copies the state dict
inside ``async_save`` (fresh buffers every save), or, with an async stager, in a thread that the
loop must wait for before ``optimizer.step()`` changes the parameters. tierstore's ``cpu`` staging
copies into reused buffers inside ``async_save`` (*eager*), or, with ``lazy = true``, lets
``async_save`` return at once and stages while forward and backward run; the training thread then
waits only for what is left of the copy when ``optimizer.step()`` comes (the step pre-hook of
``store.hook_optimizer``). With ``max_staging_bytes`` the lazy staging copies in waves of at most
that many bytes, so host memory grows by about the budget instead of the whole state. This
benchmark checks those three claims on a loop where a save every step is affordable.

What is trained
---------------
An MLP of ``--layers`` (default 5) square ``Linear`` layers (ReLU between them), fp32, with
``torch.optim.Adam(fused=True)``; the width is chosen so that parameters + ``exp_avg`` +
``exp_avg_sq`` (3x the parameters) come to about ``--state-mib`` MiB (default 1024: ~89M
parameters, width 4224). The batch (``--batch``, default 320 rows of random data, MSE loss
against random targets) makes a step take about 1.1 s on the shared 2-core machine, long enough
to write a save within a step. Fused Adam because it is what CPU training would use and because
it allocates no per-parameter temporaries (the for-loop Adam allocates two full-size temporaries
per parameter, which would show up in the RSS figure below); gradients are zeroed in place
(``zero_grad(set_to_none=False)``) so that they stay allocated and the RSS stays flat between
saves. One optimizer step runs before any timed step, so Adam's state exists and the state
dict's layout is the same on every save. ``torch.set_num_threads`` is left at its default.

The state dict saved is ``{"model": model.state_dict(), "optim": optimizer.state_dict()}``,
built anew each step.

One iteration (one *step*)
--------------------------
1. wait for the previous save's upload where the loop does so itself (``stock``: the previous
   ``async_save``'s future; ``stock-async-staging``: its ``upload_completion``);
2. ``dcp.async_save(state_dict, ..., async_checkpointer_type=AsyncCheckpointerType.THREAD)`` of
   the state left by the previous step (the save that ends step *i-1*, started at the top of
   step *i*: the same thing, placed where the staging can overlap the next forward/backward);
3. forward, backward;
4. wait for the staging in flight, where there is one (``stock-async-staging``:
   ``staging_completion.result()``; ``tierstore-lazy`` / ``-budget``: ``store.wait_staging()``,
   with the optimizer pre-hook of ``store.hook_optimizer(optimizer)`` registered too, which then
   finds nothing left to wait for; ``tierstore-eager``: ``staging_completion`` when tierstore
   returns an ``AsyncSaveResponse``, done by then);
5. ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=False)``.

**Blocking time** is the wall time of 1 + 2 + 4: everything the training thread spends waiting for
checkpointing. **Step time** is the wall time of 1-5. Between steps (untimed) the stock
contenders delete the checkpoint directories whose saves are done, so tmpfs does not fill
(tierstore deletes its oldest checkpoint itself, ``keep = 2``, in its background work: counted
where it slows a step).
After the last step the last save is waited for and the store or stager closed (untimed).
``--steps`` steps (default 8) are run per contender; the first ``--warmup`` (default 2) are
discarded (first-save allocations, DCP's lazy imports, thread start-up).

Contenders
----------
=======================  ==========================================================================
``none``                 no checkpoint; run first and again after the other in-process contenders
                         (its figure: the median of both passes' steps; the report shows each).
``stock``                ``dcp.async_save(sd, checkpoint_id=<fresh dir>)``: FileSystemWriter with
                         DCP's default stager (a fresh copy of the state dict inside
                         ``async_save``); the previous save's future waited before the next.
``stock-async-staging``  the same with ``async_stager=DefaultStager(StagingOptions(
                         use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                         use_non_blocking_copy=False))``, one stager for the run (its
                         ``StateDictStager`` keeps its buffers between saves): staging in a thread;
                         ``staging_completion`` waited before ``optimizer.step()``, the previous
                         ``upload_completion`` before the next ``async_save``.
``tierstore-eager``      ``dcp.async_save(sd, storage_writer=store.writer(),
                         checkpoint_id="step-<i>")``, store ``{"store": {"staging": {"name":
                         "cpu"}}, "tier": [{"name": "ram", "backend": "memory", "path": ...,
                         "keep": 2}]}``, one store per contender. tierstore makes a new save wait
                         for the previous one itself, inside ``async_save``: counted.
``tierstore-lazy``       the same with ``"lazy": True`` in the staging table and
                         ``store.hook_optimizer(optimizer)`` registered before the loop.
``tierstore-budget``     lazy with ``"max_staging_bytes": state_bytes // 4`` (rounded down to a
                         whole 4 KiB page: a budget that is not a multiple of the element size
                         made the wave buffer's second half start unaligned, a RuntimeError in
                         ``staging_waves``, when this benchmark was written). Run in a fresh
                         subprocess of this script (``--only tierstore-budget``) so that the other
                         contenders' memory does not pollute its RSS figure (see below).
``copy``                 ``torch._foreach_copy_`` of every tensor of the state dict into tensors
                         allocated once: the one-memory-copy yardstick. Three copies before the
                         first contender and after each in-process one; its figure is the median.
=======================  ==========================================================================

Checkpoints go to a temp directory under ``--dir`` (default ``/dev/shm``, which must have room
for about 3.3x the state), removed at the end.

**Peak RSS growth** (``tierstore-budget``): a thread samples ``VmRSS`` (and ``RssAnon``) from
``/proc/self/status`` every 5 ms from just before the contender's first save until its store is
closed; growth = peak - ``VmRSS`` read right before the first save. The target is
``1.25 x (budget + largest tensor of the state dict)``. Before that, two untimed steps without a
save are sampled the same way, for the training's own transient growth (activations), which the
growth figure includes; the report shows it beside.

The report
----------
A Markdown table, one row per contender: median and max blocking time, median step time, step
overhead vs ``none`` (median step - median ``none`` step), median blocking as a multiple of one
copy, the median of each blocking part (1 / 2 / 4 above), the median process CPU seconds per step
(user + system, every thread: the background save's work shows here, and on 2 cores it is what
lengthens the step beyond the blocking time), and every measured step's blocking. For
``tierstore-lazy`` and ``-budget`` part 4 is the wall time around ``store.wait_staging()``; the
seconds it says it waited are in the JSON (``waited_s``). Then the copy samples, ``none``'s two
passes, the RSS figures, and the target checks, PASS or FAIL:

* tierstore lazy median blocking <= 0.1x one copy
* tierstore lazy step overhead < min(stock, stock-async-staging) step overhead
* budget peak RSS growth <= 1.25 x (budget + largest tensor)

A contender that raises is reported as ERROR (its checks FAIL) and the run goes on.

How to run
----------
From the repository root::

    .venv/bin/python benchmarks/training_stall.py           # 1 GiB of state, 8 steps (~3 min)
    .venv/bin/python benchmarks/training_stall.py --state-mib 64 --steps 4   # smoke (~25 s)
    .venv/bin/python benchmarks/training_stall.py --only none,tierstore-lazy
    .venv/bin/python benchmarks/training_stall.py --json /tmp/training_stall.json

Progress lines go to stderr, the report to stdout. ``--strict`` makes the exit status 1 when a
target is missed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import tierstore

from harness import (GB, MlpTrainer as Trainer, add_mlp_trainer_args, add_output_args,
                     finish_report, fs_type, need_room, parser, print_table, progress_log,
                     remove, scratch, temp_file)

CONTENDERS = ("none", "stock", "stock-async-staging", "tierstore-eager", "tierstore-lazy",
              "tierstore-budget")
IN_ORDER = ("none", "stock", "stock-async-staging", "tierstore-eager", "tierstore-lazy")
SUBPROCESS = "tierstore-budget"
KEEP = 2                     # the tierstore tier's keep
COPIES_PER_SLOT = 3          # plain copies timed before the first contender and after each one
RSS_INTERVAL_S = 0.005
# Targets
LAZY_VS_COPY_MAX = 0.1
RSS_SLACK = 1.25
MiB = 1 << 20


# -- the training loop ----------------------------------------------------------------------------

def read_rss() -> tuple[int, int]:
    """(VmRSS, RssAnon) of this process in bytes."""
    rss = anon = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
    return rss, anon


class RssSampler:
    """A thread reading VmRSS / RssAnon every ``RSS_INTERVAL_S``; ``base`` is read when it
    starts, ``peak`` / ``peak_anon`` are the largest seen (the final read included)."""

    def __init__(self) -> None:
        self.base, self.base_anon = read_rss()
        self.peak, self.peak_anon = self.base, self.base_anon
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        rss, anon = read_rss()
        self.peak, self.peak_anon = max(self.peak, rss), max(self.peak_anon, anon)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(RSS_INTERVAL_S):
            self._take()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self._take()
        return {"base_bytes": self.base, "peak_bytes": self.peak,
                "growth_bytes": self.peak - self.base, "base_anon_bytes": self.base_anon,
                "peak_anon_bytes": self.peak_anon,
                "growth_anon_bytes": self.peak_anon - self.base_anon, "samples": self.samples}


# -- the contenders -------------------------------------------------------------------------------

@dataclass
class Env:
    """What every contender needs: options, the trainer, the temp directory, the payload."""

    args: argparse.Namespace
    trainer: Trainer
    base: str
    state_bytes: int
    largest_bytes: int
    log: Callable[[str], None]


class Saver:
    """One contender's checkpointing, as the loop calls it: ``before_save`` (wait for the
    previous upload), ``save``, ``before_step`` (wait for staging), ``between`` (untimed
    clean-up), ``drain`` (wait for the last save), ``close``. Waits return nothing; the loop
    times them. ``waited`` is what a tierstore ``wait_staging()`` said it waited (else None)."""

    def __init__(self, env: Env):
        self.env = env
        self.waited: float | None = None

    def before_save(self) -> None: ...
    def save(self, i: int, sd: dict) -> None: ...
    def before_step(self) -> None: ...
    def between(self) -> None: ...
    def drain(self) -> None: ...
    def close(self) -> None: ...


class NoSave(Saver):
    pass


class StockSaver(Saver):
    """``dcp.async_save(sd, checkpoint_id=<fresh dir>)``, optionally with one async stager."""

    def __init__(self, env: Env, async_staging: bool):
        super().__init__(env)
        self.root = os.path.join(env.base, "stock-async" if async_staging else "stock")
        os.makedirs(self.root)
        self.stager = (DefaultStager(StagingOptions(use_pinned_memory=False,
                                                    use_shared_memory=False,
                                                    use_async_staging=True,
                                                    use_non_blocking_copy=False))
                       if async_staging else None)
        self.upload: Any = None           # the in-flight save's upload future
        self.staging: Any = None          # its staging_completion (async staging)
        self.done_dirs: list[str] = []    # directories of saves known to be finished
        self.inflight_dir: str | None = None

    def before_save(self) -> None:
        if self.upload is not None:
            self.upload.result()
            self.upload = None
            self.done_dirs.append(self.inflight_dir)

    def save(self, i: int, sd: dict) -> None:
        path = os.path.join(self.root, f"step-{i}")
        kwargs: dict = {"checkpoint_id": path,
                        "async_checkpointer_type": AsyncCheckpointerType.THREAD}
        if self.stager is not None:
            kwargs["async_stager"] = self.stager
        resp = dcp.async_save(sd, **kwargs)
        self.inflight_dir = path
        self.staging = getattr(resp, "staging_completion", None)
        self.upload = getattr(resp, "upload_completion", resp)

    def before_step(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def between(self) -> None:
        for d in self.done_dirs:
            remove(d)
        self.done_dirs.clear()

    def drain(self) -> None:
        self.before_save()
        self.between()

    def close(self) -> None:
        try:
            if self.upload is not None:
                self.upload.result()
        finally:
            if self.stager is not None:
                self.stager.close()
            shutil.rmtree(self.root, ignore_errors=True)


class TierstoreSaver(Saver):
    """``dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-<i>")`` through
    one store with one ``memory`` tier; ``lazy`` and ``budget`` as the staging table says."""

    def __init__(self, env: Env, lazy: bool, budget: int | None):
        super().__init__(env)
        self.lazy = lazy
        self.root = os.path.join(env.base, "tierstore-" + ("budget" if budget else
                                                           "lazy" if lazy else "eager"))
        staging: dict = {"name": "cpu"}
        if lazy:
            staging["lazy"] = True
        if budget:
            staging["max_staging_bytes"] = budget
        self.config = {"store": {"staging": staging},
                       "tier": [{"name": "ram", "backend": "memory", "path": self.root,
                                 "keep": KEEP}]}
        self.store = tierstore.open(self.config)
        self.handle = None
        if lazy:
            self.handle = self.store.hook_optimizer(env.trainer.optimizer)
        self.upload: Any = None
        self.staging: Any = None

    def save(self, i: int, sd: dict) -> None:
        resp = dcp.async_save(sd, storage_writer=self.store.writer(), checkpoint_id=f"step-{i}",
                              process_group=self.store.process_group,
                              async_checkpointer_type=AsyncCheckpointerType.THREAD)
        self.staging = getattr(resp, "staging_completion", None)
        self.upload = getattr(resp, "upload_completion", resp)

    def before_step(self) -> None:
        if self.lazy:
            self.waited = float(self.store.wait_staging() or 0.0)
        elif self.staging is not None:
            self.staging.result()
        self.staging = None

    def drain(self) -> None:
        if self.upload is not None:
            self.upload.result()
            self.upload = None

    def close(self) -> None:
        try:
            if self.handle is not None and hasattr(self.handle, "remove"):
                self.handle.remove()
            self.handle = None
            self.store.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def budget_of(state_bytes: int) -> int:
    """``tierstore-budget``'s ``max_staging_bytes``: a quarter of the state."""
    return state_bytes // 4


def make_saver(name: str, env: Env) -> Saver:
    if name == "none":
        return NoSave(env)
    if name in ("stock", "stock-async-staging"):
        return StockSaver(env, async_staging=name == "stock-async-staging")
    if name == "tierstore-eager":
        return TierstoreSaver(env, lazy=False, budget=None)
    if name == "tierstore-lazy":
        return TierstoreSaver(env, lazy=True, budget=None)
    if name == "tierstore-budget":
        return TierstoreSaver(env, lazy=True, budget=budget_of(env.state_bytes))
    raise ValueError(name)


# -- one contender's run ---------------------------------------------------------------------------

@dataclass
class Step:
    """One measured iteration: the three blocking parts, their sum, the whole step, and what
    ``wait_staging()`` said it waited (lazy contenders)."""

    pre_save_s: float
    in_save_s: float
    pre_step_s: float
    blocking_s: float
    step_s: float
    waited_s: float | None = None
    #: process CPU seconds (user + system, all threads: background saves included) in the step
    cpu_s: float | None = None


@dataclass
class Run:
    """A contender's result: its measured steps (warm-up steps kept apart), RSS figures when
    sampled, the error when it raised."""

    name: str
    steps: list[Step] = field(default_factory=list)
    warmup_steps: list[Step] = field(default_factory=list)
    rss: dict | None = None
    error: str | None = None
    subprocess: bool = False
    #: the subprocess's training-alone RSS figures (``tierstore-budget`` run in a subprocess)
    training_rss: dict | None = None


def run_contender(name: str, env: Env, sample_rss: bool = False) -> Run:
    """``--warmup`` + ``--steps`` iterations of ``name`` (see the module docstring), then the
    drain and close (untimed)."""
    args, tr, log = env.args, env.trainer, env.log
    run = Run(name)
    saver: Saver | None = None
    sampler: RssSampler | None = None
    try:
        saver = make_saver(name, env)
        gc.collect()
        if sample_rss:
            sampler = RssSampler()   # its base: VmRSS right before the first save
        for i in range(args.warmup + args.steps):
            saver.waited = None
            c0 = time.process_time()
            t0 = time.perf_counter()
            saver.before_save()
            t1 = time.perf_counter()
            if name != "none":
                saver.save(i, tr.state_dict())
            t2 = time.perf_counter()
            tr.forward_backward()
            t3 = time.perf_counter()
            saver.before_step()
            t4 = time.perf_counter()
            tr.step()
            t5 = time.perf_counter()
            c5 = time.process_time()
            saver.between()
            s = Step(pre_save_s=t1 - t0, in_save_s=t2 - t1, pre_step_s=t4 - t3,
                     blocking_s=(t1 - t0) + (t2 - t1) + (t4 - t3), step_s=t5 - t0,
                     waited_s=saver.waited, cpu_s=c5 - c0)
            warm = i < args.warmup
            (run.warmup_steps if warm else run.steps).append(s)
            extra = ("" if s.waited_s is None
                     else f", wait_staging() said {s.waited_s * 1e3:.1f} ms")
            log(f"  {name:<19} step {i + 1:>2}{' (warm-up)' if warm else '':<10} blocking "
                f"{s.blocking_s:7.3f} s (pre-save {s.pre_save_s:.3f}, async_save "
                f"{s.in_save_s:.3f}, pre-step {s.pre_step_s:.3f}{extra})  step {s.step_s:6.3f} s"
                f"  cpu {s.cpu_s:6.3f} s")
        saver.drain()
    except Exception as e:  # noqa: BLE001 - reported as ERROR, the run goes on
        run.error = f"{type(e).__name__}: {e}"
        log(f"  {name}: ERROR {run.error}")
        log(traceback.format_exc())
    finally:
        if saver is not None:
            try:
                saver.close()
            except Exception as e:  # noqa: BLE001
                run.error = run.error or f"close: {type(e).__name__}: {e}"
                log(f"  {name}: ERROR while closing: {e}")
        if sampler is not None:
            run.rss = sampler.stop()
    return run


def time_copies(env: Env, dst: list[torch.Tensor], n: int) -> list[float]:
    """``n`` timed ``torch._foreach_copy_`` of the whole state into ``dst``."""
    src = env.trainer.tensors()
    out = []
    for _ in range(n):
        gc.collect()
        t0 = time.perf_counter()
        torch._foreach_copy_(dst, src)
        out.append(time.perf_counter() - t0)
    return out


def training_rss(env: Env, steps: int = 2) -> dict:
    """RSS growth of ``steps`` training steps without any save (the training's own transient
    memory: activations, autograd buffers), sampled like a contender's."""
    gc.collect()
    sampler = RssSampler()
    for _ in range(steps):
        env.trainer.forward_backward()
        env.trainer.step()
    return sampler.stop()


def run_budget_subprocess(args: argparse.Namespace, parent_dir: str,
                          log: Callable[[str], None]) -> Run:
    """``tierstore-budget`` in a fresh process of this script; its ``--json`` read back."""
    with temp_file("training-stall-budget-") as path:
        return _run_budget(args, parent_dir, log, path)


def _run_budget(args: argparse.Namespace, parent_dir: str, log: Callable[[str], None],
                path: str) -> Run:
    """:func:`run_budget_subprocess` with its figures going to ``path``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--only", SUBPROCESS,
           "--state-mib", str(args.state_mib), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--batch", str(args.batch),
           "--layers", str(args.layers), "--dir", parent_dir, "--json", path]
    if args.quiet:
        cmd.append("--quiet")
    log(f"{SUBPROCESS}: in a fresh subprocess: {' '.join(cmd[1:])}")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    try:
        with open(path) as f:
            doc = json.load(f)
        r = doc["contenders"][SUBPROCESS]
        return Run(SUBPROCESS, [Step(**s) for s in r["steps"]],
                   [Step(**s) for s in r["warmup_steps"]], r.get("rss"), r.get("error"),
                   subprocess=True, training_rss=doc.get("training_rss"))
    except (OSError, ValueError, KeyError) as e:
        tail = (proc.stdout or "")[-2000:]
        return Run(SUBPROCESS, error=f"subprocess exit {proc.returncode}, no figures "
                                     f"({type(e).__name__}: {e}); stdout tail: {tail}",
                   subprocess=True)


# -- figures and the report -----------------------------------------------------------------------

def figures_of(run: Run) -> dict:
    """A contender's JSON figures."""
    out: dict = {"steps": [asdict(s) for s in run.steps],
                 "warmup_steps": [asdict(s) for s in run.warmup_steps],
                 "error": run.error, "subprocess": run.subprocess}
    if run.rss is not None:
        out["rss"] = run.rss
    if run.steps:
        blocking = [s.blocking_s for s in run.steps]
        out.update({
            "median_blocking_s": statistics.median(blocking), "max_blocking_s": max(blocking),
            "median_step_s": statistics.median(s.step_s for s in run.steps),
            "median_pre_save_s": statistics.median(s.pre_save_s for s in run.steps),
            "median_in_save_s": statistics.median(s.in_save_s for s in run.steps),
            "median_pre_step_s": statistics.median(s.pre_step_s for s in run.steps),
            "median_cpu_s": statistics.median(s.cpu_s or 0.0 for s in run.steps),
        })
        waited = [s.waited_s for s in run.steps if s.waited_s is not None]
        if waited:
            out["median_waited_s"] = statistics.median(waited)
    return out


def summarize(runs: dict[str, Run], none_passes: list[Run], copies: list[float],
              env: Env, training: dict | None) -> dict:
    """Figures, overheads, ratios and the target checks, JSON-able."""
    contenders = {name: figures_of(r) for name, r in runs.items()}
    copy_med = statistics.median(copies) if copies else None
    none_med = contenders.get("none", {}).get("median_step_s")
    for f in contenders.values():
        if "median_step_s" in f and none_med is not None:
            f["step_overhead_s"] = f["median_step_s"] - none_med
        if "median_blocking_s" in f and copy_med:
            f["blocking_vs_copy"] = f["median_blocking_s"] / copy_med
    verdicts, skipped = [], []

    lazy = contenders.get("tierstore-lazy", {})
    if "tierstore-lazy" in runs and copy_med:
        ratio = lazy.get("blocking_vs_copy")
        verdicts.append({"target": f"tierstore lazy median blocking <= {LAZY_VS_COPY_MAX}x one "
                                   f"copy", "ratio": ratio, "max": LAZY_VS_COPY_MAX,
                         "pass": ratio is not None and ratio <= LAZY_VS_COPY_MAX})
    else:
        skipped.append("tierstore lazy median blocking <= 0.1x one copy (needs tierstore-lazy "
                       "and the copy)")
    stocks = [s for s in ("stock", "stock-async-staging")
              if "step_overhead_s" in contenders.get(s, {})]
    if "tierstore-lazy" in runs and none_med is not None and stocks:
        best = min(contenders[s]["step_overhead_s"] for s in stocks)
        mine = lazy.get("step_overhead_s")
        verdicts.append({"target": f"tierstore lazy step overhead < min({', '.join(stocks)}) "
                                   f"step overhead", "overhead_s": mine, "stock_min_s": best,
                         "pass": mine is not None and mine < best})
    else:
        skipped.append("tierstore lazy step overhead < min(stock, stock-async-staging) overhead "
                       "(needs none, tierstore-lazy and a stock contender)")
    budget = budget_of(env.state_bytes)
    target = RSS_SLACK * (budget + env.largest_bytes)
    rss_check = {"budget_bytes": budget, "largest_tensor_bytes": env.largest_bytes,
                 "target_bytes": target}
    if "tierstore-budget" in runs:
        rss = runs["tierstore-budget"].rss
        growth = rss["growth_bytes"] if rss else None
        verdicts.append({"target": f"budget peak RSS growth <= {RSS_SLACK} x (budget + largest "
                                   f"tensor)", "growth_bytes": growth, "max_bytes": target,
                         "pass": growth is not None and runs["tierstore-budget"].error is None
                         and growth <= target})
    else:
        skipped.append("budget peak RSS growth <= budget + largest tensor + 25% (needs "
                       "tierstore-budget)")
    return {"contenders": contenders,
            "none_passes": [figures_of(r) for r in none_passes],
            "copy": {"seconds": copies, "median_s": copy_med,
                     "gbps": env.state_bytes / copy_med / GB if copy_med else None},
            "training_rss": training, "rss_target": rss_check,
            "verdicts": verdicts, "skipped": skipped}


def _s(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MiB:.0f} MiB"


def print_report(summary: dict, env: Env, order: list[str], why: str) -> None:
    args, tr = env.args, env.trainer
    c = summary["contenders"]
    print()
    print(f"MLP {args.layers} x Linear({tr.width}, {tr.width}), {tr.n_params / 1e6:.1f}M params, "
          f"fused Adam: state {env.state_bytes / MiB:.0f} MiB ({env.state_bytes / GB:.2f} GB; "
          f"largest tensor {env.largest_bytes / MiB:.0f} MiB), batch {args.batch}; "
          f"{args.steps} measured steps per contender after {args.warmup} warm-up; checkpoints "
          f"under {env.base} ({fs_type(env.base)}; {why}); {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print("Blocking: time the training thread waits for checkpointing (previous upload before "
          "async_save + async_save + staging before optimizer.step()); step: the whole "
          "iteration. Overhead: median step - median `none` step. x copy: median blocking / "
          "median plain copy of the whole state. CPU s: median process CPU time (user + system, "
          "all threads, so the background save's work too) per step.")
    print()
    rows = []
    for name in order:
        f = c.get(name)
        if f is None:
            continue
        label = name + (" (subprocess)" if f.get("subprocess") else "")
        error = f.get("error")
        if error and len(error) > 160:
            error = error[:157] + "..."
        if "median_blocking_s" not in f:
            rows.append([label, f"ERROR: {error}", "", "", "", "", "", "", ""])
            continue
        parts = (f"{f['median_pre_save_s']:.3f} / {f['median_in_save_s']:.3f} / "
                 f"{f['median_pre_step_s']:.3f}")
        per = " ".join(f"{s['blocking_s']:.3f}" for s in f["steps"])
        ratio = f.get("blocking_vs_copy")
        err = f" (ERROR: {error})" if error else ""
        rows.append([f"{label}{err}", f"{f['median_blocking_s']:.3f}",
                     f"{f['max_blocking_s']:.3f}", f"{f['median_step_s']:.3f}",
                     _s(f.get("step_overhead_s"), "+.3f"), f"{_s(ratio, '.2f')}x", parts,
                     f"{f['median_cpu_s']:.2f}", per])
    cp = summary["copy"]
    rows.append(["copy (one plain copy of the state)", _s(cp["median_s"]),
                 _s(max(cp["seconds"]) if cp["seconds"] else None), "", "", "1.00x", "", "",
                 " ".join(f"{x:.3f}" for x in cp["seconds"])] if cp["seconds"] else
                ["copy", "- (not measured in this process)", "", "", "", "", "", "", ""])
    print_table(["contender", "median blocking s:", "max blocking s:", "median step s:",
                 "step overhead vs none s:", "blocking x copy:",
                 "pre-save / async_save / pre-step s (medians)", "CPU s per step:",
                 "blocking per step (s)"], rows)
    print()
    if cp["seconds"]:
        print(f"Copy: median {cp['median_s'] * 1e3:.1f} ms ({cp['gbps']:.1f} GB/s), "
              f"{len(cp['seconds'])} samples ({COPIES_PER_SLOT} before the first contender and "
              f"after each in-process one).")
    passes = summary["none_passes"]
    if len(passes) == 2 and all("median_step_s" in p for p in passes):
        print(f"none: median step {passes[0]['median_step_s']:.3f} s in the first pass, "
              f"{passes[1]['median_step_s']:.3f} s in the second (the machine's drift over the "
              f"run).")
    for name in order:
        f = c.get(name, {})
        if "median_waited_s" in f:
            print(f"{name}: store.wait_staging() reported a median of "
                  f"{f['median_waited_s'] * 1e3:.2f} ms waited (the table's pre-step part is the "
                  f"wall time around that call).")
    t = summary["rss_target"]
    tr_rss = summary.get("training_rss")
    if "tierstore-budget" in c:
        rss = c["tierstore-budget"].get("rss")
        if rss:
            print(f"tierstore-budget RSS: VmRSS {_mib(rss['base_bytes'])} before the first save, "
                  f"peak {_mib(rss['peak_bytes'])}: growth {_mib(rss['growth_bytes'])} "
                  f"(RssAnon growth {_mib(rss['growth_anon_bytes'])}; {rss['samples']} samples); "
                  f"budget {_mib(t['budget_bytes'])} + largest tensor "
                  f"{_mib(t['largest_tensor_bytes'])}, x {RSS_SLACK} = target "
                  f"{_mib(t['target_bytes'])}.")
        if tr_rss:
            print(f"Training alone (2 steps, no save, same subprocess): peak VmRSS growth "
                  f"{_mib(tr_rss['growth_bytes'])} (activations and autograd buffers), included "
                  f"in the growth above.")
    for name in order:
        if c.get(name, {}).get("error"):
            print(f"ERROR in {name}: {c[name]['error']}")
    print()
    for v in summary["verdicts"]:
        word = "PASS" if v["pass"] else "FAIL"
        if "ratio" in v:
            detail = f"{_s(v['ratio'], '.3f')}x"
        elif "overhead_s" in v:
            detail = (f"lazy {_s(v['overhead_s'], '+.3f')} s vs best stock "
                      f"{_s(v['stock_min_s'], '+.3f')} s")
        else:
            detail = f"{_mib(v['growth_bytes'])} vs {_mib(v['max_bytes'])}"
        print(f"{word}: {v['target']}: {detail}")
    for s in summary["skipped"]:
        print(f"SKIP: {s}")


# -- options and main -----------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    add_mlp_trainer_args(p)
    p.add_argument("--steps", type=int, default=8,
                   help="measured steps per contender (default 8)")
    p.add_argument("--warmup", type=int, default=2,
                   help="steps run first and discarded, per contender (default 2)")
    p.add_argument("--only", default=None,
                   help="comma-separated contenders to run (default: all): "
                        + ", ".join(CONTENDERS))
    p.add_argument("--dir", default=None,
                   help="parent of the temp directory (default /dev/shm; needs ~3.3x the state)")
    add_output_args(p, quiet="no per-step progress lines")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.layers < 1:
        p.error("--steps, --batch and --layers must be at least 1, --warmup at least 0")
    if args.state_mib < 1:
        p.error("--state-mib must be at least 1")
    chosen = CONTENDERS if args.only is None else tuple(
        s.strip() for s in args.only.split(",") if s.strip())
    bad = [s for s in chosen if s not in CONTENDERS]
    if bad or not chosen:
        p.error(f"--only: unknown contender(s) {bad}; choose from {', '.join(CONTENDERS)}")
    args.chosen = chosen
    return args


def pick_dir(args: argparse.Namespace, state_bytes: int) -> tuple[str, str]:
    """``--dir`` or /dev/shm, checked for room: ``KEEP`` + 1 checkpoints at once, +10%."""
    need = int((KEEP + 1) * state_bytes * 1.1) + (64 << 20)
    parent = args.dir or "/dev/shm"
    need_room(parent, need, "use --dir")
    return parent, "--dir" if args.dir else "default"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = progress_log(args.quiet)
    t_start = time.perf_counter()
    chosen = args.chosen
    alone_budget = chosen == (SUBPROCESS,)
    in_process = [c for c in IN_ORDER if c in chosen]

    trainer = Trainer(args)
    tensors = trainer.tensors()
    state_bytes = sum(t.nbytes for t in tensors)
    largest = max(t.nbytes for t in tensors)
    parent, why = pick_dir(args, state_bytes)
    runs: dict[str, Run] = {}
    none_passes: list[Run] = []
    copies: list[float] = []
    training = None
    with scratch("tierstore-training-stall-", parent) as base:
        env = Env(args, trainer, base, state_bytes, largest, log)
        log(f"model: {args.layers} x Linear({trainer.width}), {trainer.n_params / 1e6:.1f}M "
            f"params, state {state_bytes / MiB:.0f} MiB; dir {base}; contenders: "
            f"{', '.join(chosen)}")
        if alone_budget:
            training = training_rss(env)
            log(f"training alone: peak RSS growth {training['growth_bytes'] / MiB:.0f} MiB")
            runs[SUBPROCESS] = run_contender(SUBPROCESS, env, sample_rss=True)
        else:
            dst = [torch.empty_like(t) for t in tensors]
            for t in dst:
                t.zero_()   # touched now, outside any timed region
            copies += time_copies(env, dst, COPIES_PER_SLOT)
            for name in in_process:
                log(f"{name}:")
                r = run_contender(name, env)
                if name == "none":
                    none_passes.append(r)
                runs[name] = r
                copies += time_copies(env, dst, COPIES_PER_SLOT)
            if "none" in chosen and len(in_process) > 1:
                log("none (second pass):")
                r2 = run_contender("none", env)
                none_passes.append(r2)
                merged = Run("none", none_passes[0].steps + r2.steps,
                             none_passes[0].warmup_steps + r2.warmup_steps,
                             error=none_passes[0].error or r2.error)
                runs["none"] = merged
            del dst
            if SUBPROCESS in chosen:
                r = run_budget_subprocess(args, parent, log)
                training = r.training_rss
                runs[SUBPROCESS] = r

    summary = summarize(runs, none_passes, copies, env, training)
    order = [c for c in CONTENDERS if c in runs]
    print_report(summary, env, order, why)
    config = {"state_mib": args.state_mib, "state_bytes": state_bytes,
              "largest_tensor_bytes": largest, "params": trainer.n_params,
              "width": trainer.width, "layers": args.layers, "batch": args.batch,
              "steps": args.steps, "warmup": args.warmup, "contenders": list(chosen),
              "dir": parent, "fs_type": fs_type(parent), "keep": KEEP,
              "torch_threads": torch.get_num_threads()}
    return finish_report(args, config, summary, t_start)


if __name__ == "__main__":
    sys.exit(main())
