"""Emergency checkpoint on SIGTERM: a training subprocess is sent SIGTERM at a random step and
must exit 0 after committing a checkpoint of exactly the step at which its ranks agreed to stop,
which then loads bitwise (single process, and 2 ranks under torchrun with only one rank
signalled)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import script_command, script_env, torchrun_command

import tierstore


def _config(root: Path) -> dict:
    return {"tier": [{"name": "ram", "backend": "local", "path": str(root / "ram"), "keep": 2},
                     {"name": "disk", "backend": "local", "path": str(root / "disk")}]}


def _run_and_signal(cmd: list[str], signal_rank: int, at_step: int, timeout: float = 180,
                    sig: int = signal.SIGTERM):
    """Start ``cmd``, send ``sig`` to the process of ``signal_rank`` once it printed step
    ``at_step``; return (exit code, stdout). Killed after ``timeout`` s (exit code -9)."""
    proc = subprocess.Popen(cmd, env=script_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        sent = False
        for line in proc.stdout:
            lines.append(line)
            m = re.match(r"STEP (\d+) (\d+) (\d+)", line)
            if m and not sent and int(m[1]) == signal_rank and int(m[2]) >= at_step:
                os.kill(int(m[3]), sig)
                sent = True
        code = proc.wait()
    finally:
        timer.cancel()
    return code, "".join(lines)


def _check_emergency_checkpoint(root: Path, out: str, at_step: int, world: int) -> None:
    steps = {int(r): int(s) for r, s in re.findall(r"EMERGENCY (\d+) (\d+)", out)}
    assert sorted(steps) == list(range(world)), out
    assert len(set(steps.values())) == 1, f"ranks stopped at different steps: {steps}\n{out}"
    step = steps[0]
    assert step >= at_step, out
    with tierstore.open(_config(root)) as store:
        assert store.latest() == f"step-{step}"
        assert "ram" in next(c.tiers for c in store.list() if c.id == f"step-{step}")
        assert store.verify(f"step-{step}").ok
    # The checkpoint holds exactly that step: replicated keys and every rank's own key.
    dest = {"weights": torch.empty(256, 64), "bias": torch.empty(64, dtype=torch.float64),
            "step": -1}
    dest.update({f"rank{r}_bytes": torch.empty(1000, dtype=torch.uint8) for r in range(world)})
    with tierstore.open(_config(root)) as store:
        dcp.load(dest, storage_reader=store.reader(), checkpoint_id=f"step-{step}")
    assert torch.equal(dest["weights"], torch.full((256, 64), float(step)))
    assert torch.equal(dest["bias"], torch.full((64,), float(step), dtype=torch.float64))
    for r in range(world):
        expected = torch.full((1000,), (step * 7 + r) % 256, dtype=torch.uint8)
        assert torch.equal(dest[f"rank{r}_bytes"], expected), f"rank {r}"
    assert dest["step"] == step


@pytest.mark.timeout(200)
def test_sigterm_single_process_saves_that_step_and_exits(tmp_path):
    at_step = random.randint(2, 12)
    code, out = _run_and_signal(script_command("preempt_worker.py", tmp_path, 200), 0, at_step)
    assert code == 0, out
    assert "NO SIGNAL" not in out, out
    assert "ATEXIT 0" in out, out  # the process's atexit handlers ran and were flushed
    _check_emergency_checkpoint(tmp_path, out, at_step, world=1)


@pytest.mark.timeout(240)
def test_sigterm_to_one_rank_of_two_stops_both_at_the_same_step(tmp_path):
    at_step = random.randint(2, 12)
    code, out = _run_and_signal(torchrun_command("preempt_worker.py", tmp_path, 300), 1, at_step)
    assert code == 0, out
    assert "ATEXIT 0" in out and "ATEXIT 1" in out, out
    _check_emergency_checkpoint(tmp_path, out, at_step, world=2)


@pytest.mark.timeout(240)
def test_a_rank_killed_under_torchrun_does_not_keep_the_survivor_for_the_roll_call(tmp_path):
    # torchrun stops the survivors of a dead rank with SIGTERM, which the preemption handler
    # only records: the survivor's next per-step agreement fails on the dead peer, and it must
    # give up at once, not spend the roll call's 30 s naming the lost rank (it did, and every
    # restart of such a job waited for it). 25 s is well under those 30 s.
    # Once no emergency save can gather every rank, the handler stands down: torchrun's SIGTERM
    # ends the survivor as it would without tierstore (its teardown took another 1.1 s), and
    # the log says why.
    code, out = _run_and_signal(torchrun_command("preempt_worker.py", tmp_path, 10_000), 1, 3,
                                timeout=25, sig=signal.SIGKILL)
    assert code != -9, f"the job was still running 25 s after its rank died:\n{out}"
    assert code != 0, out
    assert re.search(r"rank +: 0 \(local_rank: 0\)\s+exitcode +: -15 ", out), out
    assert "signal 15 received and no emergency save is possible (a rank is lost)" in out, out


@pytest.mark.timeout(60)
def test_preemption_outside_the_main_thread_is_a_clear_error(local_config):
    errors: list[BaseException] = []
    with tierstore.open(local_config) as store:
        t = threading.Thread(target=lambda: _capture(errors, store.preemption))
        t.start()
        t.join()
    assert errors and "main thread" in str(errors[0])


def _capture(errors: list, fn) -> None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        errors.append(exc)


def test_a_signal_is_acted_on_at_the_second_check_after_it_every_check_collecting_the_last(
        local_config):
    """The per-step agreement runs behind the step: each check collects what the previous one
    started. A signal received after a check is answered False by the next check (which
    collects the agreement started before it came) and True by the one after, on every rank
    alike; the handler only records it (the process is still here)."""
    with tierstore.open(local_config) as store:
        preemption = store.preemption()
        try:
            assert preemption.requested_by_any() is False  # the first check: nothing started
            assert preemption.requested_by_any() is False
            os.kill(os.getpid(), signal.SIGTERM)
            assert preemption.requested
            assert preemption.requested_by_any() is False  # collects the agreement before it
            assert preemption.requested_by_any() is True
        finally:
            preemption.close()
