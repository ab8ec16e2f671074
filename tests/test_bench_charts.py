"""The benchmark charts (benchmarks/charts.py) and their runner (benchmarks/bench_all.py), on the
JSON the benchmarks really write: each benchmark runs once, as small as it allows, and its output
is charted. No timing is asserted; the figures of such tiny runs mean nothing."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

import matplotlib  # noqa: F401  (the test extra installs it; charts need it)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# The smallest runs each benchmark accepts (staging.py takes no fewer than 5 rounds).
SMALL = ["--size-mib", "16", "--tensors", "4", "--warmup", "0", "--quiet"]
SMALL_ARGS = {"save_load": SMALL + ["--repeat", "1"],
              "staging": SMALL + ["--repeat", "5"],
              "pipeline": SMALL + ["--repeat", "1"]}


def load_module(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is no package, nor on sys.path)."""
    key = f"bench_test_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # before running it: dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def fs_type(path: str) -> str:
    """Filesystem type of ``path`` from /proc/mounts (longest mount prefix), or '?'."""
    path, best, kind = os.path.realpath(path), "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                mnt, typ = line.split()[1:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, typ
    except OSError:
        pass
    return kind


def disk_work_dir(tmp_path_factory) -> str:
    """A fresh directory on a disk filesystem (save_load.py and pipeline.py refuse tmpfs, where
    fsync costs nothing): pytest's temp dir, else /var/tmp, else beside the checkout."""
    for parent in (str(tmp_path_factory.getbasetemp()), "/var/tmp", REPO):
        if os.path.isdir(parent) and os.access(parent, os.W_OK) \
                and fs_type(parent) not in ("tmpfs", "ramfs"):
            return tempfile.mkdtemp(prefix=".bench-work-", dir=parent)
    raise AssertionError("no disk-backed directory to run the benchmarks in (pytest's temp "
                         "dir, /var/tmp and the checkout are all on tmpfs)")


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    """Each benchmark's JSON from one small real run: {name: path}."""
    out = tmp_path_factory.mktemp("bench-json")
    work = disk_work_dir(tmp_path_factory)
    try:
        yield _run_small(out, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_small(out, work: str) -> dict:
    """Run each benchmark once, small, in ``work``; their JSON under ``out``."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(work)
    paths = {}
    for name, args in SMALL_ARGS.items():
        path = str(out / f"{name}.json")
        extra = ["--shm-dir", shm] if name == "pipeline" else []
        proc = subprocess.run([sys.executable, os.path.join(BENCH, f"{name}.py"), *args,
                               "--dir", str(work), *extra, "--json", path],
                              cwd=REPO, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, f"{name}.py failed:\n{proc.stderr[-3000:]}"
        paths[name] = path
    return paths


def assert_png(path) -> None:
    """``path`` is a PNG file of more than a trivial size."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert len(data) > 10_000, f"{path} is only {len(data)} bytes"


@pytest.mark.parametrize("name", list(SMALL_ARGS))
def test_chart_from_real_json(name, bench_json, tmp_path):
    charts = load_module("charts")
    with open(bench_json[name]) as f:
        doc = json.load(f)
    draw, ratios = charts.CHARTS[name]
    out = tmp_path / f"{name}.png"
    assert draw(doc, str(out), "2026-01-01") == str(out)
    assert_png(out)
    figures = ratios(doc)
    assert figures and all(isinstance(v, float) and v > 0 for v in figures.values())


def test_redraw_from_directory(bench_json, tmp_path):
    for name, path in bench_json.items():
        (tmp_path / f"{name}.json").write_text(open(path).read())
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "charts.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in SMALL_ARGS:
        assert_png(tmp_path / f"{name}.png")


def fake_python(tmp_path, body: str) -> str:
    """A stand-in interpreter for run_all: a shell script called as
    ``<it> benchmarks/<name>.py --json PATH [options]``."""
    path = tmp_path / "fake-python"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_run_all_summary(bench_json, tmp_path):
    # The interpreter hands back the saved JSON of the benchmark it was asked to run: run_all's
    # charts, ratios and summary without running the benchmarks a second time.
    src = os.path.dirname(bench_json["save_load"])
    python = fake_python(tmp_path, f'cp "{src}/$(basename "$1" .py).json" "$3"\n')
    out = tmp_path / "out"
    summary = load_module("bench_all").run_all(str(out), quick=True, python=python,
                                               log=lambda _m: None)
    assert json.loads((out / "summary.json").read_text()) == summary
    assert summary["machine"]["cpus"] == os.cpu_count()
    for name in SMALL_ARGS:
        entry = summary["benchmarks"][name]
        assert entry["status"] == "ok", entry
        assert entry["json"] == f"{name}.json" and entry["ratios"]
        assert_png(out / entry["chart"])


def test_run_all_reports_failures_and_goes_on(tmp_path):
    bench_all = load_module("bench_all")
    python = fake_python(tmp_path, 'echo "boom in $(basename "$1")" >&2\nexit 3\n')
    out = tmp_path / "out"
    summary = bench_all.run_all(str(out), python=python, log=lambda _m: None)
    assert bench_all.failed(summary) == list(bench_all.BENCHMARKS)  # every one was tried
    for name, entry in summary["benchmarks"].items():
        assert entry["error"] == "exit status 3" and entry["chart"] is None
        assert f"boom in {name}.py" in entry["stderr_tail"]
    assert json.loads((out / "summary.json").read_text()) == summary
