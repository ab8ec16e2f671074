"""``tierstore bench --out DIR``: the save/load, staging and drain benchmarks of a source
checkout run side by side (``benchmarks/bench_all.py``), with their JSON and PNG charts in DIR."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

__all__ = ["run_bench"]


def _benchmarks_dir() -> str | None:
    """``benchmarks/`` of the source checkout this package runs from, if it is one."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(here, "benchmarks")
    return path if os.path.isfile(os.path.join(path, "bench_all.py")) else None


def run_bench(args: argparse.Namespace) -> int:
    """Run ``benchmarks/bench_all.py --out DIR`` in this interpreter; its exit status."""
    bench = _benchmarks_dir()
    if bench is None:
        print("tierstore: error: `tierstore bench` runs the benchmarks of a source checkout "
              "(benchmarks/bench_all.py beside the tierstore package); clone the repository "
              "and install it with `pip install -e '.[bench]'`", file=sys.stderr)
        return 2
    command = [sys.executable, os.path.join(bench, "bench_all.py"), "--out", args.out]
    if args.quick:
        command.append("--quick")
    proc = subprocess.run(command, stdout=sys.stderr if args.json else None)
    if args.json and proc.returncode == 0:
        with open(os.path.join(args.out, "summary.json")) as f:
            sys.stdout.write(f.read())
    return proc.returncode
