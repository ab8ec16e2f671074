"""The `tierstore` command and the demo, run as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.distributed.checkpoint as dcp

import tierstore


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "tierstore.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_ls_verify_gc_pin(tmp_path):
    config = tmp_path / "tiers.toml"
    config.write_text(f'[[tier]]\nname = "nvme"\nbackend = "local"\npath = "{tmp_path}/nvme"\n')
    with tierstore.open(config) as store:
        dcp.save({"w": torch.ones(1000)}, storage_writer=store.writer(), checkpoint_id="step-1")
    out = run_cli("ls", str(config))
    assert out.returncode == 0 and "step-1" in out.stdout and "nvme" in out.stdout
    out = run_cli("verify", str(config), "step-1")
    assert out.returncode == 0 and "step-1: ok on nvme" in out.stdout
    with open(tmp_path / "nvme" / "step-1" / "__0_0.distcp", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    out = run_cli("verify", str(config), "step-1")
    assert out.returncode == 1 and "__0_0.distcp: checksum" in out.stdout
    os.makedirs(tmp_path / "nvme" / ".tierstore-tmp.step-2.0123")
    out = run_cli("gc", str(config))
    assert out.returncode == 0 and "removed nvme:.tierstore-tmp.step-2.0123" in out.stdout
    assert run_cli("pin", str(config), "step-1").returncode == 0
    assert "yes" in run_cli("ls", str(config)).stdout
    out = run_cli("pin", str(config), "step-9")
    assert out.returncode == 2 and "cannot pin 'step-9'" in out.stderr


def test_cli_reports_config_errors_without_a_traceback(tmp_path):
    config = tmp_path / "tiers.toml"
    config.write_text('[[tier]]\nname = "nvme"\nbackend = "lokal"\npath = "/tmp/x"\n')
    out = run_cli("ls", str(config))
    assert out.returncode == 2
    assert "unknown backend 'lokal'" in out.stderr and "Traceback" not in out.stderr


def test_plugins_lists_builtins_with_origin():
    out = run_cli("plugins")
    assert out.returncode == 0
    assert "local        tierstore_plugins.local (built-in)" in out.stdout
    assert "atomic" in out.stdout and "cpu" in out.stdout


def test_plugins_of_a_config_include_its_store_plugins(tmp_path, monkeypatch):
    """``tierstore plugins tiers.toml`` lists the plugins that config loads ([store] plugins)
    beside the built-ins."""
    (tmp_path / "acme_cli_ext.py").write_text(
        "import tierstore\n"
        "from tierstore_plugins.local import LocalBackend\n"
        "@tierstore.hookimpl\n"
        "def tierstore_register_backends(register):\n"
        "    register('acme', LocalBackend)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    config = tmp_path / "tiers.toml"
    config.write_text('[store]\nplugins = ["acme_cli_ext"]\n\n'
                      f'[[tier]]\nname = "nvme"\nbackend = "acme"\npath = "{tmp_path}/t"\n')
    out = run_cli("plugins", str(config))
    assert out.returncode == 0, out.stderr
    assert "acme         acme_cli_ext ([store] plugins in" in out.stdout
    assert "local        tierstore_plugins.local (built-in)" in out.stdout


def test_demo_runs_and_every_load_is_bitwise_equal():
    out = subprocess.run([sys.executable, "-m", "tierstore.demo"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "demo finished: every load was bitwise equal" in out.stdout
    assert "latest(): step-4 (from 'nvme')" in out.stdout


def test_help_is_plain_text_and_a_plan_counts_ranks_in_words(tmp_path):
    """`--help` shows no reStructuredText markup, and `plan` says "1 rank", not "1 ranks"."""
    out = run_cli("--help")
    assert out.returncode == 0 and "The tierstore command" in out.stdout
    assert "``" not in out.stdout, out.stdout
    config = tmp_path / "tiers.toml"
    config.write_text(f'[[tier]]\nname = "nvme"\nbackend = "local"\npath = "{tmp_path}/nvme"\n')
    with tierstore.open(config) as store:
        dcp.save({"w": torch.ones(10)}, storage_writer=store.writer(), checkpoint_id="step-1")
    out = run_cli("plan", str(config), "step-1")
    assert out.returncode == 0, out.stderr
    assert "step-1 (saved by 1 rank) restored by 1 rank, 1 per node:" in out.stdout, out.stdout


def test_json_into_a_reader_that_stops_early_ends_without_a_traceback(tmp_path):
    """`tierstore ls --json | head -1`: the reader closing the pipe is no error to report."""
    config = tmp_path / "tiers.toml"
    config.write_text(f'[[tier]]\nname = "nvme"\nbackend = "local"\npath = "{tmp_path}/nvme"\n')
    with tierstore.open(config) as store:
        for step in range(1, 200):  # a listing longer than a pipe's buffer
            dcp.save({"w": torch.ones(1)}, storage_writer=store.writer(),
                     checkpoint_id=f"step-{step}")
    proc = subprocess.run(f"{sys.executable} -m tierstore.cli ls --json {config} | head -c 10",
                          shell=True, capture_output=True, text=True, timeout=120)
    assert proc.stdout.startswith("["), proc.stdout
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_help_and_version_answer_without_importing_torch():
    """An operator's `tierstore --help` or `--version` (or a script importing an error class)
    pays no `import torch`: the store, and torch with it, load when a command needs them."""
    script = ("import sys\nimport tierstore.cli\nfrom tierstore import ConfigError, __version__\n"
              "try:\n    tierstore.cli.main(['--version'])\nexcept SystemExit:\n    pass\n"
              "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[]"), out.stdout
    assert "tierstore " in out.stdout  # the version line
    assert callable(tierstore.open) and tierstore.Store.__name__ == "Store"  # still there
