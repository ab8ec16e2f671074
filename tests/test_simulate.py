"""``tierstore simulate``: a real two-node job under a killed rank, an object-store outage, a
hung rank, a lost node and a preemption, once with stock ``dcp.async_save`` (DCP's async
staging) and once with tierstore (RAM + peer replicas + disk + the simulator's own S3 server,
lazy staging, emergency save), and what a user checks in its report; then scenarios with
mistakes, each refused with a message that says what to fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import script_env

from tierstore.cli import main

SHORT_SCENARIO = """
[job]
steps = 24
step_s = 0.1
state_mib = 2
nodes = 2
ranks_per_node = 1
collective_timeout_s = 3

[supervisor]
restart_delay_s = 0.5
timeout_s = 400

[[failure]]
kind = "kill-rank"
at_step = 5
rank = 1

[[failure]]
kind = "object-store-outage"
at_step = 7
duration_s = 2

[[failure]]
kind = "hang-rank"
at_step = 10
rank = 0

[[failure]]
kind = "lose-node"
at_step = 13
node = 1

# Stock saves every 4 steps: step 18 is two steps past its last save (and step 19 is no save
# step either), so a preemption there costs it steps whatever the timing.
[[failure]]
kind = "preempt"
at_step = 18

[[contender]]
name = "stock"
kind = "dcp-async"
every = 4
async_staging = true

[[contender]]
name = "tierstore"
kind = "tierstore"
every = 2
emergency = true
lazy = true
tiers = [{ name = "ram", backend = "memory", every = 2 },
         { name = "peer", backend = "peer", every = 2 },
         { name = "disk", backend = "local", every = 8 },
         { name = "s3", backend = "s3", every = 8 }]
"""

KINDS = ["kill-rank", "hang-rank", "lose-node", "preempt"]


def _job_processes(out) -> list[int]:
    """Processes still running a job of the simulation into ``out`` (its ranks and torchruns
    have the job module and a job spec under ``out`` among their arguments)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            args = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"tierstore_simulate.job" in args and any(a.startswith(str(out).encode())
                                                      for a in args):
            found.append(int(entry))
    return found


def _simulator_shm_dirs() -> set[str]:
    """What the simulator makes under /dev/shm (one directory per simulation)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("tierstore-simulate-")}


@pytest.mark.timeout(600)
def test_simulate_runs_both_contenders_through_every_failure(tmp_path):
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(SHORT_SCENARIO)
    out = tmp_path / "out"
    before = _simulator_shm_dirs()
    proc = subprocess.run([sys.executable, "-m", "tierstore.cli", "simulate", str(scenario),
                           "--out", str(out)], env=script_env(), capture_output=True,
                          text=True, timeout=560)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-5000:]}"
    assert "goodput" in proc.stdout  # the summary table
    # The hung rank's partner gave up through its collective timeout and its process ended on
    # its own: the supervisor never had to dump stacks and kill what was left.
    assert "hang-rank: SIGSTOP to rank 0" in proc.stdout, proc.stdout
    assert "still running after the grace period" not in proc.stdout, proc.stdout
    assert "the object store is up again" in proc.stdout, proc.stdout

    report = json.loads((out / "report.json").read_text())
    assert report["scenario"]["job"]["steps"] == 24
    stock, tier = report["contenders"]
    assert (stock["name"], tier["name"]) == ("stock", "tierstore")
    for c in (stock, tier):
        assert [f["kind"] for f in c["failures"]] == KINDS, c
        assert c["final_state"] == "ok", c
        assert c["final_step"] == 24, c
        assert 0 < c["goodput"] < 1, c
        assert [o["at_step"] for o in c["outages"]] == [7], c  # struck; nothing restarted
        # Where a restart's start-up went, rank 0's median per phase: importing torch costs
        # more than the checkpointing's own open and restore.
        phases = c["restart_startup_s"]
        assert list(phases) == ["python", "imports", "init_process_group", "state", "open",
                                "restore"], c
        assert phases["imports"] > phases["open"] + phases["restore"], c
    assert "a restart's start-up, rank 0's median seconds per phase:" in proc.stdout

    # tierstore restores from RAM (after the lost node, the surviving node's from its RAM and
    # the new node's from its replica on the peer tier), and its emergency save at the
    # preemption loses no step; stock resumes from its last periodic save.
    sources = [f["restored_from"].split("+") for f in tier["failures"]]
    assert all(s[0] == "ram" for s in sources), tier["failures"]
    # The lost node's files, sent by node 0 from its replicas: the newest save before the loss
    # (step 12, or 10 if 12 was not replicated yet) is on no shared tier (they take every 8th).
    assert "peers" in sources[2], tier["failures"]
    assert tier["failures"][2]["resumed_from_step"] in (10, 12), tier["failures"]
    assert tier["failures"][3]["steps_lost"] == 0, tier["failures"]
    assert stock["failures"][3]["steps_lost"] > 0, stock["failures"]
    # Stock restores from its directory, or from scratch when its first async save had not
    # finished when the first rank was killed (a loaded machine); by the lost node it has one.
    for f in stock["failures"]:
        assert f["restored_from"] == ("shared" if f["resumed_from_step"] else None), f
    assert [f["restored_from"] for f in stock["failures"][2:]] == ["shared"] * 2, stock
    # Saves reached the object store around the outage (time-to-durable measured there).
    assert tier["time_to_durable_s"]["s3"] > 0, tier

    for chart in ("timeline.png", "goodput.png"):
        assert (out / chart).stat().st_size > 10_000, chart

    # `tierstore goodput` on the tierstore job's own events log (a job killed and resumed four
    # times) gives the simulator's numbers. The log alone knows neither when each process
    # started (a run begins at its `opened` there) nor what each failure was, so the wall
    # time, restarts and kinds are the simulator's to say; everything else is the same.
    replay = tmp_path / "replay"
    cli = subprocess.run([sys.executable, "-m", "tierstore.cli", "goodput",
                          str(out / "tierstore" / "events.jsonl"), "--out", str(replay),
                          "--name", "tierstore"], env=script_env(), capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    (again,) = json.loads((replay / "report.json").read_text())["contenders"]
    for key in ("productive_s", "saves", "final_step", "time_to_durable_s"):
        assert again[key] == tier[key], key
    for key in ("checkpoint_stall_s", "restore_s", "lost_progress_s"):
        assert again["badput"][key] == tier["badput"][key], key
    assert [{k: v for k, v in f.items() if k != "kind"} for f in again["failures"]] == \
        [{k: v for k, v in f.items() if k != "kind"} for f in tier["failures"]]
    assert _simulator_shm_dirs() <= before, "the simulation left directories in /dev/shm"
    assert _job_processes(out) == [], "processes of the simulated job are still running"


BAD = {
    "unknown key": (
        "[job]\nstepz = 10\n", "[job]: unknown key 'stepz'. Did you mean 'steps'?"),
    "unknown failure kind": (
        '[[failure]]\nkind = "explode"\nat_step = 3\n',
        "failure[0]: kind 'explode' is not one of kill-rank, hang-rank, lose-node, preempt, "
        "object-store-outage"),
    "outage without an object store": (
        '[[failure]]\nkind = "object-store-outage"\nat_step = 3\n',
        'an object-store-outage strikes, but no contender uses the simulator\'s object store'),
    "duration of a kill": (
        '[[failure]]\nkind = "kill-rank"\nat_step = 3\nduration_s = 5\n',
        "failure[0]: duration_s applies only to object-store-outage"),
    "async staging on tierstore": (
        '[[contender]]\nkind = "tierstore"\nevery = 2\nasync_staging = true\n',
        'async_staging is only for kind = "dcp-async"'),
    "mtbf on stock DCP": (
        '[[contender]]\nkind = "dcp-async"\nevery = 2\nmtbf_hours = 1\n',
        'mtbf_hours is only for kind = "tierstore"'),
    "peer tier on one node": (
        '[job]\nnodes = 1\n[[contender]]\nkind = "tierstore"\nevery = 2\n'
        'tiers = [{ name = "ram", backend = "memory" }, { name = "p", backend = "peer" }]\n',
        "a peer tier replicates to another node, and the job has nodes = 1"),
    "failure beyond the job": (
        '[job]\nsteps = 20\n[[failure]]\nkind = "preempt"\nat_step = 25\n',
        "failure[0]: at_step is 25; it must be at most 19"),
    "rank beyond the job": (
        '[job]\nnodes = 2\nranks_per_node = 1\n[[failure]]\nkind = "kill-rank"\n'
        'at_step = 3\nrank = 2\n', "failure[0]: rank is 2; it must be at most 1"),
    "failures out of order": (
        '[[failure]]\nkind = "preempt"\nat_step = 9\n[[failure]]\nkind = "kill-rank"\n'
        'at_step = 4\n', "failure[1] at_step 4 is not after failure[0]'s 9"),
    "bad contender kind": (
        '[[contender]]\nname = "x"\nkind = "dcp-fast"\nevery = 5\n',
        "kind 'dcp-fast' is not one of dcp-async, dcp-sync, tierstore. Did you mean"),
    "tier interval not a multiple": (
        '[[contender]]\nkind = "tierstore"\nevery = 4\n'
        'tiers = [{ name = "ram", backend = "memory", every = 4 },\n'
        '         { name = "disk", backend = "local", every = 6 }]\n',
        "tier 'disk' has every = 6, which is not a multiple of the save interval every = 4"),
    "object-store client on a disk tier": (
        '[[contender]]\nkind = "tierstore"\nevery = 2\n'
        'tiers = [{ name = "disk", backend = "local", client = "obstore" }]\n',
        "client is for s3 tiers (the object-store client), and this tier's backend is local"),
    "unknown object-store client": (
        '[[contender]]\nkind = "tierstore"\nevery = 2\n'
        'tiers = [{ name = "ram", backend = "memory" },\n'
        '         { name = "s3", backend = "s3", client = "boto" }]\n',
        "'boto' is not one of fsspec, obstore"),
    "tiers on a stock contender": (
        '[[contender]]\nkind = "dcp-async"\nevery = 5\n'
        'tiers = [{ name = "ram", backend = "memory" }]\n',
        'tiers is only for kind = "tierstore"'),
    "not TOML": ("[job\nsteps = 3\n", "not valid TOML"),
    "no rounds": ("[supervisor]\nrepeat = 0\n",
                  "[supervisor]: repeat is 0; it must be at least 1"),
}
NO_CONTENDER = '[[contender]]\nname = "stock"\nkind = "dcp-async"\nevery = 5\n'


@pytest.mark.parametrize("case", sorted(BAD), ids=str)
def test_a_bad_scenario_is_refused_with_what_to_fix(case, tmp_path, capsys):
    text, message = BAD[case]
    if "[[contender]]" not in text:  # so that only the mistake under test is one
        text += NO_CONTENDER
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(text)
    assert main(["simulate", str(scenario), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tierstore: error: {scenario}: "), err
    assert message in err, err
    assert not (tmp_path / "out").exists()  # refused before anything was made


def test_an_auto_tier_makes_the_job_ask_the_store_when_to_save(tmp_path):
    from tierstore_simulate.scenario import load_scenario
    from tierstore_simulate.supervisor import job_spec

    scenario = tmp_path / "scenario.toml"
    scenario.write_text('[[contender]]\nname = "auto"\nkind = "tierstore"\nmtbf_hours = 0.5\n'
                        'tiers = [{ name = "ram", backend = "memory", every = "auto" },\n'
                        '         { name = "disk", backend = "local", every = 10 }]\n')
    contender = load_scenario(scenario).contenders[0]
    assert contender.auto and contender.every == 1
    spec = job_spec(contender, load_scenario(scenario).job, tmp_path, tmp_path / "shm")
    assert spec.auto
    assert spec.store["store"]["mtbf_hours"] == 0.5
    assert [t["every"] for t in spec.store["tier"]] == ["auto", 10]


def test_a_scenario_without_contenders_says_how_to_add_one(tmp_path, capsys):
    scenario = tmp_path / "scenario.toml"
    scenario.write_text("[job]\nsteps = 10\n")
    assert main(["simulate", str(scenario), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no contender: add at least one [[contender]] table" in err, err


def test_a_missing_scenario_file_is_a_usage_error(tmp_path, capsys):
    missing = tmp_path / "nope.toml"
    assert main(["simulate", str(missing), "--out", str(tmp_path / "out")]) == 2
    assert f"{missing}: no such scenario file" in capsys.readouterr().err


REPEATED = """
[job]
steps = 6
step_s = 0.05
state_mib = 1
nodes = 1
ranks_per_node = 1

[supervisor]
restart_delay_s = 0.2

[[contender]]
name = "stock"
kind = "dcp-sync"
every = 3

[[contender]]
name = "tierstore"
kind = "tierstore"
every = 3
emergency = false
tiers = [{ name = "ram", backend = "memory", every = 3 }]
"""


@pytest.mark.timeout(300)
def test_repeated_rounds_interleave_the_contenders_and_report_each_ones_median(tmp_path):
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(REPEATED)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "tierstore.cli", "simulate", str(scenario),
                           "--out", str(out), "--repeat", "2"], env=script_env(),
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-5000:]}"
    # Interleaved: every contender's round 1 before any round 2, so a slow spell of the machine
    # falls on each alike.
    starts = [line.split("]")[0] + "]" for line in proc.stdout.splitlines()
              if line.endswith("started: 1 node(s) x 1 rank(s)")]
    assert starts == ["[stock, round 1/2]", "[tierstore, round 1/2]",
                      "[stock, round 2/2]", "[tierstore, round 2/2]"], proc.stdout

    report = json.loads((out / "report.json").read_text())
    assert report["scenario"]["supervisor"]["repeat"] == 2
    for c in report["contenders"]:
        assert c["final_state"] == "ok", c
        assert [r["round"] for r in c["rounds"]] == [1, 2], c
        goodputs = sorted(r["goodput"] for r in c["rounds"])
        assert c["goodput"] == goodputs[0], c  # the lower middle of two
        assert c["median_round"] in (1, 2)
        assert c["work_dir"] == str(out / c["name"] / f"round-{c['median_round']}"), c
        # Each round ran from scratch in a directory of its own: none resumed another's
        # checkpoints.
        for r in (1, 2):
            events = (out / c["name"] / f"round-{r}" / "events.jsonl").read_text()
            assert '"loaded"' not in events, (c["name"], r)
    assert "goodput per round:" in proc.stdout, proc.stdout


def test_the_jobs_start_from_bytecode_even_where_python_writes_none(tmp_path, monkeypatch):
    """A restart is mostly start-up, and the simulator compares restarts: the project's modules
    are compiled before any job starts (as pip compiles an installed package), so that a job
    started from a source checkout with PYTHONDONTWRITEBYTECODE does not compile them again in
    every process, a cost torch's compiled modules do not have."""
    import importlib.util
    from pathlib import Path

    from tierstore_simulate.run import _JOB_PACKAGES, byte_compile

    package = tmp_path / "simulated_pkg"
    (package / "inner").mkdir(parents=True)
    for source in ("__init__.py", "mod.py", "inner/__init__.py", "inner/deep.py"):
        (package / source).write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # what PYTHONDONTWRITEBYTECODE sets
    assert byte_compile(("simulated_pkg",)) == [str(package)]
    for source in package.rglob("*.py"):
        assert Path(importlib.util.cache_from_source(str(source))).is_file(), source
    # What the job imports of this project is among what the simulator compiles.
    assert {"tierstore", "tierstore_plugins", "tierstore_simulate"} <= set(_JOB_PACKAGES)
