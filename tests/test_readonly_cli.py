"""The reading commands of ``tierstore`` beside a live job: a real job process whose drain to
the slower tier is under way (held at its start by a plugin of the job), and ``ls``,
``status``, ``verify``, ``inspect`` run as an operator runs them. They answer at once and leave
every tier exactly as it was; ``wait`` is the command that makes the missing copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

TIERSTORE = os.path.join(os.path.dirname(sys.executable), "tierstore")

# The job: saves step-1 to the fast tier; its drain to the slow tier stops at its start
# (announced by HELD) until RELEASE exists, as a drain to a slow object store would take long.
JOB = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed.checkpoint as dcp
    import tierstore

    config, held, release = sys.argv[1:4]

    class HoldDrain:
        @tierstore.hookimpl
        def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail):
            if phase == "drain_begin":
                open(held, "w").close()
                while not os.path.exists(release):
                    time.sleep(0.05)

    with tierstore.open(config, plugins=[HoldDrain()]) as store:
        dcp.save({"w": torch.arange(4096, dtype=torch.float32)},
                 storage_writer=store.writer(), checkpoint_id="step-1")
""")


def _snapshot(*roots: str) -> dict[str, tuple]:
    """Every entry under ``roots``: type, size and modification time (what any write moves)."""
    found: dict[str, tuple] = {}
    for root in roots:
        found[root] = (os.path.isdir(root),)
        for here, dirs, files in os.walk(root):
            for name in dirs + files:
                path = os.path.join(here, name)
                st = os.lstat(path)
                found[path] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return found


def _cli(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, object]:
    proc = subprocess.run([TIERSTORE, *args, "--json"], capture_output=True, text=True,
                          timeout=timeout)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc, json.loads(proc.stdout) if proc.stdout else None


@pytest.fixture
def live_job(tmp_path):
    """A job process with step-1 committed on 'fast' and its drain to 'slow' held; yields
    (config, fast root, slow root), then lets the drain finish."""
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    config = tmp_path / "tiers.toml"
    config.write_text(f'[[tier]]\nname = "fast"\nbackend = "local"\npath = "{fast}"\n\n'
                      f'[[tier]]\nname = "slow"\nbackend = "local"\npath = "{slow}"\n')
    held, release = tmp_path / "held", tmp_path / "release"
    script = tmp_path / "job.py"
    script.write_text(JOB)
    job = subprocess.Popen([sys.executable, str(script), str(config), str(held), str(release)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not held.exists():
            assert job.poll() is None, job.stdout.read()
            assert time.monotonic() < deadline, "the job's drain never started"
            time.sleep(0.05)
        yield str(config), fast, slow
    finally:
        release.touch()
        try:
            job.wait(timeout=120)
        finally:
            if job.poll() is None:
                job.kill()
    assert job.returncode == 0, job.stdout.read()


def test_reading_commands_beside_a_live_drain_change_nothing(live_job):
    config, fast, slow = live_job
    before = _snapshot(fast, slow)
    # Each answers within seconds (the drain is held for as long as the test runs), showing
    # the checkpoint on the fast tier and the copy to the slow tier as pending, not made.
    proc, listed = _cli("ls", config, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert [(c["id"], c["tiers"]) for c in listed] == [("step-1", ["fast"])]
    proc, status = _cli("status", config, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert status["pending"] == [{"checkpoint_id": "step-1", "tier": "slow"}]
    proc, verified = _cli("verify", config, "step-1", timeout=30)
    assert proc.returncode == 0 and verified["ok"], proc.stderr
    proc, inspected = _cli("inspect", config, "step-1", timeout=30)
    assert proc.returncode == 0 and inspected["tiers"] == ["fast"], proc.stderr
    proc, planned = _cli("plan", config, "step-1", timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert [s["tier"] for s in planned["sources"]] == ["fast"], planned
    assert planned["from_slow_tiers_bytes"] == 0 and planned["missing"] == [], planned
    proc, scrubbed = _cli("scrub", config, timeout=30)
    assert proc.returncode == 0 and scrubbed["bad"] == [], proc.stderr
    assert _snapshot(fast, slow) == before  # not one file made, removed or touched


def test_wait_makes_the_missing_copies(tmp_path):
    """``wait`` is the command that acts: a copy the job never made (it exited first) is made
    by it, and listed; the reading commands before it did not make it."""
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    config = tmp_path / "tiers.toml"
    config.write_text(f'[[tier]]\nname = "fast"\nbackend = "local"\npath = "{fast}"\n\n'
                      f'[[tier]]\nname = "slow"\nbackend = "local"\npath = "{slow}"\n')
    job = textwrap.dedent(f"""
        import torch, torch.distributed.checkpoint as dcp, tierstore
        store = tierstore.open({str(config)!r})
        dcp.save({{"w": torch.ones(8)}}, storage_writer=store.writer(emergency=True),
                 checkpoint_id="step-1")
        store.close()
    """)
    subprocess.run([sys.executable, "-c", job], check=True, timeout=120)
    proc, listed = _cli("ls", str(config))
    assert [(c["id"], c["tiers"]) for c in listed] == [("step-1", ["fast"])]
    proc, waited = _cli("wait", str(config))
    assert proc.returncode == 0, proc.stderr
    assert waited["copied"] == [{"checkpoint_id": "step-1", "tier": "slow"}]
    proc, listed = _cli("ls", str(config))
    assert [(c["id"], sorted(c["tiers"])) for c in listed] == [("step-1", ["fast", "slow"])]


def test_a_read_only_store_refuses_what_writes(tmp_path):
    import tierstore

    root = tmp_path / "fast"
    with tierstore.open({"tier": [{"name": "fast", "backend": "local", "path": str(root)}]},
                        read_only=True) as store:
        assert store.list() == []
        for act in (store.writer, store.gc, lambda: store.pin("step-1"),
                    lambda: store.scrub(repair=True)):
            with pytest.raises(RuntimeError, match="read_only"):
                act()
    assert not root.exists()  # not even the tier's root was made
