"""Run the save/load, staging and pipeline (drain) benchmarks one after another, chart each
against its baselines, and write a summary: what ``tierstore bench --out DIR`` runs.

Into DIR go ``<name>.json`` (the benchmark's own ``--json`` output), ``<name>.png`` (its chart,
drawn by ``charts.py``) and ``summary.json``::

    {"date": ..., "machine": {...}, "quick": false,
     "benchmarks": {name: {"status": "ok" | "failed", "json": "<name>.json",
                           "chart": "<name>.png", "ratios": {...}, "args": [...],
                           "seconds": ..., "error": ..., "stderr_tail": ...}}}

Paths in the summary are relative to DIR, so a summary committed with its charts stays valid.
Each benchmark runs as a subprocess (one at a time: they time the machine, so they must not
overlap); its progress lines on stderr are passed through as they come, its report goes to
stdout. A benchmark that fails is reported (exit status, stderr tail) and the others still run;
the exit status is then 1.

    .venv/bin/python benchmarks/bench_all.py --out DIR            # full settings (~10 min here)
    .venv/bin/python benchmarks/bench_all.py --out DIR --quick    # 256 MiB, fewer rounds
    .venv/bin/python benchmarks/charts.py DIR                     # redraw the charts only
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from types import ModuleType
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

#: the benchmarks run, in this order; each is benchmarks/<name>.py
BENCHMARKS = ("save_load", "staging", "pipeline")

#: --quick options: a quarter of the data and fewer timed rounds (staging.py takes no fewer
#: than 5 rounds)
QUICK_ARGS = {
    "save_load": ["--size-mib", "256", "--repeat", "2"],
    "staging": ["--size-mib", "256", "--repeat", "5"],
    "pipeline": ["--size-mib", "256", "--repeat", "2"],
}

STDERR_TAIL_LINES = 40


def load_charts() -> ModuleType:
    """``benchmarks/charts.py``, loaded from its file: this folder is not a package, and it is
    not on ``sys.path`` when ``run_all`` is imported from elsewhere (the ``tierstore`` CLI).
    Exits with a clear message when matplotlib is missing, before any benchmark spends minutes."""
    name = "tierstore_bench_charts"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "charts.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        del sys.modules[name]
        raise SystemExit(f"the benchmark charts need matplotlib ({e}); install it, e.g. "
                         f"'pip install matplotlib'") from e
    return module


def _run_streaming(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd`` in the repository root, passing its stderr through line by line as it comes
    (stdout is inherited). Returns its exit status and the last lines of its stderr."""
    tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
    sys.stdout.flush()  # our own lines first, not after the child's
    with subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True, errors="replace",
                          bufsize=1) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            tail.append(line.rstrip("\n"))
    return proc.returncode, "\n".join(tail)


def run_one(name: str, out_dir: str, quick: bool, python: str, charts: ModuleType,
            date: str, log: Callable[[str], None]) -> tuple[dict, dict | None]:
    """Run benchmark ``name`` into ``out_dir/<name>.json`` and chart it into
    ``out_dir/<name>.png``. Returns its summary entry and its JSON document (None when it
    failed before writing one)."""
    json_name, chart_name = f"{name}.json", f"{name}.png"
    json_path, chart_path = os.path.join(out_dir, json_name), os.path.join(out_dir, chart_name)
    # A failed run must not leave an earlier run's figures looking like this run's.
    for path in (json_path, chart_path):
        if os.path.exists(path):
            os.remove(path)
    args = QUICK_ARGS[name] if quick else []
    cmd = [python, os.path.join(HERE, f"{name}.py"), "--json", json_path, *args]
    entry: dict = {"status": "failed", "json": None, "chart": None, "ratios": {}, "args": args}
    log(f"== {name}: {' '.join(cmd)}")
    t0 = time.perf_counter()
    try:
        code, tail = _run_streaming(cmd)
    except OSError as e:  # the interpreter itself could not be started
        code, tail = None, repr(e)
    entry["seconds"] = round(time.perf_counter() - t0, 1)
    if code != 0 or not os.path.exists(json_path):
        entry["error"] = ("could not start" if code is None else f"exit status {code}"
                          if code != 0 else "exit status 0 but no JSON written")
        entry["stderr_tail"] = tail
        log(f"== {name} FAILED ({entry['error']}) after {entry['seconds']:.0f} s")
        return entry, None

    entry["json"] = json_name
    draw, ratios = charts.CHARTS[name]
    try:
        with open(json_path) as f:
            doc = json.load(f)
        entry["ratios"] = ratios(doc)
        draw(doc, chart_path, date)
    except Exception as e:  # noqa: BLE001 - a chart bug is reported like a failed run
        entry["error"] = f"chart: {e!r}"
        entry["stderr_tail"] = tail
        log(f"== {name} ran, but its chart FAILED: {e!r}")
        return entry, None
    entry["chart"] = chart_name
    entry["status"] = "ok"
    shown = ", ".join(f"{k} {v:.2f}x" for k, v in entry["ratios"].items())
    log(f"== {name} done in {entry['seconds']:.0f} s: {chart_path}; {shown}")
    return entry, doc


def run_all(out_dir: str, quick: bool = False, python: str = sys.executable,
            log: Callable[[str], None] = print) -> dict:
    """Run every benchmark of ``BENCHMARKS`` with interpreter ``python`` (``--quick``: smaller
    and fewer rounds), each into ``out_dir/<name>.json`` with its chart ``out_dir/<name>.png``,
    then write ``out_dir/summary.json`` and return the same dict (see the module docstring). A
    failed benchmark is recorded with ``"status": "failed"``, its error and stderr tail; the
    others still run."""
    charts = load_charts()
    os.makedirs(out_dir, exist_ok=True)
    now = datetime.datetime.now().astimezone()
    date = now.isoformat(timespec="seconds")
    # The benchmarks' own record of the machine (with torch's and tierstore's versions) where
    # one ran; this process's view where none did.
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(),
               "python": platform.python_version()}
    results = {}
    for name in BENCHMARKS:
        entry, doc = run_one(name, out_dir, quick, python, charts, date[:10], log)
        results[name] = entry
        if doc is not None and "machine" in doc:
            machine = {**machine, **doc["machine"]}
    summary = {"date": date, "machine": machine, "quick": quick, "benchmarks": results}
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    return summary


def failed(summary: dict) -> list[str]:
    """Names of the benchmarks of a summary that did not finish with a chart."""
    return [n for n, e in summary["benchmarks"].items() if e["status"] != "ok"]


def main(argv: list[str] | None = None) -> int:
    """``bench_all.py --out DIR [--quick]``: run, chart, summarize; exit 1 when any benchmark
    failed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, metavar="DIR",
                   help="directory for <name>.json, <name>.png and summary.json")
    p.add_argument("--quick", action="store_true",
                   help="256 MiB state dicts and fewer rounds (minutes less, noisier figures)")
    args = p.parse_args(argv)
    summary = run_all(args.out, quick=args.quick)
    print(f"\nsummary: {os.path.join(args.out, 'summary.json')}")
    for name, entry in summary["benchmarks"].items():
        if entry["status"] == "ok":
            shown = ", ".join(f"{k} {v:.2f}x" for k, v in entry["ratios"].items())
            print(f"  {name}: {shown}")
        else:
            print(f"  {name}: FAILED ({entry['error']})")
    return 1 if failed(summary) else 0


if __name__ == "__main__":
    sys.exit(main())
