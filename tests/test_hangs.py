"""A rank that dies or hangs makes the others fail within ``[store] collective_timeout`` with
an error naming it, and the opt-in watchdog logs the stacks of a save that makes no progress."""

from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore import EventKind, Phase
from helpers import run_torchrun


@pytest.mark.parametrize("scenario", ["latest-hung", "load-dead"])
def test_a_lost_rank_is_named_instead_of_waited_for(tmp_path, scenario):
    out = run_torchrun("hang_worker.py", str(tmp_path), scenario, timeout=120, expect_ok=False)
    assert "RANK 0 RAISED" in out, out
    raised = next(line for line in out.splitlines() if line.startswith("RANK 0 RAISED"))
    assert "rank(s) [1] did not answer" in raised
    assert "collective_timeout" in raised and "restart the job" in raised
    assert "RANK 0 BEFORE-WAKE True" in out


class _Stall:
    """Sleeps once at the first data file of a save; records the events."""

    def __init__(self, seconds: float):
        self.seconds, self.events, self.stalled = seconds, [], False

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail):
        if phase == Phase.WRITE_FILE and not self.stalled:
            self.stalled = True
            _sleeping_in_a_plugin(self.seconds)

    @tierstore.hookimpl
    def tierstore_event(self, event):
        self.events.append(event)


def _sleeping_in_a_plugin(seconds: float) -> None:
    time.sleep(seconds)


def test_watchdog_logs_every_stack_of_a_stalled_save_once(tmp_path, caplog):
    stall = _Stall(2.5)
    config = {"store": {"watchdog": 1},
              "tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")}]}
    caplog.set_level(logging.WARNING, logger="tierstore.watchdog")
    with tierstore.open(config, plugins=[stall]) as store:
        dcp.save({"w": torch.ones(16)}, storage_writer=store.writer(), checkpoint_id="step-1")
        reports = [r for r in caplog.records if r.name == "tierstore.watchdog"]
        assert len(reports) == 1, [r.getMessage()[:200] for r in reports]
        message = reports[0].getMessage()
        assert "save of 'step-1' (running" in message and "made no progress for" in message
        assert "_sleeping_in_a_plugin" in message  # the stuck thread's stack
        assert [e.detail["operations"] for e in stall.events if e.kind == EventKind.STALLED] \
            == [["save of 'step-1'"]]
        # Idle between saves is not a stall.
        time.sleep(2)
        out = {"w": torch.zeros(16)}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
        assert torch.equal(out["w"], torch.ones(16))
    assert len([r for r in caplog.records if r.name == "tierstore.watchdog"]) == 1


@pytest.mark.parametrize("key,value,words", [
    ("collective_timeout", 0, "positive number of seconds"),
    ("watchdog", -1, r"0 \(off\) or a number of seconds"),
])
def test_timeouts_are_checked(tmp_path, key, value, words):
    config = {"store": {key: value},
              "tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")}]}
    with pytest.raises(tierstore.ConfigError, match=words):
        tierstore.open(config)
