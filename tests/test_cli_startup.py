"""What ``tierstore`` costs before it does anything: ``--help``, ``--version``, each command's
``--help`` and an id that is no id answer without importing torch (seconds of a newcomer's
first minute), and their help is plain text."""

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
