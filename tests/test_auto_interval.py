"""``every = "auto"``: a tier's interval chosen after Young/Daly from its measured cost and the
failure rate, put in force on every rank alike, each choice an ``interval`` event; and the
config mistakes around it, each refused with what to fix."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import run_torchrun

import tierstore
from tierstore import ConfigError
from tierstore.engine.interval import mtbf_from_events_log, young_daly_s
from tierstore.tiers.schedule import AutoSchedule


def test_young_daly_is_the_square_root_of_twice_cost_times_mtbf():
    assert young_daly_s(0.5, 3600) == pytest.approx(60.0)
    assert young_daly_s(2.0, 25.0) == pytest.approx(10.0)


def test_an_auto_schedule_takes_the_first_save_then_one_every_interval():
    s = AutoSchedule()
    assert s.takes(3) and s.takes(3)  # the same save asked twice
    s.adopt(4)
    assert [step for step in range(4, 16) if s.takes(step)] == [7, 11, 15]
    assert not s.takes(2)  # an older step (a resumed drain) is not taken
    assert s.due(19) and not s.due(18)


def test_the_mtbf_comes_from_the_restarts_the_events_log_records(tmp_path):
    log = tmp_path / "events.jsonl"
    lines = [{"kind": "opened", "rank": 0, "at": 1000.0 + 100 * i, "pid": 1} for i in range(3)]
    lines.append({"kind": "opened", "rank": 1, "at": 1000.0, "pid": 2})  # not rank 0
    log.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"kind": "opened", "ra')
    # Three processes of the job ended in the 300 s since the first opened: 100 s each.
    assert mtbf_from_events_log(str(log), now=1300.0) == pytest.approx(100.0)
    assert mtbf_from_events_log(str(tmp_path / "none.jsonl")) is None


def _config(tmp_path, **store):
    return {"store": store, "tier": [
        {"name": "ram", "backend": "memory", "path": str(tmp_path / "ram"), "every": "auto",
         "keep": 2},
        {"name": "disk", "backend": "local", "path": str(tmp_path / "disk"), "every": "auto",
         "keep": 2}]}


def test_auto_needs_a_failure_rate(tmp_path):
    with pytest.raises(ConfigError, match=r"tier 'ram' has every = \"auto\", which needs the "
                                          r"job's failure rate: set \[store\] mtbf_hours"):
        tierstore.open(_config(tmp_path))
    assert not (tmp_path / "ram").exists()


def test_every_must_be_a_number_or_auto(tmp_path):
    config = _config(tmp_path, mtbf_hours=1)
    config["tier"][0]["every"] = "often"
    with pytest.raises(ConfigError, match=r'every.*must be a whole number of steps or "auto", '
                                          r'got "often"'):
        tierstore.open(config)


def test_auto_tiers_choose_their_intervals_from_what_saves_cost(tmp_path):
    class Intervals:
        def __init__(self):
            self.events = []
            self.saved_to: dict[str, list[int]] = {}  # tier -> steps of the saves it took

        @tierstore.plugin.hookimpl
        def tierstore_event(self, event):
            if event.kind == tierstore.EventKind.INTERVAL:
                self.events.append(event)
            elif event.kind == tierstore.EventKind.COMMITTED:
                self.saved_to.setdefault(event.tier, []).append(event.detail["step"])

    seen = Intervals()
    state = {"w": torch.zeros(2_000_000), "step": 0}
    taken = []
    with tierstore.open(_config(tmp_path, mtbf_hours=0.001), plugins=[seen]) as store:
        for step in range(1, 61):
            began = time.time()
            state["w"] += 1.0
            time.sleep(0.01)
            state["step"] = step
            store.record_step(step, time.time() - began)
            if store.should_save(step):
                dcp.save(state, storage_writer=store.writer(), checkpoint_id=f"step-{step}")
                taken.append(step)
        store.wait()
        chosen = {e.tier: e.detail for e in seen.events}
        # The first tier's cost is what a save blocks training for, a slower tier's its time
        # to durable; the interval is sqrt(2 x cost x MTBF), in steps of the measured step time.
        assert set(chosen) == {"ram", "disk"}, seen.events
        for tier, kind in (("ram", "stall"), ("disk", "time_to_durable")):
            c = chosen[tier]
            assert c["cost"] == kind and c["mtbf_s"] == 3.6 and c["mtbf_from"] == "mtbf_hours"
            assert c["interval_s"] == pytest.approx(math.sqrt(2 * c["cost_s"] * 3.6), rel=1e-2)
            # (the event's figures are rounded: one step either way)
            assert abs(c["every"] - max(1, c["interval_s"] / c["step_s"])) <= 1, c
        # The saves the fastest tier took after its first choice are as far apart as its
        # interval said (a save it does not take, when the disk tier is due, goes there).
        assert taken[0] == 1 and len(taken) < 60, taken
        ram = seen.saved_to["ram"]
        least = min(e.detail["every"] for e in seen.events if e.tier == "ram")
        assert ram[0] == 1 and len(ram) >= 3, (ram, seen.events)
        assert min(b - a for a, b in zip(ram[1:], ram[2:])) >= least, (ram, seen.events)
        latest = store.latest()
        assert latest == f"step-{taken[-1]}"
        loaded = {"w": torch.empty(2_000_000), "step": 0}
        dcp.load(loaded, storage_reader=store.reader(), checkpoint_id=latest)
        assert loaded["step"] == taken[-1]
        assert torch.equal(loaded["w"], torch.full((2_000_000,), float(taken[-1])))


@pytest.mark.parametrize("tiers", ["one-tier", "two-tiers"])
def test_every_rank_takes_the_same_saves(tmp_path, tiers):
    out = run_torchrun("auto_interval_worker.py", tmp_path, 40, *(
        ["two-tiers"] if tiers == "two-tiers" else []))
    taken = {line.split()[1]: line.split()[3] for line in out.splitlines()
             if " TAKEN " in line}
    assert set(taken) == {"0", "1"}, out
    assert taken["0"] == taken["1"], out  # though rank 1 measured slower steps
    steps = [int(s) for s in taken["0"].split(",")]
    assert steps[0] == 1 and len(steps) < 40, out
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    intervals = [e for e in events if e["kind"] == "interval"]
    assert intervals and {e["rank"] for e in intervals} == {0}, intervals  # the coordinator's
    if tiers == "two-tiers":
        # Every manifest committed on either tier lists files that are there, whole: a save
        # paired across ranks that took different steps once committed manifests naming
        # another rank's file in a directory that does not hold it.
        manifests = list(tmp_path.glob("*/step-*/tierstore.json"))
        assert manifests, out
        for path in manifests:
            for rel, entry in json.loads(path.read_text())["files"].items():
                file = path.parent / rel
                assert file.is_file() and file.stat().st_size == entry["size"], (path, rel)
