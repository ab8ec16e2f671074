"""Lazy staging's copy on a 2-core CPU: a background thread against copying in the training's
idle moments, with raw torch copies in a CPU training loop, in one process and one run.

Why
---
tierstore's lazy staging copies the state dict off the training tensors *after*
``dcp.async_save`` returns, on a background thread, while the next step's forward and backward
run; the next ``optimizer.step()`` waits for what is left of the copy. On a CPU machine with two
cores the copy then competes with the training's own computation for the same cores. The
alternative is to copy in the training's *idle moments* (while the training thread waits for its
next batch from a data loader) on the training thread itself, and to do whatever is left right
before the optimizer step. Which one costs a step less? This benchmark measures it without
tierstore: the copies are the ones tierstore's ``cpu`` staging makes (``torch._foreach_copy_``
into destination tensors allocated once, in batches of about 64 MiB), timed in a real training
loop with a simulated data-loader wait.

What is trained
---------------
An MLP of ``--layers`` (default 5) square ``Linear`` layers (ReLU between them), fp32, with
``torch.optim.Adam(fused=True)``; the width is chosen so that the parameters + ``exp_avg`` +
``exp_avg_sq`` come to about ``--state-mib`` MiB (default 1024: ~89M parameters, width 4224), the
same model as ``training_stall.py``. One fixed batch of ``--batch`` rows (default 320) of random
data, MSE loss against random targets; gradients are zeroed in place. ``torch.set_num_threads`` is
left at its default (the background copy's ``copy_`` kernels use torch's intra-op threads too).

The **state** copied is every tensor of the model's parameters and of the optimizer's state
(``step``, ``exp_avg``, ``exp_avg_sq``), in state-dict order, into destination tensors allocated
and touched once, before anything is timed. The copy is cut into *chunks* of about
``--chunk-mib`` MiB (default 64, tierstore's ``COPY_BATCH_BYTES``; whole tensors, in order, a
chunk closed once it reaches the size), one ``torch._foreach_copy_`` per chunk under
``torch.no_grad()``.

One step
--------
The copy of the values at the end of one step must be finished before the next step's
``optimizer.step()``. One measured *step* is therefore, on the training thread:

1. what the variant does right after the previous step ended (``eager``: the whole copy;
   ``thread`` / ``thread+idle``: start the copy's thread); the *post-step* part;
2. the **data-loader wait**: ``idle`` seconds (see below), slept (``idle`` / ``thread+idle``:
   spent copying chunks on the training thread while the wait's time lasts, then sleeping what
   is left of it; a chunk started just before the wait ends runs over it);
3. forward, backward;
4. the **wait before optimizer.step**: ``thread``: waiting for the thread's copy; ``idle``: the
   training thread copies the chunks left; ``thread+idle``: the training thread copies chunks
   left beside the thread, then waits for the thread's last chunk;
5. ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=False)``.

**Step time**: wall time of 1-5. Because step 1 does the copy owed by the step before, a step
leaves nothing running behind it, so the steps of different variants can be interleaved.

=================  ================================================================================
``none``           no copy: the baseline step.
``eager``          the whole copy right after the step, on the training thread (blocking).
``thread``         the copy on a fresh background thread started right after the step (as
                   tierstore's lazy staging does); the training thread only waits for it before
                   ``optimizer.step()``.
``idle``           no thread: the training thread copies chunks during the data-loader wait, and
                   the rest right before ``optimizer.step()``.
``thread+idle``    the background thread, and the training thread taking chunks from the same
                   queue during the wait and before ``optimizer.step()``.
=================  ================================================================================

The data-loader wait
--------------------
Before anything else, ``--calibration-steps`` (default 5, after 2 unmeasured) steps without a copy
and without a wait give the compute time ``C`` of a step (forward + backward + optimizer step): the
*fastest* of them, because a noisy neighbour only ever lengthens a step (on the shared machine a 1
GiB step takes 1.1 s, or 2.4 s in a busy phase, and such phases last several steps, so a median of
a few can double every wait; a whole calibration inside one still can, which is why the report
gives the share the wait really was). For an idle fraction ``f`` (``--idle-fraction``, a
comma-separated list, default ``0.0,0.3``: both run in one invocation) the wait is ``f / (1 - f) *
C``, so that in an undisturbed ``none`` step the wait is the fraction ``f`` of the step; the report
gives the share it really was (median wait / median ``none`` step). ``0.0``: no wait at all (the
batch is always ready).

Order and fairness
------------------
Per idle fraction: ``--warmup`` rounds (default 2, discarded), then ``--steps`` measured rounds
(default 8); a round runs one step of every variant, in round-robin order whose first variant
rotates from round to round, so a noisy neighbour on the shared machine hits every variant alike.
``gc.collect()`` (untimed) before each step. In the first warm-up round of each fraction, each
copying variant's destination is filled with NaN before its step and compared with the sources
bit for bit (``torch.equal``) right before ``optimizer.step()``: the copy must be complete and
hold the values of the end of the step before (the run stops otherwise).

One **plain copy** of the state (the chunked copy on the training thread with nothing else
running, as ``eager`` does it) is timed 3 times before the first fraction and after each
fraction; its median is the yardstick of the overheads.

The report
----------
A Markdown table, one row per idle fraction and variant: the median step time; the *overhead* vs
``none`` (median step - median ``none`` step of the same fraction) in ms and as a multiple of one
plain copy; the median *wait before optimizer.step* (part 4 above); the median of the training
thread's time on the copy outside the data-loader wait, copying or waiting (parts 1 and 4: what the
copy blocks training for); the median length of the wait (part 2, to see chunks running over it);
how much of the state was copied by the end of the wait; the copy's span (from its first chunk's
start to its last chunk's end); the median process CPU seconds per step (all threads); and each
round's step time minus the same round's ``none`` step. Then, per fraction, which variant had the
lowest overhead, and ``idle`` (and ``thread+idle``) against ``thread`` round by round (the same
round, the same machine state: the noise indicator), and a conclusion in words computed from those
figures.

How to run
----------
From the repository root::

    .venv/bin/python benchmarks/lazy_ordering.py                          # 1 GiB of state (~4 min)
    .venv/bin/python benchmarks/lazy_ordering.py --state-mib 64 --steps 3  # smoke run (~10 s)
    .venv/bin/python benchmarks/lazy_ordering.py --idle-fraction 0,0.15,0.3,0.5
    .venv/bin/python benchmarks/lazy_ordering.py --json /tmp/lazy_ordering.json

Progress lines go to stderr, the report to stdout. There are no acceptance targets: the
benchmark answers a design question.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from harness import (GB, MlpTrainer as Trainer, add_mlp_trainer_args, add_output_args,
                     finish_report, median, parser, print_table, progress_log, rotated)

VARIANTS = ("none", "eager", "thread", "idle", "thread+idle")
COPYING = VARIANTS[1:]
HELPS_IN_WAIT = ("idle", "thread+idle")
BACKGROUND = ("thread", "thread+idle")
COPIES_PER_SLOT = 3          # plain copies timed before the first fraction and after each one
CALIBRATION_WARMUP = 2       # unmeasured steps before the calibration steps
MiB = 1 << 20


# -- the training loop ----------------------------------------------------------------------------

# -- the copy --------------------------------------------------------------------------------------

@dataclass
class Chunk:
    """Destination and source tensors copied by one ``torch._foreach_copy_``."""

    dsts: list[torch.Tensor]
    srcs: list[torch.Tensor]
    nbytes: int


def split_chunks(dsts: list[torch.Tensor], srcs: list[torch.Tensor],
                 chunk_bytes: int) -> list[Chunk]:
    """Whole tensors in order, a chunk closed once it holds ``chunk_bytes`` (tierstore's
    ``split_copies``)."""
    chunks: list[Chunk] = []
    cur = Chunk([], [], 0)
    for d, s in zip(dsts, srcs):
        cur.dsts.append(d)
        cur.srcs.append(s)
        cur.nbytes += d.nbytes
        if cur.nbytes >= chunk_bytes:
            chunks.append(cur)
            cur = Chunk([], [], 0)
    if cur.dsts:
        chunks.append(cur)
    return chunks


class CopyJob:
    """One copy of the whole state: a queue of chunks that a background thread (when
    ``background``) and the training thread (``help_until``, ``finish(help=True)``) take from."""

    def __init__(self, chunks: list[Chunk], background: bool):
        self.chunks = chunks
        self._next = 0
        self._left = len(chunks)          # chunks not finished yet
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.bytes_done = 0
        self.main_bytes = 0               # copied by the training thread
        self.t_start: float | None = None   # the first chunk's start
        self.t_end: float | None = None     # the last chunk's end
        if not chunks:
            self.t_start = self.t_end = time.perf_counter()
            self._done.set()
        self._thread: threading.Thread | None = None
        if background and chunks:
            self._thread = threading.Thread(target=self._worker, name="copy", daemon=True)
            self._thread.start()

    def _take(self) -> Chunk | None:
        with self._lock:
            if self._next >= len(self.chunks):
                return None
            if self._next == 0:
                self.t_start = time.perf_counter()
            self._next += 1
            return self.chunks[self._next - 1]

    def _copy(self, chunk: Chunk, on_main: bool) -> None:
        with torch.no_grad():
            torch._foreach_copy_(chunk.dsts, chunk.srcs)
        with self._lock:
            self.bytes_done += chunk.nbytes
            if on_main:
                self.main_bytes += chunk.nbytes
            self._left -= 1
            if self._left == 0:
                self.t_end = time.perf_counter()
                self._done.set()

    def _worker(self) -> None:
        try:
            while (chunk := self._take()) is not None:
                self._copy(chunk, on_main=False)
        except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
            self.error = e
            self._done.set()

    def help_until(self, deadline: float) -> None:
        """Copy chunks on this thread while ``deadline`` (a ``perf_counter``) is not reached."""
        while time.perf_counter() < deadline and (chunk := self._take()) is not None:
            self._copy(chunk, on_main=True)

    def finish(self, help: bool) -> None:
        """Copy what is left on this thread (``help``), then wait until every chunk is done."""
        if help:
            while (chunk := self._take()) is not None:
                self._copy(chunk, on_main=True)
        self._done.wait()
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error


def time_copies(chunks: list[Chunk], n: int) -> list[float]:
    """``n`` timed plain copies of the whole state (the chunks in order, this thread)."""
    out = []
    for _ in range(n):
        gc.collect()
        t0 = time.perf_counter()
        CopyJob(chunks, background=False).finish(help=True)
        out.append(time.perf_counter() - t0)
    return out


# -- one step --------------------------------------------------------------------------------------

@dataclass
class Step:
    """One step of one variant (see the module docstring for the parts)."""

    step_s: float
    post_step_s: float       # part 1
    wait_s: float            # part 2: the data-loader wait as it ran
    compute_s: float         # parts 3 + 5: forward, backward, optimizer step
    pre_step_s: float        # part 4: the wait before optimizer.step
    copied_by_wait_end: float   # fraction of the state's bytes copied when the wait ended
    copied_in_wait_main: float  # fraction copied by the training thread during the wait
    copy_span_s: float | None   # the first chunk's start to the last chunk's end
    cpu_s: float             # process CPU seconds (all threads)


@dataclass
class Env:
    args: argparse.Namespace
    trainer: Trainer
    srcs: list[torch.Tensor]
    dsts: list[torch.Tensor]
    chunks: list[Chunk]
    state_bytes: int
    log: Callable[[str], None]


def check_copy(env: Env, variant: str) -> None:
    """The copy must hold the sources' values bit for bit (raises SystemExit otherwise)."""
    for i, (d, s) in enumerate(zip(env.dsts, env.srcs)):
        if not torch.equal(d, s):
            raise SystemExit(f"{variant}: the copy of state tensor {i} ({tuple(s.shape)}) does "
                             f"not equal its source before optimizer.step()")


def run_step(env: Env, variant: str, idle_s: float, check: bool = False) -> Step:
    """One step of ``variant`` with a data-loader wait of ``idle_s`` seconds."""
    tr = env.trainer
    if check and variant != "none":
        for d in env.dsts:
            d.fill_(float("nan"))
    gc.collect()
    job: CopyJob | None = None
    c0 = time.process_time()
    t0 = time.perf_counter()
    # 1. right after the previous step
    if variant == "eager":
        job = CopyJob(env.chunks, background=False)
        job.finish(help=True)
    elif variant in BACKGROUND:
        job = CopyJob(env.chunks, background=True)
    elif variant == "idle":
        job = CopyJob(env.chunks, background=False)
    t1 = time.perf_counter()
    # 2. the data-loader wait
    deadline = t1 + idle_s
    if variant in HELPS_IN_WAIT:
        job.help_until(deadline)
    rest = deadline - time.perf_counter()
    if rest > 0:
        time.sleep(rest)
    t2 = time.perf_counter()
    by_wait_end = job.bytes_done if job is not None else 0
    main_in_wait = job.main_bytes if job is not None else 0
    # 3. forward, backward
    tr.forward_backward()
    t3 = time.perf_counter()
    # 4. the wait before optimizer.step
    if variant in HELPS_IN_WAIT:
        job.finish(help=True)
    elif variant == "thread":
        job.finish(help=False)
    t4 = time.perf_counter()
    checked = 0.0
    if check and variant != "none":
        check_copy(env, variant)
        checked = time.perf_counter() - t4
    # 5. optimizer step
    t5 = time.perf_counter()
    tr.step()
    t6 = time.perf_counter()
    c6 = time.process_time()
    span = None
    if job is not None and job.t_end is not None and job.t_start is not None:
        span = job.t_end - job.t_start
    total = env.state_bytes
    return Step(step_s=t6 - t0 - checked, post_step_s=t1 - t0, wait_s=t2 - t1,
                compute_s=(t3 - t2) + (t6 - t5), pre_step_s=t4 - t3,
                copied_by_wait_end=by_wait_end / total, copied_in_wait_main=main_in_wait / total,
                copy_span_s=span, cpu_s=c6 - c0)


def calibrate(env: Env) -> list[float]:
    """Compute seconds (forward + backward + optimizer step) of ``--calibration-steps`` steps
    without copy or wait, after ``CALIBRATION_WARMUP`` unmeasured ones (the caller takes the
    fastest)."""
    out = []
    for i in range(CALIBRATION_WARMUP + env.args.calibration_steps):
        s = run_step(env, "none", 0.0)
        if i >= CALIBRATION_WARMUP:
            out.append(s.compute_s)
    return out


def run_fraction(env: Env, frac: float, idle_s: float,
                 variants: tuple[str, ...]) -> dict[str, list[Step]]:
    """Warm-up rounds (the first one checks each copy), then the measured rounds."""
    args, log = env.args, env.log
    steps: dict[str, list[Step]] = {v: [] for v in variants}
    for w in range(args.warmup):
        log(f"  idle fraction {frac:g}: warm-up round {w + 1} (not counted"
            f"{'; copies checked' if w == 0 else ''})")
        for v in rotated(variants, w):
            run_step(env, v, idle_s, check=w == 0)
    for rnd in range(args.steps):
        for v in rotated(variants, args.warmup + rnd):
            s = run_step(env, v, idle_s)
            steps[v].append(s)
            span = "-" if s.copy_span_s is None else f"{s.copy_span_s:.3f}"
            log(f"  f={frac:g} round {rnd + 1} {v:<11} step {s.step_s:6.3f} s  post-step "
                f"{s.post_step_s:.3f}  wait {s.wait_s:.3f}  compute {s.compute_s:.3f}  "
                f"pre-step {s.pre_step_s:.3f}  copied by wait end {s.copied_by_wait_end:4.0%}  "
                f"span {span}  cpu {s.cpu_s:.2f}")
    return steps


# -- figures and the report -----------------------------------------------------------------------

def figures(steps: dict[str, list[Step]], copy_s: float) -> dict:
    """Per variant: medians, overhead vs none, per-round overheads."""
    base = steps["none"]
    none_med = median([s.step_s for s in base])
    out = {}
    for v, ss in steps.items():
        step_med = median([s.step_s for s in ss])
        spans = [s.copy_span_s for s in ss if s.copy_span_s is not None]
        f = {"steps": [asdict(s) for s in ss],
             "median_step_s": step_med,
             "overhead_s": step_med - none_med,
             "overhead_x_copy": (step_med - none_med) / copy_s,
             "per_round_overhead_s": [a.step_s - b.step_s for a, b in zip(ss, base)],
             "median_pre_step_s": median([s.pre_step_s for s in ss]),
             "median_blocking_s": median([s.post_step_s + s.pre_step_s for s in ss]),
             "median_wait_s": median([s.wait_s for s in ss]),
             "median_compute_s": median([s.compute_s for s in ss]),
             "median_copied_by_wait_end": median([s.copied_by_wait_end for s in ss]),
             "median_copied_in_wait_main": median([s.copied_in_wait_main for s in ss]),
             "median_copy_span_s": median(spans) if spans else None,
             "median_cpu_s": median([s.cpu_s for s in ss])}
        out[v] = f
    return out


def head_to_head(steps: dict[str, list[Step]], a: str, b: str) -> dict | None:
    """``a`` against ``b`` round by round: step(a) - step(b) per round, its median, and the
    rounds where ``a``'s step was shorter."""
    if a not in steps or b not in steps:
        return None
    diffs = [x.step_s - y.step_s for x, y in zip(steps[a], steps[b])]
    wins = sum(d < 0 for d in diffs)
    n = len(diffs)
    if wins >= math.ceil(0.75 * n):
        word = "beat"
    elif wins <= math.floor(0.25 * n):
        word = "lost to"
    else:
        word = "was not clearly different from"
    return {"a": a, "b": b, "per_round_s": diffs, "median_s": median(diffs),
            "a_shorter_rounds": wins, "rounds": n, "verdict": word}


def conclusion(summary: dict) -> str:
    """One paragraph, from the figures."""
    copy_ms = summary["copy"]["median_s"] * 1e3
    parts = []
    answers = []
    for fr in summary["fractions"]:
        f = fr["figures"]
        copying = [v for v in f if v != "none"]
        if not copying:
            continue
        best = min(copying, key=lambda v: f[v]["overhead_s"])
        others = ", ".join(f"`{v}` {f[v]['overhead_s'] * 1e3:+.0f} ms"
                           for v in copying if v != best)
        text = (f"at idle fraction {fr['fraction']:g} (a {fr['idle_s'] * 1e3:.0f} ms data-loader "
                f"wait, {fr['wait_share']:.0%} of the median `none` step) the lowest overhead "
                f"was `{best}`'s, {f[best]['overhead_s'] * 1e3:+.0f} ms per step "
                f"({f[best]['overhead_x_copy']:.2f}x a plain copy)"
                + (f" (the others: {others}; the `none` steps alone spread over "
                   f"{fr['none_spread_s'] * 1e3:.0f} ms)" if others else ""))
        h = fr.get("idle_vs_thread")
        if h is not None:
            text += (f"; `idle` {h['verdict']} `thread` (its step {h['median_s'] * 1e3:+.0f} ms "
                     f"against `thread`'s in the same round, median; shorter in "
                     f"{h['a_shorter_rounds']} of {h['rounds']} rounds)")
            answers.append(f"{h['verdict']} the background thread at idle fraction "
                           f"{fr['fraction']:g}")
        parts.append(text)
    none0 = summary["fractions"][0]["figures"]["none"]["median_step_s"]
    out = (f"Against one plain copy of the state ({copy_ms:.0f} ms here, "
           f"{copy_ms / 1e3 / none0:.0%} of a median `none` step at idle fraction "
           f"{summary['fractions'][0]['fraction']:g}): "
           + "; ".join(parts) + ".")
    if answers:
        out += (" So, on this machine, copying in idle moments on the training thread "
                + ", and ".join(answers) + " (\"beat\" or \"lost to\" needs a shorter or "
                "longer step in at least 3 of 4 rounds of the same-round comparison).")
    return out


def print_report(summary: dict, env: Env) -> None:
    args, tr = env.args, env.trainer
    cp = summary["copy"]
    print()
    print(f"MLP {args.layers} x Linear({tr.width}, {tr.width}), {tr.n_params / 1e6:.1f}M params, "
          f"fused Adam, batch {args.batch}: state {env.state_bytes / MiB:.0f} MiB "
          f"({env.state_bytes / GB:.2f} GB) in {len(env.srcs)} tensors, copied in "
          f"{len(env.chunks)} chunks of ~{args.chunk_mib} MiB; {args.steps} measured rounds "
          f"after {args.warmup} warm-up per idle fraction; {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} torch threads, torch {torch.__version__}")
    cal = summary["calibration"]
    print(f"Compute of a step (forward + backward + optimizer step; calibration: no copy, no "
          f"wait): fastest {cal['fastest_s'] * 1e3:.0f} ms of "
          f"{' '.join(f'{x * 1e3:.0f}' for x in cal['compute_s'])} ms, which sets the waits. "
          f"One plain copy of "
          f"the state: median {cp['median_s'] * 1e3:.1f} ms ({cp['gbps']:.1f} GB/s; "
          f"{' '.join(f'{x * 1e3:.0f}' for x in cp['seconds'])} ms).")
    print("Overhead: median step - median `none` step (same idle fraction); x copy: that over "
          "one plain copy. Wait before opt.step: median of part 4 (the wait for / finishing of "
          "the copy after backward). Blocking: median of the training thread's time on the "
          "copy (copying or waiting) outside the data-loader wait (parts 1 + 4). Wait: the "
          "data-loader wait as it ran (a chunk may run over it). Copied by wait end: share of "
          "the state copied when the wait ended (in brackets: by the training thread). Span: "
          "the first chunk's start to the last chunk's end. CPU: process CPU seconds per step, "
          "all threads. Per round: step - same round's `none` step.")
    print()
    rows = []
    for fr in summary["fractions"]:
        for v, f in fr["figures"].items():
            if v == "none":
                over, ratio, copied, span = "0 (baseline)", "-", "-", "-"
            else:
                over = f"{f['overhead_s'] * 1e3:+.0f}"
                ratio = f"{f['overhead_x_copy']:.2f}x"
                copied = f"{f['median_copied_by_wait_end']:.0%}"
                if v in HELPS_IN_WAIT:
                    copied += f" ({f['median_copied_in_wait_main']:.0%})"
                span = ("-" if f["median_copy_span_s"] is None
                        else f"{f['median_copy_span_s'] * 1e3:.0f}")
            per = " ".join(f"{x * 1e3:+.0f}" for x in f["per_round_overhead_s"])
            rows.append([f"{fr['fraction']:g}", v, f"{f['median_step_s']:.3f}", over, ratio,
                         f"{f['median_pre_step_s'] * 1e3:.0f}",
                         f"{f['median_blocking_s'] * 1e3:.0f}", f"{f['median_wait_s'] * 1e3:.0f}",
                         copied, span, f"{f['median_cpu_s']:.2f}", per])
    print_table(["idle fraction:", "variant", "median step s:", "overhead ms:", "x copy:",
                 "wait before opt.step ms:", "blocking ms:", "wait ms:", "copied by wait end:",
                 "copy span ms:", "CPU s:", "overhead per round (ms)"], rows)
    print()
    for fr in summary["fractions"]:
        for h in (fr.get("idle_vs_thread"), fr.get("thread_idle_vs_thread")):
            if h is None:
                continue
            per = ", ".join(f"{x * 1e3:+.0f}" for x in h["per_round_s"])
            print(f"Idle fraction {fr['fraction']:g}: `{h['a']}` - `{h['b']}` step, same round: "
                  f"median {h['median_s'] * 1e3:+.0f} ms, `{h['a']}` shorter in "
                  f"{h['a_shorter_rounds']} of {h['rounds']} rounds (per round: {per} ms).")
    for fr in summary["fractions"]:
        print(f"Idle fraction {fr['fraction']:g}: wait {fr['idle_s'] * 1e3:.0f} ms, "
              f"{fr['wait_share']:.0%} of the median `none` step; the `none` steps alone spread "
              f"over {fr['none_spread_s'] * 1e3:.0f} ms (slowest - fastest: the machine's noise "
              f"in this run).")
    print()
    print("Conclusion: " + summary["conclusion"])


# -- options and main -----------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__)
    add_mlp_trainer_args(p)
    p.add_argument("--steps", type=int, default=8,
                   help="measured rounds (one step per variant) per idle fraction (default 8)")
    p.add_argument("--warmup", type=int, default=2,
                   help="rounds run first and discarded, per idle fraction (default 2; the "
                        "first one checks the copies)")
    p.add_argument("--idle-fraction", default="0.0,0.3",
                   help="comma-separated shares of a no-copy step spent waiting for the data "
                        "loader, each in [0, 0.9] (default 0.0,0.3: both in one run)")
    p.add_argument("--calibration-steps", type=int, default=5,
                   help="no-copy steps whose fastest compute time sets the waits (default 5)")
    p.add_argument("--chunk-mib", type=int, default=64,
                   help="bytes per torch._foreach_copy_ call, in MiB (default 64, as tierstore)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated variants (default all: {', '.join(VARIANTS)}; none is "
                        f"always run)")
    add_output_args(p, strict=False, quiet="no per-step progress lines")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.layers < 1:
        p.error("--steps, --batch and --layers must be at least 1, --warmup at least 0")
    if args.state_mib < 1 or args.chunk_mib < 1 or args.calibration_steps < 1:
        p.error("--state-mib, --chunk-mib and --calibration-steps must be at least 1")
    try:
        args.fractions = [float(x) for x in args.idle_fraction.split(",") if x.strip()]
    except ValueError:
        p.error(f"--idle-fraction: not a list of numbers: {args.idle_fraction!r}")
    if not args.fractions or any(not 0.0 <= f <= 0.9 for f in args.fractions):
        p.error("--idle-fraction: each value must be between 0 and 0.9")
    chosen = [s.strip() for s in args.variants.split(",") if s.strip()]
    bad = [s for s in chosen if s not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; choose from {', '.join(VARIANTS)}")
    args.chosen = tuple(v for v in VARIANTS if v == "none" or v in chosen)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = progress_log(args.quiet)
    t_start = time.perf_counter()

    trainer = Trainer(args)
    srcs = trainer.tensors()
    dsts = [torch.empty_like(t) for t in srcs]
    for t in dsts:
        t.zero_()   # touched now, outside any timed region
    state_bytes = sum(t.nbytes for t in srcs)
    chunks = split_chunks(dsts, srcs, args.chunk_mib * MiB)
    env = Env(args, trainer, srcs, dsts, chunks, state_bytes, log)
    log(f"model: {args.layers} x Linear({trainer.width}), {trainer.n_params / 1e6:.1f}M params, "
        f"state {state_bytes / MiB:.0f} MiB in {len(chunks)} chunks; variants "
        f"{', '.join(args.chosen)}; idle fractions {', '.join(f'{f:g}' for f in args.fractions)}")

    compute = calibrate(env)
    fastest = min(compute)
    log(f"calibration: compute per step {' '.join(f'{x:.3f}' for x in compute)} s, fastest "
        f"{fastest:.3f} s")
    copies = time_copies(chunks, COPIES_PER_SLOT)
    fractions = []
    for frac in args.fractions:
        idle_s = frac / (1.0 - frac) * fastest
        log(f"idle fraction {frac:g}: data-loader wait {idle_s * 1e3:.0f} ms per step")
        steps = run_fraction(env, frac, idle_s, args.chosen)
        fractions.append({"fraction": frac, "idle_s": idle_s, "steps": steps})
        copies += time_copies(chunks, COPIES_PER_SLOT)
    copy_med = median(copies)

    summary_fractions = []
    for fr in fractions:
        steps = fr["steps"]
        summary_fractions.append({
            "fraction": fr["fraction"], "idle_s": fr["idle_s"],
            "figures": figures(steps, copy_med),
            "wait_share": (median([s.wait_s for s in steps["none"]])
                           / median([s.step_s for s in steps["none"]])),
            "none_spread_s": (max(s.step_s for s in steps["none"])
                              - min(s.step_s for s in steps["none"])),
            "idle_vs_thread": head_to_head(steps, "idle", "thread"),
            "thread_idle_vs_thread": head_to_head(steps, "thread+idle", "thread"),
        })
    summary = {"calibration": {"compute_s": compute, "fastest_s": fastest},
               "copy": {"seconds": copies, "median_s": copy_med,
                        "gbps": state_bytes / copy_med / GB},
               "fractions": summary_fractions, "verdicts": []}
    summary["conclusion"] = conclusion(summary)
    print_report(summary, env)
    config = {"state_mib": args.state_mib, "state_bytes": state_bytes, "tensors": len(srcs),
              "chunks": len(chunks), "chunk_mib": args.chunk_mib, "params": trainer.n_params,
              "width": trainer.width, "layers": args.layers, "batch": args.batch,
              "steps": args.steps, "warmup": args.warmup, "idle_fractions": args.fractions,
              "calibration_steps": args.calibration_steps, "variants": list(args.chosen),
              "torch_threads": torch.get_num_threads()}
    return finish_report(args, config, summary, t_start)


if __name__ == "__main__":
    sys.exit(main())
