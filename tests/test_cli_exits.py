"""One exit status and one hint per situation, as a newcomer meets them: a Lightning file name
given as an id, a tier whose server is down, a bad copy; and the operations page's table is the
one the code uses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore.cli.exits import Exit, markdown_table
from tierstore.integrations.lightning.paths import checkpoint_id

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, cwd=None, python_flags=()):
    """``tierstore ARGS`` in a subprocess, as a user runs it."""
    proc = subprocess.run([sys.executable, *python_flags, "-m", "tierstore.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=180, cwd=cwd)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def _local_store(tmp_path, ids) -> Path:
    """A one-tier store holding ``ids``; its TOML's path."""
    config = tmp_path / "tiers.toml"
    config.write_text(f'[[tier]]\nname = "disk"\nbackend = "local"\npath = "{tmp_path}/disk"\n')
    with tierstore.open(config) as store:
        for cid in ids:
            dcp.save({"w": torch.ones(10)}, storage_writer=store.writer(), checkpoint_id=cid)
    return config


def test_the_operations_page_holds_the_exit_status_table_of_the_code():
    page = (ROOT / "docs" / "operations.md").read_text()
    assert markdown_table() in page
    assert [int(code) for code in Exit] == [0, 1, 2, 3, 130, 141]


def test_a_lightning_file_name_given_as_an_id_is_answered_with_its_id(tmp_path):
    """`tierstore inspect tiers.toml epoch=0-step=10.ckpt` (no id: '=' is not allowed) and
    `verify tiers.toml last.ckpt` (an id, but no checkpoint's) both exit 2 and name the id the
    Lightning integration stored that file under; Lightning is not imported for it."""
    epoch = checkpoint_id(tmp_path / "ckpts" / "epoch=0-step=10.ckpt")
    last = checkpoint_id(tmp_path / "ckpts" / "last.ckpt")
    config = _local_store(tmp_path, [epoch, last, "step-3"])

    proc = cli("inspect", config, "epoch=0-step=10.ckpt", python_flags=("-X", "importtime"))
    assert proc.returncode == Exit.USAGE == 2, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    assert "tierstore.integrations.lightning.paths" in imported
    assert not imported & {"lightning", "pytorch_lightning", "lightning_fabric"}
    error = [line for line in proc.stderr.splitlines() if line.startswith("tierstore:")]
    assert error == [f"tierstore: error: 'epoch=0-step=10.ckpt' is a Lightning checkpoint file "
                     f"name, not a checkpoint id: the store holds it as '{epoch}' "
                     f"(`tierstore inspect {config} {epoch}`)"], proc.stderr

    proc = cli("verify", config, "last.ckpt")
    assert proc.returncode == 2, proc.stderr
    assert f"the store holds it as '{last}' (`tierstore verify {config} {last}`)" \
        in proc.stderr, proc.stderr

    # A name the store holds under no id: the id it would have, saved from here.
    proc = cli("plan", config, "epoch=9-step=99.ckpt", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    would_be = checkpoint_id(tmp_path / "epoch=9-step=99.ckpt")
    assert (f"saved in {tmp_path}, it would be '{would_be}', and no tier holds a checkpoint of "
            f"that name; `tierstore ls {config}` shows what is stored") in proc.stderr, \
        proc.stderr


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_tier_that_does_not_answer_is_exit_3_and_one_sentence_naming_endpoint_url(tmp_path):
    """`status` and `ls` with an S3 tier whose server is down: the listing of the local tier
    all the same, exit 3 (neither 0 nor the 1 of a bad checkpoint), and one sentence naming the
    endpoint and the option to check, not three nested messages."""
    _local_store(tmp_path, ["step-1"])
    endpoint = f"http://127.0.0.1:{_dead_port()}"
    config = tmp_path / "two.toml"
    config.write_text(
        f'[[tier]]\nname = "disk"\nbackend = "local"\npath = "{tmp_path}/disk"\n\n'
        f'[[tier]]\nname = "s3"\nbackend = "fsspec"\nurl = "s3://bucket/run"\n'
        f'options = {{ endpoint_url = "{endpoint}", key = "k", secret = "s" }}\n'
        f'max_attempts = 2\nretry_seconds = 1\n')

    proc = cli("status", config)
    assert proc.returncode == Exit.TIER_DOWN == 3, proc.stderr
    assert "\ndisk  " in proc.stdout and "step-1" in proc.stdout, proc.stdout
    down = [line for line in proc.stdout.splitlines() if line.startswith("tier 's3'")]
    assert len(down) == 1, proc.stdout
    assert down[0].startswith(f"tier 's3' is unreachable: s3://bucket/run cannot be connected "
                              f"to at {endpoint} (EndpointConnectionError: "), down
    assert down[0].endswith(f"); check that the server is running there and that endpoint_url "
                            f"in the tier's options ({config}:10) is its address"), down
    assert "GaveUp" not in down[0] and down[0].count("cannot be connected to") == 1, down
    assert "tierstore: 1 tier unreachable: s3" in proc.stderr, proc.stderr

    proc = cli("ls", config)
    assert proc.returncode == 3, proc.stderr
    assert "step-1" in proc.stdout and "disk" in proc.stdout, proc.stdout
    assert "tier 's3' is unreachable, so what it holds is not listed" in proc.stderr


def test_scrub_counts_its_problems_in_words(tmp_path):
    config = _local_store(tmp_path, ["step-1"])
    data = next((tmp_path / "disk" / "step-1").glob("*.distcp"))
    with open(data, "r+b") as f:
        f.seek(10)
        f.write(b"\xff\x00\xff")
    proc = cli("scrub", config)
    assert proc.returncode == Exit.BAD == 1, proc.stderr
    assert proc.stdout.startswith("checked 1 copy: 1 problem\n"), proc.stdout
    assert "problem(s)" not in proc.stdout


def test_a_reader_that_stops_early_ends_the_command_as_sigpipe_would(tmp_path):
    """`tierstore ls --json | head -c 10` under `set -o pipefail`: 141 (128 + SIGPIPE, what a
    shell reports for `yes | head`), not 1, which a script would take for a bad checkpoint.
    The reader here is gone before the command writes anything (`true`): with `head`, whether
    the listing still fits the pipe when head exits depends on the machine's load."""
    config = _local_store(tmp_path, [f"step-{step}" for step in range(1, 200)])
    script = (f"set -o pipefail; {sys.executable} -m tierstore.cli ls --json {config} "
              f"| true; echo \"status=${{PIPESTATUS[0]}}\"")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=180,
                          env={**os.environ})
    assert proc.stdout.strip() == f"status={int(Exit.PIPE_CLOSED)}", (proc.stdout, proc.stderr)
    assert proc.stderr == "", proc.stderr
