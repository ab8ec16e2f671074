"""``tierstore ls`` beside a live job with pending drains, against the same store with no job.

The requirement measured: **``tierstore ls`` beside a job with pending drains is as fast as on a
quiet store and changes nothing on any tier**. ``ls`` opens the store read-only
(``tierstore/cli/commands.py``): it resumes none of the job's drains (a writable open would queue
the missing copies and wait for them at close) and writes nothing to any tier, so the copies the
job has not made yet must cost it nothing.

What is measured
----------------
A *job* process (this script's ``JOB``, run with ``python -c``) opens a store with two tiers,
both ``every = 1``: ``fast`` and ``slow``, two ``local`` directories under ``--dir``. It saves
``--checkpoints`` checkpoints (default 5) of ``--size-mib`` MiB of random fp32 data in
``--tensors`` tensors (default 64 MiB in 16) with ``dcp.save``. A plugin of the job holds its
drain at ``Phase.DRAIN_BEGIN`` on the ``slow`` tier, as a copy to a slow object store would take
long: the first copy is under way, the others wait behind it, so every checkpoint is on ``fast``
only, with its copy to ``slow`` pending. The job then says ``READY`` and waits on its stdin.

The *quiet* store is a copy of the job's tiers (``shutil.copytree``, made once the job is ready,
then ``os.sync()``) in another directory with its own TOML, with no process attached.

Each round runs ``python -m tierstore.cli ls CONFIG --json`` once on each store (``live``: the
job's, ``quiet``: the copy), the first one alternating per round, after ``--warmup`` untimed
rounds (default 1). Timed: the command's wall time from start to exit, as an operator waits for
it, and its CPU seconds (``RUSAGE_CHILDREN``). Every answer is checked: exit status 0, the
``--checkpoints`` ids, each on tier ``["fast"]`` only (the copies are pending, not made), the
same on both stores.

Before the first and after the last round every entry under every tier of both stores is
listed (relative path, type, size, ``mtime_ns``): ``tiers unchanged`` says whether the lists are
equal. The report gives median seconds, the per-round seconds and ratios, and the verdict:
median ``live`` / median ``quiet`` <= 1.10, failed also when a tier changed or a listing was
wrong. At the end the job is released (its drains then finish) and must exit 0; every temp
directory is removed and the job killed if it is still there, also after an error.

How to run
----------
From the repository root::

    .venv/bin/python benchmarks/cli_beside_job.py            # 5 x 64 MiB, 1 warm-up + 7 rounds
    .venv/bin/python benchmarks/cli_beside_job.py --repeat 11 --json /tmp/cli_beside_job.json
    .venv/bin/python benchmarks/cli_beside_job.py --size-mib 4 --checkpoints 3 --repeat 2
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from harness import (benchmark_parser, finish_report, fs_type, parse_rounds, print_verdicts,
                     progress_log, ratios, rotated, rounds_text, scratch, verdict,
                     warmup_then_rounds)

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
CONTENDERS = ("live", "quiet")

# The job: saves step-1..step-N into the store of CONFIG; its drain to 'slow' stops at the
# start of the first copy (announced by HELD on the drain thread) until a line (or EOF) comes on
# stdin, so every copy stays pending while the benchmark runs ls beside it. Prints
# "READY <pending copies as JSON>" once the drain is held, "DONE <pending>" after the release
# and store.wait(); nothing else goes to stdout.
JOB = r"""
import json, sys, threading
sys.path.insert(0, sys.argv[1])
import torch.distributed.checkpoint as dcp
import tierstore
from harness import make_state_dict, progress_log
from tierstore.events import Phase

_, _bench_dir, config, size_mib, tensors, checkpoints = sys.argv
progress_log(True)  # silences DCP's warning about saving without a process group

class HoldDrain:
    def __init__(self):
        self.held, self.release = threading.Event(), threading.Event()

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail):
        if phase == Phase.DRAIN_BEGIN and tier == "slow":
            self.held.set()
            self.release.wait()

hold = HoldDrain()
sd = make_state_dict(int(size_mib), int(tensors))
with tierstore.open(config, plugins=[hold]) as store:
    try:
        for step in range(1, int(checkpoints) + 1):
            dcp.save(sd, storage_writer=store.writer(), checkpoint_id=f"step-{step}")
        if not hold.held.wait(300):
            raise SystemExit("the job's drain to 'slow' never started")
        pending = [[c.checkpoint_id, c.tier] for c in store.pending()]
        print("READY", json.dumps(pending), flush=True)
        sys.stdin.readline()  # the benchmark is done (or gone: EOF)
    finally:
        hold.release.set()
    store.wait(600)
    print("DONE", json.dumps([[c.checkpoint_id, c.tier] for c in store.pending()]), flush=True)
"""


def write_config(path: str, fast: str, slow: str, io_threads: int | None) -> None:
    """The TOML of a two-tier store: ``fast`` and ``slow``, both ``local`` and ``every = 1``."""
    store = "" if io_threads is None else f"[store]\nio_threads = {io_threads}\n\n"
    tiers = "\n".join(f'[[tier]]\nname = "{name}"\nbackend = "local"\npath = {json.dumps(root)}\n'
                      f"every = 1\n" for name, root in (("fast", fast), ("slow", slow)))
    with open(path, "w") as f:
        f.write(store + tiers)


def snapshot(roots: list[str]) -> dict[str, dict[str, tuple]]:
    """Per tier root: every entry under it (relative path -> type, size, ``mtime_ns``), what any
    write, creation, removal or rename moves. Directories are in it too: a file made and removed
    again leaves its directory's mtime moved. A missing root is an empty dict."""
    found: dict[str, dict[str, tuple]] = {}
    for root in roots:
        entries: dict[str, tuple] = {}
        if os.path.isdir(root):
            st = os.lstat(root)
            entries["."] = ("dir", st.st_size, st.st_mtime_ns)
            for here, dirs, files in os.walk(root):
                for name in dirs + files:
                    path = os.path.join(here, name)
                    st = os.lstat(path)
                    kind = "dir" if os.path.isdir(path) and not os.path.islink(path) else "file"
                    entries[os.path.relpath(path, root)] = (kind, st.st_size, st.st_mtime_ns)
        found[root] = entries
    return found


def changes(before: dict[str, dict[str, tuple]], after: dict[str, dict[str, tuple]]) -> list[str]:
    """What differs between two :func:`snapshot` results, one line per entry (empty: nothing)."""
    out = []
    for root in before:
        b, a = before[root], after.get(root, {})
        for rel in sorted(set(b) | set(a)):
            if b.get(rel) != a.get(rel):
                out.append(f"{os.path.join(root, rel)}: {b.get(rel)} -> {a.get(rel)}")
    return out


def start_job(base: str, config: str, args) -> tuple[subprocess.Popen, list]:
    """Start the job on ``config`` and wait (up to 600 s) for its ``READY`` line. Returns the
    process and the pending copies it reported. Its stderr goes to ``base/job.stderr``."""
    with open(os.path.join(base, "job.stderr"), "w") as err:
        job = subprocess.Popen([sys.executable, "-c", JOB, BENCH_DIR, config, str(args.size_mib),
                                str(args.tensors), str(args.checkpoints)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                               text=True)
    line = read_line(job, 600, base)
    if not line.startswith("READY "):
        raise SystemExit(f"the job said {line!r} instead of READY\n{job_stderr(base)}")
    return job, json.loads(line.split(" ", 1)[1])


def read_line(job: subprocess.Popen, timeout: float, base: str) -> str:
    """The job's next stdout line, within ``timeout`` seconds (select: a hung job must not hang
    the benchmark); exits with the job's stderr when it ends or times out first."""
    ready, _, _ = select.select([job.stdout], [], [], timeout)
    line = job.stdout.readline() if ready else ""
    if not line:
        why = "timed out" if not ready else f"exited with {job.wait(30)}"
        raise SystemExit(f"the job {why} before its line\n{job_stderr(base)}")
    return line.strip()


def job_stderr(base: str) -> str:
    """The tail of the job's stderr, for messages."""
    try:
        with open(os.path.join(base, "job.stderr")) as f:
            return f.read()[-4000:]
    except OSError:
        return ""


def run_ls(config: str) -> tuple[float, float, list]:
    """``python -m tierstore.cli ls CONFIG --json`` once: wall seconds, the child's CPU seconds
    (RUSAGE_CHILDREN counts only waited-for children: the job, still running, is not in it)
    and the parsed listing. Exits when the command fails."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tierstore.cli", "ls", config, "--json"],
                          capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - started
    ru2 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru2.ru_utime - ru.ru_utime) + (ru2.ru_stime - ru.ru_stime)
    if proc.returncode != 0 or "Traceback" in proc.stderr:
        raise SystemExit(f"tierstore ls {config} exited with {proc.returncode}:\n{proc.stderr}")
    return took, cpu, json.loads(proc.stdout)


def parse_args(argv=None):
    p = benchmark_parser(__doc__, repeat=7,
                         warmup_costs="the first imports of torch and tierstore from disk",
                         dir_help="parent of both stores' tiers (default the system temp dir)",
                         size_mib=64, tensors=16)
    p.add_argument("--checkpoints", type=int, default=5,
                   help="checkpoints the job saves, each with its copy pending (default 5)")
    args = parse_rounds(p, argv)
    if args.checkpoints < 1:
        p.error("--checkpoints must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    log = progress_log(args.quiet)
    parent = args.dir or tempfile.gettempdir()
    kind = fs_type(parent)
    t_start = time.perf_counter()
    expected = [[f"step-{s}", ["fast"]] for s in range(args.checkpoints, 0, -1)]  # newest first
    seconds: dict[str, list[float]] = {k: [] for k in CONTENDERS}
    cpu: dict[str, list[float]] = {k: [] for k in CONTENDERS}
    wrong_listings: list[str] = []
    job = None
    job_status = None
    with scratch("tierstore-cli-beside-job-", parent) as base:
        stores = {"live": os.path.join(base, "live"), "quiet": os.path.join(base, "quiet")}
        configs = {k: os.path.join(base, f"{k}.toml") for k in CONTENDERS}
        roots = {k: [os.path.join(d, "fast"), os.path.join(d, "slow")]
                 for k, d in stores.items()}
        try:
            for k in CONTENDERS:
                os.makedirs(stores[k])
                write_config(configs[k], *roots[k], args.io_threads)
            log(f"job: saving {args.checkpoints} x {args.size_mib} MiB with its drains held")
            job, pending = start_job(base, configs["live"], args)
            want_pending = [[f"step-{s}", "slow"] for s in range(1, args.checkpoints + 1)]
            if pending != want_pending:
                raise SystemExit(f"the job reports pending copies {pending}, not "
                                 f"{want_pending}")
            # The quiet store: the same tiers, byte for byte, with nobody attached. Synced so
            # the copy's writeback does not land inside the timed rounds.
            for live_root, quiet_root in zip(roots["live"], roots["quiet"]):
                if os.path.isdir(live_root):
                    shutil.copytree(live_root, quiet_root, symlinks=True)
            os.sync()
            before = snapshot(roots["live"] + roots["quiet"])

            def one_round(rnd: int, warm: bool, res: dict, say) -> None:
                for which in rotated(CONTENDERS, rnd):
                    took, used, listed = run_ls(configs[which])
                    got = [[c["id"], c["tiers"]] for c in listed]
                    if got != expected:
                        wrong_listings.append(f"{which}: {got}")
                    res["seconds"][which].append(took)
                    res["cpu"][which].append(used)
                s = res["seconds"]
                say(f"round {rnd + 1}: live {s['live'][-1]:.3f} s, quiet {s['quiet'][-1]:.3f} s "
                    f"({s['live'][-1] / s['quiet'][-1]:.2f}x)")

            warmup_then_rounds(args, log, lambda: {"seconds": {k: [] for k in CONTENDERS},
                                                   "cpu": {k: [] for k in CONTENDERS}},
                               one_round, {"seconds": seconds, "cpu": cpu})
            changed = changes(before, snapshot(roots["live"] + roots["quiet"]))

            # Release the job: its drains make the copies now, and it must end cleanly.
            log("job: released, finishing its drains")
            job.stdin.write("done\n")
            job.stdin.close()
            done = read_line(job, 900, base)
            job_status = job.wait(120)
            if job_status != 0 or done != "DONE []":
                raise SystemExit(f"the job ended with {job_status} ({done!r})\n"
                                 f"{job_stderr(base)}")
        finally:
            if job is not None and job.poll() is None:
                job.kill()
                job.wait()

    med = {k: statistics.median(v) for k, v in seconds.items()}
    ratio = med["live"] / med["quiet"]
    per_round = ratios(seconds["live"], seconds["quiet"])
    unchanged = not changed
    print(f"\ntierstore ls beside a job with {args.checkpoints} pending drains, against a quiet "
          f"copy ({args.checkpoints} x {args.size_mib} MiB in {args.tensors} tensors, {kind} "
          f"under {parent})")
    print(f"{'store':<6} {'median s':>9} {'median CPU s':>13}  rounds")
    for k in CONTENDERS:
        print(f"{k:<6} {med[k]:>9.3f} {statistics.median(cpu[k]):>13.3f}  "
              f"{rounds_text(seconds[k])}")
    print(f"tiers unchanged: {'yes' if unchanged else 'no'}")
    for line in changed[:20]:
        print(f"  changed: {line}")
    print("listings: " + ("WRONG" if wrong_listings
                          else "every checkpoint on [fast] only, its copy pending"))
    for line in wrong_listings[:5]:
        print(f"  listed: {line}")
    v = verdict("ls beside the live job <= 1.10x ls on a quiet copy, every tier unchanged",
                ratio, per_round, most=1.10)
    v["tiers_unchanged"] = unchanged
    v["listings_ok"] = not wrong_listings
    v["pass"] = v["pass"] and unchanged and not wrong_listings
    verdicts = [v]
    print_verdicts(verdicts)
    summary = {"figures": {k: {"seconds": seconds[k], "median_s": med[k], "cpu_seconds": cpu[k],
                               "median_cpu_s": statistics.median(cpu[k])} for k in CONTENDERS},
               "tiers_unchanged": unchanged, "changed": changed,
               "wrong_listings": wrong_listings, "verdicts": verdicts}
    return finish_report(args, vars(args), summary, t_start)


if __name__ == "__main__":
    sys.exit(main())
