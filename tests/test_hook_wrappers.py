"""Hooks run through pluggy's own call path: ``@tierstore.hookimpl(wrapper=True)`` works for
phase hooks and observers, and a failing observer still never breaks a save."""

from __future__ import annotations

import time

import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore import EventKind, Phase


def _config(tmp_path):
    return {"tier": [{"name": "disk", "backend": "local", "path": str(tmp_path / "disk")}]}


class SlowWriteFile:
    """A phase hook that makes every WRITE_FILE announcement take 50 ms."""

    @tierstore.hookimpl
    def tierstore_phase(self, phase):
        if phase == Phase.WRITE_FILE:
            time.sleep(0.05)


class PhaseTimer:
    """A wrapper timing what the other implementations do at each phase."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @tierstore.hookimpl(wrapper=True)
    def tierstore_phase(self, phase):
        started = time.perf_counter()
        try:
            return (yield)
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started


class EventWrapper:
    """A wrapper observer: sees each event before and after the plain observers."""

    def __init__(self):
        self.kinds: list[str] = []

    @tierstore.hookimpl(wrapper=True)
    def tierstore_event(self, event):
        self.kinds.append(event.kind)
        return (yield)


class Broken:
    @tierstore.hookimpl
    def tierstore_event(self, event):
        raise RuntimeError("observer bug")


class Counting:
    def __init__(self):
        self.kinds: list[str] = []

    @tierstore.hookimpl
    def tierstore_event(self, event):
        self.kinds.append(event.kind)


def test_a_wrapper_times_a_phase(tmp_path):
    timer = PhaseTimer()
    sd = {"w": torch.arange(1000, dtype=torch.float32)}
    with tierstore.open(_config(tmp_path), plugins=[SlowWriteFile(), timer]) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
    assert timer.seconds[Phase.WRITE_FILE] >= 0.05
    assert timer.seconds[Phase.SAVE_BEGIN] < 0.05


def test_wrapper_observer_sees_events_and_a_failing_observer_is_isolated(tmp_path):
    wrapper, counting = EventWrapper(), Counting()
    sd = {"w": torch.arange(1000, dtype=torch.float32)}
    with tierstore.open(_config(tmp_path), plugins=[wrapper, Broken(), counting]) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        out = {"w": torch.zeros(1000)}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    assert torch.equal(out["w"], sd["w"])
    for seen in (wrapper.kinds, counting.kinds):
        assert EventKind.COMMITTED in seen and EventKind.LOADED in seen
    assert wrapper.kinds == counting.kinds  # the broken observer stopped nobody
