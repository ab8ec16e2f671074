"""The goodput accounting (``tierstore_simulate.goodput``) on events written by hand: what a
run's time is counted as."""

from __future__ import annotations

from tierstore_simulate.goodput import account, split_runs


def _step(step: int, at: float) -> dict:
    return {"kind": "step", "rank": 0, "at": at, "seconds": 1.0, "detail": {"step": step}}


# A job killed after step 3 and started again at t=10: the new process logs that a tier does
# not answer while its store opens (t=12), before its ``opened`` (t=13), then resumes at step 4.
EVENTS = [
    {"kind": "opened", "rank": 0, "at": 0.0},
    _step(1, 1.0), _step(2, 2.0), _step(3, 3.0),
    {"kind": "unreachable", "rank": 0, "at": 12.0, "tier": "s3"},
    {"kind": "opened", "rank": 0, "at": 13.0},
    _step(4, 14.0), _step(5, 15.0),
]


def test_an_event_of_a_restarted_process_before_its_open_belongs_to_the_new_run():
    runs = split_runs(EVENTS, starts=[-1.0, 10.0])
    assert [(r.start, r.opened, r.end) for r in runs] == [(-1.0, 0.0, 3.0), (10.0, 13.0, 15.0)]
    report = account(EVENTS, starts=[-1.0, 10.0])
    # The old run ended at its last step: nothing of the new process's start-up is its lost
    # progress; from its end to the new run's open is the restart (7 s down, 3 s starting).
    assert report.badput.lost_progress_s == 0.0
    assert report.badput.restart_s == 10.0
    assert report.wall_s == 16.0 and report.productive_s == 5.0


def test_without_the_starts_a_run_begins_at_its_open():
    runs = split_runs(EVENTS)
    assert [(r.opened, r.end) for r in runs] == [(0.0, 12.0), (13.0, 15.0)]
