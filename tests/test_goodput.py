"""Goodput of a live job from its events log (``[store] events_log``, ``tierstore goodput``): a
real job (tests/scripts/goodput_job.py) killed twice with SIGKILL and resumed each time from
``store.latest()``; the report must agree with what the job itself printed of every step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import SCRIPTS, script_env

import tierstore

STEPS = 14


def run_job(root, kill_after: int | None = None) -> list[str]:
    """The job's stdout lines; with ``kill_after``, it is killed (SIGKILL) as soon as it has
    printed that step (what it printed before dying is kept)."""
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "goodput_job.py"), str(root),
                             str(STEPS)], stdout=subprocess.PIPE, text=True, env=script_env())
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if kill_after is not None and line.startswith(f"STEP {kill_after} "):
                proc.kill()
                break
        lines += [line.strip() for line in proc.stdout.read().splitlines()]
        status = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (status == -9) if kill_after is not None else (status == 0 and "DONE" in lines), lines
    return lines


def job_runs(outputs: list[list[str]]) -> list[tuple[int, list[tuple[int, float, float]]]]:
    """Per run: the step it resumed from and its (step, start, end) as it printed them."""
    runs = []
    for lines in outputs:
        resumed = next(int(line.split()[1]) for line in lines if line.startswith("RESUMED"))
        steps = [(int(p[1]), float(p[2]), float(p[3])) for p in
                 (line.split() for line in lines if line.startswith("STEP "))]
        runs.append((resumed, steps))
    return runs


def goodput_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierstore.cli", "goodput", *args],
                          capture_output=True, text=True, env=script_env(), timeout=120)


@pytest.fixture(scope="module")
def killed_twice(tmp_path_factory):
    """The job's directory after two kills and a run to the end, and what each run printed."""
    root = tmp_path_factory.mktemp("goodput")
    outputs = [run_job(root, kill_after=5), run_job(root, kill_after=11), run_job(root)]
    return root, job_runs(outputs)


def test_goodput_of_a_job_killed_twice_agrees_with_what_the_job_printed(killed_twice, tmp_path):
    root, runs = killed_twice
    proc = goodput_cli(str(root / "events.jsonl"), "--out", str(tmp_path), "--name", "trainer")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    (job,) = report["contenders"]
    assert job["name"] == "trainer"

    # The final model's history: the last run's steps, and each earlier run's up to the step
    # the next run resumed from. Productive time is their own time; the rest is lost.
    kept, lost = 0.0, 0.0
    limit = None
    for resumed, steps in reversed(runs):
        for step, start, end in steps:
            if limit is None or step <= limit:
                kept += end - start
            else:
                lost += end - start
        limit = resumed if limit is None else min(limit, resumed)
    assert job["productive_s"] == pytest.approx(kept, abs=2e-3)
    # Lost progress also counts the step in progress when the kill came (a fraction of one).
    assert lost - 2e-3 <= job["badput"]["lost_progress_s"] <= lost + 1.0
    assert job["goodput"] == pytest.approx(job["productive_s"] / job["wall_s"], abs=1e-3)
    assert sum(job["badput"].values()) + job["productive_s"] == pytest.approx(job["wall_s"],
                                                                              abs=2e-3)
    # Each restart waited for a new process (imports, open): a real cost, measured.
    assert job["badput"]["restart_s"] > 0.5

    # One failure per kill: where it struck, where the job resumed and from which tier.
    assert len(job["failures"]) == 2
    for failure, (_, died), (resumed, _) in zip(job["failures"], runs, runs[1:]):
        assert failure["at_step"] == died[-1][0]
        assert failure["resumed_from_step"] == resumed
        assert failure["steps_lost"] == died[-1][0] - resumed
        assert failure["restored_from"] == "ram" and failure["restore_s"] > 0
    assert job["final_step"] == STEPS
    assert job["saves"] == len({s for _, steps in runs for s, _, _ in steps if s % 3 == 0})
    assert set(job["time_to_durable_s"]) == {"ram", "disk"}
    assert job["time_to_durable_s"]["disk"] >= job["time_to_durable_s"]["ram"]
    for chart in ("timeline.png", "goodput.png"):
        assert (tmp_path / chart).stat().st_size > 10_000
    assert "trainer" in proc.stdout and "resumed from step" in proc.stdout


def test_a_line_cut_short_by_a_kill_is_skipped(killed_twice, tmp_path):
    root, _ = killed_twice
    log = tmp_path / "events.jsonl"
    whole = (root / "events.jsonl").read_bytes()
    log.write_bytes(whole + b'{"kind": "step", "at": 17')  # a process killed mid-write
    first, second = tmp_path / "a", tmp_path / "b"
    assert goodput_cli(str(root / "events.jsonl"), "--out", str(first), "--json").returncode == 0
    assert goodput_cli(str(log), "--out", str(second), "--json").returncode == 0
    assert json.loads((first / "report.json").read_text())["contenders"] == \
        json.loads((second / "report.json").read_text())["contenders"]


def test_a_missing_log_says_how_to_make_one(tmp_path):
    proc = goodput_cli(str(tmp_path / "nothing.jsonl"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "no events log at" in proc.stderr and "[store] events_log" in proc.stderr


def test_a_read_only_open_logs_nothing(killed_twice):
    # `tierstore ls` beside the job must not read as one of its restarts.
    root, _ = killed_twice
    log = root / "events.jsonl"
    before = log.read_bytes()
    config = {"store": {"events_log": str(log)}, "tier": [
        {"name": "ram", "backend": "memory", "path": str(root / "ram")},
        {"name": "disk", "backend": "local", "path": str(root / "disk"), "every": 2}]}
    with tierstore.open(config, read_only=True) as store:
        assert store.latest() == f"step-{STEPS - STEPS % 3}"
    assert log.read_bytes() == before
