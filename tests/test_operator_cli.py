"""Operator tools as an operator runs them: the ``tierstore`` console script in a subprocess,
on a real multi-tier store (a ``memory`` tier, a ``local`` one, and a ``local`` one every 10th
step), its ``--json`` documents parsed and checked, its exit codes, its progress bars under a
pseudo-terminal."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore import EventKind

from recording import Recorder

TIERSTORE = os.path.join(os.path.dirname(sys.executable), "tierstore")


def _state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(256, 64, generator=gen),
                      "b": torch.randn(64, generator=gen).to(torch.bfloat16),
                      "ids": torch.arange(step * 10, dtype=torch.int64)[: 7]},
            "optim": {"step": torch.tensor(float(step)), "lr": 0.01},
            "step": step}


def _toml_value(value) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def _write_toml(path, tiers: list[dict]) -> str:
    lines = []
    for tier in tiers:
        lines.append("[[tier]]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in tier.items()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _tiers(tmp_path) -> list[dict]:
    return [{"name": "ram", "backend": "memory", "path": str(tmp_path / "ram"), "keep": 2},
            {"name": "disk", "backend": "local", "path": str(tmp_path / "disk")},
            {"name": "cold", "backend": "local", "path": str(tmp_path / "cold"), "every": 10}]


@pytest.fixture
def store_toml(tmp_path):
    """Three saves (step-1..3) through a three-tier store, drained; the TOML's path."""
    toml = _write_toml(tmp_path / "tiers.toml", _tiers(tmp_path))
    with tierstore.open(toml) as store:
        for step in (1, 2, 3):
            dcp.save(_state(step), storage_writer=store.writer(), checkpoint_id=f"step-{step}")
        store.wait()
    return toml


def cli(*args, check_json: bool = True):
    """Run the console script; with ``--json`` among ``args``, parse stdout (which must be one
    JSON document and nothing else)."""
    proc = subprocess.run([TIERSTORE, *map(str, args)], capture_output=True, text=True,
                          timeout=180)
    doc = json.loads(proc.stdout) if "--json" in args and check_json and proc.stdout else None
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc, doc


def _load_alone(tmp_path, tier: dict, cid: str) -> dict:
    """``cid`` loaded through a store of ``tier`` alone."""
    out = {"model": {"w": torch.zeros(256, 64), "b": torch.zeros(64, dtype=torch.bfloat16),
                     "ids": torch.zeros(7, dtype=torch.int64)},
           "optim": {"step": torch.tensor(0.0), "lr": None}, "step": None}
    with tierstore.open({"tier": [dict(tier, every=1)]}) as store:
        dcp.load(out, storage_reader=store.reader(), checkpoint_id=cid)
    return out


def _assert_equal(actual: dict, expected: dict) -> None:
    for key in ("w", "b", "ids"):
        assert torch.equal(actual["model"][key], expected["model"][key]), key
    assert torch.equal(actual["optim"]["step"], expected["optim"]["step"])
    assert actual["optim"]["lr"] == expected["optim"]["lr"] and actual["step"] == expected["step"]


def test_ls_status_and_inspect_answer_in_their_documented_json(store_toml):
    proc, listed = cli("ls", store_toml, "--json")
    assert proc.returncode == 0
    assert [c["id"] for c in listed] == ["step-3", "step-2", "step-1"]
    assert set(listed[0]) == {"id", "tiers", "size_bytes", "created", "committed", "pinned",
                              "step"}
    assert listed[0]["tiers"] == ["ram", "disk"] and listed[2]["tiers"] == ["disk"]

    proc, status = cli("status", store_toml, "--json")
    assert proc.returncode == 0 and set(status) == {"tiers", "pending"}
    by_name = {t["name"]: t for t in status["tiers"]}
    assert list(by_name) == ["ram", "disk", "cold"]
    for t in by_name.values():
        assert set(t) == {"name", "reachable", "newest", "newest_age_s", "steps_behind",
                          "bytes", "free_bytes"}
        assert t["reachable"] is True and t["free_bytes"] > 0
    assert by_name["ram"]["newest"] == "step-3" and by_name["ram"]["steps_behind"] == 0
    assert by_name["cold"]["newest"] is None and by_name["cold"]["bytes"] == 0
    assert 0 <= by_name["disk"]["newest_age_s"] < 600
    assert by_name["disk"]["bytes"] == sum(c["size_bytes"] for c in listed)
    assert status["pending"] == []

    proc, report = cli("inspect", store_toml, "step-2", "--json")
    assert proc.returncode == 0
    assert set(report) == {"id", "world_size", "tiers", "files", "tensors"}
    assert report["id"] == "step-2" and report["world_size"] == 1
    assert report["tiers"] == ["ram", "disk"]
    assert {f["name"]: f["rank"] for f in report["files"]}[".metadata"] is None
    assert {(t["fqn"], tuple(t["shape"]), t["dtype"], t["bytes"]) for t in report["tensors"]} \
        == {("model.w", (256, 64), "float32", 65536), ("model.b", (64,), "bfloat16", 128),
            ("model.ids", (7,), "int64", 56), ("optim.step", (), "float32", 4)}

    proc, _ = cli("status", store_toml)
    assert proc.returncode == 0 and "no pending copies" in proc.stdout
    assert proc.stdout.splitlines()[0].split()[:3] == ["tier", "reachable", "newest"]


def test_a_flipped_byte_is_found_by_verify_and_scrub_and_repaired_by_scrub_repair(
        store_toml, tmp_path):
    victim = tmp_path / "disk" / "step-3" / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    gone = tmp_path / "disk" / "step-2" / ".metadata"
    gone.unlink()

    proc, verified = cli("verify", store_toml, "step-3", "--json")
    assert proc.returncode == 1 and verified["ok"] is False
    assert [(p["tier"], p["file"]) for p in verified["problems"]] == [("disk", "__0_0.distcp")]
    assert "checksum" in verified["problems"][0]["problem"]

    proc, scrubbed = cli("scrub", store_toml, "--json")
    assert proc.returncode == 1 and scrubbed["checked"] == 5  # 2 on ram, 3 on disk
    assert sorted((b["id"], b["tier"], b["file"]) for b in scrubbed["bad"]) == [
        ("step-2", "disk", ".metadata"), ("step-3", "disk", "__0_0.distcp")]
    assert scrubbed["repaired"] == []
    assert victim.read_bytes() == bytes(data)  # without --repair nothing changes

    proc, repaired = cli("scrub", store_toml, "--repair", "--json")
    assert proc.returncode == 0, proc.stderr
    assert sorted((r["id"], r["tier"], r["source"]) for r in repaired["repaired"]) == [
        ("step-2", "disk", "ram"), ("step-3", "disk", "ram")]
    proc, verified = cli("verify", store_toml, "step-3", "--json")
    assert proc.returncode == 0 and verified["ok"] is True and verified["problems"] == []
    assert gone.exists()
    _assert_equal(_load_alone(tmp_path, _tiers(tmp_path)[1], "step-3"), _state(3))
    _assert_equal(_load_alone(tmp_path, _tiers(tmp_path)[1], "step-2"), _state(2))
    proc, clean = cli("scrub", store_toml, "--json")
    assert proc.returncode == 0 and clean["bad"] == []


def test_a_bad_copy_with_no_good_copy_elsewhere_stays_and_says_so(store_toml, tmp_path):
    victim = tmp_path / "disk" / "step-1" / "__0_0.distcp"  # step-1 is on disk alone
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    proc, report = cli("scrub", store_toml, "--repair", "--json")
    assert proc.returncode == 1 and report["repaired"] == []
    assert [(u["id"], u["file"]) for u in report["unrepaired"]] == [("step-1", "__0_0.distcp")]
    assert "no good copy" in report["unrepaired"][0]["problem"]
    assert victim.read_bytes() == bytes(data)  # nothing was deleted without a replacement


def test_promote_copies_to_a_tier_its_every_skipped_and_pins_it_there(store_toml, tmp_path):
    proc, promoted = cli("promote", store_toml, "step-2", "--to", "cold", "--pin", "--json")
    assert proc.returncode == 0, proc.stderr
    assert set(promoted) == {"id", "tier", "bytes", "seconds"}
    assert (promoted["id"], promoted["tier"]) == ("step-2", "cold") and promoted["bytes"] > 0
    cold = _tiers(tmp_path)[2]
    _assert_equal(_load_alone(tmp_path, cold, "step-2"), _state(2))
    manifest = json.loads((tmp_path / "cold" / "step-2" / "tierstore.json").read_text())
    assert manifest["pinned"] is True
    proc, listed = cli("ls", store_toml, "--json")
    assert {c["id"]: c["tiers"] for c in listed}["step-2"] == ["ram", "disk", "cold"]

    proc, _ = cli("promote", store_toml, "step-2", "--to", "nowhere")
    assert proc.returncode == 2 and "no tier named 'nowhere'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc, _ = cli("promote", store_toml, "step-9", "--to", "cold")
    assert proc.returncode == 2 and "cannot promote 'step-9'" in proc.stderr


def test_export_in_both_formats_loads_back_bitwise(store_toml, tmp_path):
    out = tmp_path / "export"
    proc, exported = cli("export", store_toml, "step-3", "--format", "torch", "--out",
                         out / "step-3.pt", "--json")
    assert proc.returncode == 0, proc.stderr
    assert set(exported) == {"id", "format", "path", "tensors", "bytes"}
    assert exported["tensors"] == 4 and exported["bytes"] == 65536 + 128 + 56 + 4
    loaded = torch.load(out / "step-3.pt", weights_only=True)
    expected = _state(3)
    assert set(loaded) == {"model.w", "model.b", "model.ids", "optim.step", "optim.lr", "step"}
    for fqn in ("w", "b", "ids"):
        assert torch.equal(loaded[f"model.{fqn}"], expected["model"][fqn])
    assert loaded["optim.lr"] == 0.01 and loaded["step"] == 3

    import safetensors.torch as safetensors  # the test extra installs it
    proc, exported = cli("export", store_toml, "step-3", "--format", "safetensors", "--out",
                         out / "step-3.safetensors", "--json")
    assert proc.returncode == 0 and exported["format"] == "safetensors"
    tensors = safetensors.load_file(str(out / "step-3.safetensors"))
    assert set(tensors) == {"model.w", "model.b", "model.ids", "optim.step"}
    for fqn in ("w", "b", "ids"):
        assert torch.equal(tensors[f"model.{fqn}"], expected["model"][fqn])
    assert sorted(p.name for p in out.iterdir()) == ["step-3.pt", "step-3.safetensors"]


def test_status_reports_a_dead_object_store_and_answers_for_the_local_tiers(
        seaweed, s3_bucket, tmp_path):
    tiers = [{"name": "disk", "backend": "local", "path": str(tmp_path / "disk")},
             {"name": "s3", "backend": "fsspec", "url": f"{s3_bucket}/run",
              "options": seaweed.storage_options(), "max_attempts": 2, "retry_seconds": 1}]
    toml = _write_toml(tmp_path / "tiers.toml", tiers)
    with tierstore.open(toml) as store:
        dcp.save(_state(1), storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
        dcp.save(_state(2), storage_writer=store.writer(), checkpoint_id="step-2")
        store.wait()
    seaweed.kill()
    try:
        proc, status = cli("status", toml, "--json")
        # Reported, with a status of its own (3: not a bad checkpoint, 1) so that a monitor
        # running `status` notices it and tells it apart.
        assert proc.returncode == 3, proc.stderr
        assert "1 tier unreachable: s3" in proc.stderr, proc.stderr
        disk, s3 = status["tiers"]
        assert (disk["name"], disk["reachable"], disk["newest"]) == ("disk", True, "step-2")
        assert (s3["name"], s3["reachable"], s3["newest"]) == ("s3", False, None)
        proc, _ = cli("status", toml)
        assert proc.returncode == 3, proc.stderr
        # One sentence: where it was asked, and the option that says where the server is.
        endpoint = seaweed.endpoint_url
        assert (f"tier 's3' is unreachable: {s3_bucket}/run cannot be connected to at "
                f"{endpoint} (") in proc.stdout, proc.stdout
        assert "endpoint_url in the tier's options" in proc.stdout, proc.stdout
        assert "GaveUp" not in proc.stdout, proc.stdout
        # `ls` lists what the local tier holds, and says (exit 3, stderr) that the listing
        # lacks the dead tier's: a script must not take it for everything there is.
        proc, listed = cli("ls", toml, "--json")
        assert proc.returncode == 3, proc.stderr
        assert "tier 's3' is unreachable, so what it holds is not listed" in proc.stderr
        assert [(c["id"], c["tiers"]) for c in listed] == [("step-2", ["disk"]),
                                                           ("step-1", ["disk"])], listed
    finally:
        seaweed.restart()


def _run_in_pty(args: list[str]) -> tuple[int, str, str]:
    """Run the console script with stderr on a pseudo-terminal (stdout a pipe); returns the
    exit status, stdout and what the terminal showed."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([TIERSTORE, *args], stdout=subprocess.PIPE, stderr=slave,
                            env={**os.environ, "COLUMNS": "120"})
    os.close(slave)
    shown = b""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    out = proc.stdout.read().decode()
    return proc.wait(timeout=60), out, shown.decode(errors="replace")


def test_progress_bars_show_on_a_terminal_and_never_under_json(store_toml):
    code, out, shown = _run_in_pty(["verify", store_toml, "step-3"])
    assert code == 0 and "step-3: ok on ram, disk" in out
    assert "verify step-3" in shown and "100%" in shown and "4/4 files" in shown
    code, out, shown = _run_in_pty(["scrub", store_toml])
    assert code == 0 and "scrub" in shown and "files" in shown
    code, out, shown = _run_in_pty(["verify", store_toml, "step-3", "--json"])
    assert code == 0 and json.loads(out)["ok"] is True
    assert "%" not in shown and "files" not in shown
    proc, _ = cli("verify", store_toml, "step-3")  # stderr a pipe: no bar either
    assert proc.returncode == 0 and proc.stderr == ""


def test_background_scrub_repairs_a_cold_copy_on_its_own(tmp_path):
    config = {"store": {"scrub_every_s": 0.05}, "tier": _tiers(tmp_path)[:2]}
    with tierstore.open({"tier": config["tier"]}) as store:
        dcp.save(_state(1), storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
    victim = tmp_path / "disk" / "step-1" / "__0_0.distcp"
    good = victim.read_bytes()
    victim.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    rec = Recorder()
    with tierstore.open(config, plugins=[rec]):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                e.kind == EventKind.REPAIRED for e in rec.events):
            time.sleep(0.05)
    repaired = [e for e in rec.events if e.kind == EventKind.REPAIRED]
    assert [(e.checkpoint_id, e.tier, e.detail["source"]) for e in repaired][:1] == [
        ("step-1", "disk", "ram")]
    failed = [e for e in rec.events if e.kind == EventKind.FAILED]
    assert failed and failed[0].detail["during"] == "scrub"
    assert victim.read_bytes() == good


def test_wait_finishes_the_copies_a_crash_left_pending(tmp_path):
    """Saves committed on the RAM tier only (the job died before its drains): `tierstore wait`
    copies them to the slower tier and says which."""
    tiers = _tiers(tmp_path)[:2]
    with tierstore.open({"tier": [tiers[0]]}) as store:
        for step in (1, 2):
            dcp.save(_state(step), storage_writer=store.writer(), checkpoint_id=f"step-{step}")
    toml = _write_toml(tmp_path / "tiers.toml", tiers)
    proc, waited = cli("wait", toml, "--json")
    assert proc.returncode == 0, proc.stderr
    assert set(waited) == {"copied", "seconds"}
    assert {(c["checkpoint_id"], c["tier"]) for c in waited["copied"]} == {
        ("step-1", "disk"), ("step-2", "disk")}
    _assert_equal(_load_alone(tmp_path, tiers[1], "step-2"), _state(2))
    proc, waited = cli("wait", toml, "--json")
    assert proc.returncode == 0 and waited["copied"] == []


def test_every_command_answers_json_and_nothing_else_on_stdout(store_toml, tmp_path):
    for args in (["gc", store_toml], ["pin", store_toml, "step-1"],
                 ["unpin", store_toml, "step-1"], ["plugins", store_toml]):
        proc, doc = cli(*args, "--json")
        assert proc.returncode == 0, (args, proc.stderr)
        assert isinstance(doc, dict), args
    proc, doc = cli("plugins", "--json")
    assert {"name": "local", "plugin": "tierstore_plugins.local", "origin": "built-in"} \
        in doc["backend"]
    proc, doc = cli("verify", store_toml, "step-9", "--json")
    assert proc.returncode == 2 and doc["ok"] is False and "step-9" in proc.stderr


def test_an_id_on_no_tier_gets_one_exit_status_and_one_hint_from_every_command(store_toml,
                                                                               tmp_path):
    """inspect, verify, plan, promote, export, pin and unpin all answer a missing id alike:
    exit 2, and the same pointer to the command that lists what is stored."""
    commands = [["inspect"], ["verify"], ["plan"], ["promote", "--to", "disk"],
                ["export", "--format", "torch", "--out", str(tmp_path / "x.pt")], ["pin"],
                ["unpin"]]
    for command in commands:
        proc, _ = cli(command[0], store_toml, "step-9", *command[1:])
        assert proc.returncode == 2, (command, proc.stderr)
        assert proc.stderr.startswith("tierstore: error: "), (command, proc.stderr)
        assert "'step-9'" in proc.stderr, (command, proc.stderr)
        assert f"`tierstore ls {store_toml}` shows what is stored" in proc.stderr, \
            (command, proc.stderr)
        assert "store.list()" not in proc.stderr, (command, proc.stderr)
