"""What ``tierstore`` costs before it does anything: ``--help``, ``--version``, each command's
``--help`` and an id that is no id answer without importing torch (seconds of a newcomer's
first minute), and their help is plain text; ``ls`` and ``status`` load no torch from the
core."""

from __future__ import annotations

import json
import subprocess
import sys

from tierstore.cli import _COMMANDS

#: every command, the ones whose module is imported on their own (bench, goodput, simulate) too
EVERY_COMMAND = (*_COMMANDS, "bench", "goodput", "simulate")

#: runs ``tierstore.cli.main`` on each argv (a JSON list), as the console script does; prints
#: what each printed and its exit status, then the torch modules the process imported
_SCRIPT = """
import contextlib, io, json, sys
from tierstore.cli import main
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exc:  # --help and --version end in argparse's exit
            status = exc.code
    print(json.dumps({"argv": argv, "status": status, "out": out.getvalue(),
                      "err": err.getvalue()}))
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""


def _run(argvs: list[list[str]]) -> tuple[list[dict], list[str]]:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(argvs)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    return lines[:-1], lines[-1]


def test_help_version_and_each_commands_help_import_no_torch():
    """`tierstore --help`, `tierstore --version` and `tierstore CMD --help` for every command
    answer without importing torch (an import of several seconds)."""
    argvs = [["--help"], ["--version"], *([name, "--help"] for name in EVERY_COMMAND)]
    answers, torch_modules = _run(argvs)
    assert torch_modules == [], torch_modules[:5]
    for answer in answers:
        assert answer["status"] == 0, answer
        assert answer["out"], answer
    assert answers[1]["out"].startswith("tierstore "), answers[1]


def test_an_id_that_is_no_id_is_refused_before_torch_is_imported(tmp_path):
    """An id that cannot be one is refused at once (exit 2, what an id is), without loading
    the store: the config is not even read."""
    answers, torch_modules = _run([["inspect", str(tmp_path / "tiers.toml"), "step 100"],
                                   ["pin", str(tmp_path / "tiers.toml"), "../step-1"]])
    assert torch_modules == [], torch_modules[:5]
    for answer in answers:
        assert answer["status"] == 2, answer
        assert answer["err"].startswith("tierstore: error: invalid checkpoint id"), answer
        assert "letters, digits, '.', '_' and '-'" in answer["err"], answer


def test_help_is_plain_text_and_lists_the_exit_statuses():
    """No ``markup`` (double or single backticks) in any help, and the top-level help ends with
    every exit status, from the one definition of them."""
    from tierstore.cli.exits import Exit

    answers, _ = _run([["--help"], *([name, "--help"] for name in EVERY_COMMAND)])
    for answer in answers:
        assert "`" not in answer["out"], (answer["argv"], answer["out"])
    top = answers[0]["out"]
    assert "exit status:" in top
    for code in Exit:
        assert f"\n  {int(code):<5}" in top, (code, top)



#: runs ``tierstore.cli.main`` on each argv (a JSON list) as :data:`_SCRIPT` does, and records
#: each import statement in a module of the core (at its top or in a function) that loads a
#: torch module not loaded yet; prints the answers, those imports ("file:line module") and the
#: core's modules loaded at the end
_CORE_IMPORTS_SCRIPT = """
import builtins, contextlib, io, json, os, sys
import tierstore
core = os.path.dirname(os.path.abspath(tierstore.__file__)) + os.sep
found = []
plain_import = builtins.__import__
def watching_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and (name == "torch" or name.startswith("torch.")) and name not in sys.modules:
        caller = sys._getframe(1)
        if os.path.abspath(caller.f_code.co_filename).startswith(core):
            found.append(f"{caller.f_code.co_filename}:{caller.f_lineno} {name}")
    return plain_import(name, globals, locals, fromlist, level)
builtins.__import__ = watching_import
from tierstore.cli import main
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    print(json.dumps({"argv": argv, "status": status, "out": out.getvalue(),
                      "err": err.getvalue()}))
print(json.dumps(found))
print(json.dumps(sorted(m for m in sys.modules if m.startswith("tierstore."))))
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""

#: modules of the core that import DCP or torch when they are imported: a query of tiers
#: without codecs or replication imports none of them
_DCP_MODULES = ("tierstore.dcp.reader", "tierstore.dcp.writer", "tierstore.dcp.contents",
                "tierstore.dcp.spill", "tierstore.format.item_io", "tierstore.format.metadata",
                "tierstore.format.tensor_records", "tierstore.engine.parity",
                "tierstore.engine.replication", "tierstore.transport.transfer")


def test_commands_that_read_no_tensor_load_no_torch(tmp_path):
    """`tierstore ls`, `status`, `pin`, `unpin`, `verify`, `plan`, `gc` and `wait` on a RAM
    and a local tier holding a checkpoint: no module of the core loads torch or DCP (seconds to import) for them, neither where it
    is imported nor in what it runs: opening a store read-only and reading its manifests needs
    none (nor do checksums, pins and the job's token of one process), and DCP's adapters are
    built only when a reader or a writer is asked for. Nor do the
    plugins the store registers, built-in or installed: the command starts in a fraction of a
    second instead of the seconds torch takes to import."""
    import torch
    import torch.distributed.checkpoint as dcp

    import tierstore

    config = tmp_path / "tiers.toml"
    config.write_text(f'[[tier]]\nname = "ram"\nbackend = "memory"\npath = "{tmp_path / "ram"}"\n'
                      f'\n[[tier]]\nname = "nvme"\nbackend = "local"\n'
                      f'path = "{tmp_path / "nvme"}"\n')
    with tierstore.open(str(config)) as store:
        dcp.save({"w": torch.arange(64.0)}, storage_writer=store.writer(),
                 checkpoint_id="step-1")

    proc = subprocess.run(
        [sys.executable, "-c", _CORE_IMPORTS_SCRIPT,
         json.dumps([["ls", str(config), "--json"], ["status", str(config), "--json"],
                     *([command, str(config), "step-1"] for command in ("pin", "unpin",
                                                                          "verify", "plan")),
                     ["gc", str(config)], ["wait", str(config)]])],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    *answers, found, loaded, torch_modules = [json.loads(line)
                                              for line in proc.stdout.splitlines()]
    ls, status, *others = answers
    assert all(answer["status"] == 0 for answer in answers), answers
    assert [(c["id"], c["tiers"]) for c in json.loads(ls["out"])] == [("step-1", ["ram", "nvme"])]
    assert [(t["name"], t["reachable"], t["newest"]) for t in json.loads(status["out"])["tiers"]] \
        == [("ram", True, "step-1"), ("nvme", True, "step-1")]
    assert found == [], "the core loaded torch for ls or status:\n" + "\n".join(found)
    assert sorted(set(_DCP_MODULES) & set(loaded)) == []
    # nor does any plugin: the built-in ones and the example third-party package (installed
    # by `make test`, registered through its entry point) import torch where they use it
    assert torch_modules == [], torch_modules[:5]
