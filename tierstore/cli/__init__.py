"""The ``tierstore`` command: look at and maintain a store from the shell.

    tierstore ls tiers.toml                 checkpoints, newest first, and the tiers holding them
    tierstore status tiers.toml             per tier: reachable, newest checkpoint, its age, steps
                                            behind, bytes, free space; pending copies
    tierstore inspect tiers.toml ID         files per rank, tensors, where each copy is
    tierstore plan tiers.toml ID [--world-size N --ranks-per-node R]
                                            where a restore at that shape would read each file:
                                            a node of the job (own copy or replica), a shared
                                            tier, or nowhere
    tierstore verify tiers.toml ID          re-read and check sizes and checksums (exit 1 if bad)
    tierstore promote tiers.toml ID --to T  copy a checkpoint to tier T whatever its `every`
    tierstore export tiers.toml ID --format torch|safetensors|dcp --out PATH
                                            one consolidated file from the fastest good copy
    tierstore scrub tiers.toml [--repair]   verify every copy; replace bad ones from good ones
    tierstore wait tiers.toml               finish the copies pending to slower tiers
    tierstore gc tiers.toml                 remove what interrupted saves left behind
    tierstore pin|unpin tiers.toml ID       protect a checkpoint from `keep`, or release it
    tierstore plugins [tiers.toml]          registered plugins by kind, with their origin
    tierstore demo                          the demo job (what `make demo` runs)
    tierstore bench --out DIR               the benchmarks side by side, with charts
    tierstore goodput EVENTS.jsonl --out DIR
                                            goodput of a job from its [store] events_log:
                                            report.json, timeline.png, goodput.png
    tierstore simulate [SCENARIO.toml] --out DIR
                                            a real job under real failures (killed ranks, a
                                            lost node, a preemption), once per contender
                                            (stock DCP, tierstore): the same report and charts

Every command takes --json (one JSON document on stdout, nothing else there) and exits with
one status per situation, whatever the command (the list below, from tierstore.cli.exits).
Long operations draw a progress bar on stderr when it is a terminal. ls, status, inspect,
verify, plan, export and scrub (without --repair) open the store read-only: beside a running job
they resume none of its drains and write nothing to any tier; wait and gc are the ones that act.
"""

from __future__ import annotations

import argparse
import os
import sys

from tierstore.cli.exits import Exit, help_text
from tierstore.errors import (LIST_HINT, CheckpointNotFound, ConfigError, PluginError,
                              TierstoreError)
from tierstore.version import __version__

__all__ = ["main"]

#: the commands of :mod:`tierstore.cli.commands` (which imports the store, torch and DCP: only
#: once a command runs, so that ``--help`` and ``--version`` answer at once)
_COMMANDS = ("ls", "status", "inspect", "plan", "verify", "promote", "export", "scrub", "wait",
             "gc", "pin", "unpin", "plugins", "demo")


#: what an ``id`` argument is, and where to find one
_ID_HELP = "a checkpoint id, as 'tierstore ls CONFIG' lists them (for example step-100)"


def _command(name: str):
    """The function running command ``name``, imported when it runs."""
    def run(args: argparse.Namespace) -> int:
        from tierstore.cli.commands import COMMANDS

        return COMMANDS[name](args)
    return run


def _plain(text: str) -> str:
    """``text`` as a terminal shows it: no reStructuredText or Markdown code markup."""
    return text.replace("``", "").replace("`", "'")


def _parser() -> argparse.ArgumentParser:
    # The module docstring is the help, and the exit statuses its epilog, as plain text.
    parser = argparse.ArgumentParser(prog="tierstore", description=_plain(__doc__),
                                     epilog=help_text(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tierstore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, config: str | None = "config") -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=_plain(help), description=_plain(help))
        if config == "config":
            p.add_argument("config", help="the store's TOML file")
        elif config == "optional":
            p.add_argument("config", nargs="?", help="a store's TOML file (its plugins too)")
        p.add_argument("--json", action="store_true",
                       help="print one JSON document on stdout (nothing else there)")
        p.set_defaults(fn=_command(name) if name in _COMMANDS else None)
        return p

    command("ls", "list checkpoints, newest first")
    command("status", "what a failure would cost now, per tier")
    command("inspect", "a checkpoint's files and tensors").add_argument("id", help=_ID_HELP)
    p = command("plan", "where a restore at a given shape would read each file from")
    p.add_argument("id", help=_ID_HELP)
    p.add_argument("--world-size", type=int, metavar="N",
                   help="ranks of the restoring job (default: the save's)")
    p.add_argument("--ranks-per-node", type=int, metavar="R",
                   help="ranks per node of the restoring job (default: the save's)")
    p = command("verify", "check a checkpoint's sizes and checksums")
    p.add_argument("id", help=_ID_HELP)
    p.add_argument("--tier", help="check only this tier")
    p = command("promote", "copy a checkpoint to a tier whatever its `every`")
    p.add_argument("id", help=_ID_HELP)
    p.add_argument("--to", required=True, metavar="TIER", help="the tier to copy it to")
    p.add_argument("--pin", action="store_true", help="pin it there (keep never evicts it)")
    p = command("export", "write a checkpoint as one consolidated file")
    p.add_argument("id", help=_ID_HELP)
    p.add_argument("--format", required=True, choices=("torch", "safetensors", "dcp"))
    p.add_argument("--out", required=True, metavar="PATH", help="the file to write")
    p = command("scrub", "verify every copy on every tier")
    p.add_argument("--repair", action="store_true",
                   help="replace a bad or incomplete copy from a good copy on another tier")
    p = command("wait", "finish the copies pending to slower tiers")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="give up after S seconds (exit 1)")
    command("gc", "remove leftovers of interrupted saves")
    for name in ("pin", "unpin"):
        command(name, f"{name} a checkpoint").add_argument("id", help=_ID_HELP)
    command("plugins", "list registered plugins", config="optional")
    command("demo", "run the demo job", config=None).add_argument(
        "rest", nargs=argparse.REMAINDER)
    p = command("bench", "run the benchmarks side by side and draw charts", config=None)
    p.add_argument("--out", required=True, metavar="DIR", help="where JSON and charts go")
    p.add_argument("--quick", action="store_true", help="fewer rounds, smaller state")
    p.set_defaults(fn=_bench)
    p = command("goodput", "goodput of a job from its [store] events_log", config=None)
    p.add_argument("events", help="the events log (JSON lines) the job's store appended to")
    p.add_argument("--out", required=True, metavar="DIR", help="where report.json and charts go")
    p.add_argument("--name", default="job", help="the job's name in the report and charts")
    p.set_defaults(fn=_goodput)
    p = command("simulate", "a real job under real failures, once per contender: goodput",
                config=None)
    p.add_argument("scenario", nargs="?", help="scenario TOML (default: the built-in one)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where report.json, the charts and each contender's files go")
    p.add_argument("--repeat", type=int, metavar="N",
                   help="rounds of every contender, interleaved; the report gives each one's "
                        "median round (default: the scenario's [supervisor] repeat, else 1)")
    p.set_defaults(fn=_simulate)
    return parser


def _bench(args: argparse.Namespace) -> int:
    from tierstore.cli.bench import run_bench

    return run_bench(args)


def _simulate(args: argparse.Namespace) -> int:
    from tierstore.cli.simulate import run_simulate

    return run_simulate(args)


def _goodput(args: argparse.Namespace) -> int:
    from tierstore.cli.goodput import run_goodput

    return run_goodput(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tierstore`` console script: the exit status (:class:`Exit`)."""
    args = _parser().parse_args(argv)
    try:
        _check_id(args)
        status = args.fn(args)
        # What is still buffered goes out here, where a reader that went away is caught.
        sys.stdout.flush()
        return int(status)
    except CheckpointNotFound as exc:  # the id named is not there: a usage error
        return _error(_not_found(exc, args), Exit.USAGE)
    except (ConfigError, PluginError, ValueError) as exc:
        return _error(exc, Exit.USAGE)
    except TierstoreError as exc:  # what it did failed (a copy, a check): "bad"
        return _error(exc, Exit.BAD)
    except KeyboardInterrupt:
        return _error("interrupted", Exit.INTERRUPTED)
    except BrokenPipeError:
        # The reader of stdout went away (`tierstore ls --json | head`): what it did not
        # read is not wanted. Point stdout at /dev/null so that the interpreter's own flush
        # at exit does not raise again, and end as a command SIGPIPE ended, without a word.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return int(Exit.PIPE_CLOSED)
    except Exception as exc:  # noqa: BLE001 - one line for the operator, never a traceback
        return _error(f"{type(exc).__name__}: {exc}", Exit.BAD)


def _check_id(args: argparse.Namespace) -> None:
    """Refuse an id that is not one before the store (and torch) is loaded: ValueError saying
    what an id is, or, for a Lightning checkpoint file name, which id it is stored under."""
    given = getattr(args, "id", None)
    if given is None:
        return
    from tierstore.format.ids import validate_checkpoint_id

    try:
        validate_checkpoint_id(given)
    except ValueError:
        from tierstore.cli.ids import looks_like_lightning_file

        if looks_like_lightning_file(given):
            raise ValueError(_lightning_hint(args)) from None
        raise


def _not_found(exc: CheckpointNotFound, args: argparse.Namespace) -> str:
    """The message for an id on no tier: the same from every command, pointing a shell user at
    ``tierstore ls`` (not at ``store.list()``); for a Lightning file name, the same answer as
    when it is no valid id (``last.ckpt`` is one, ``epoch=0-step=10.ckpt`` is not)."""
    from tierstore.cli.ids import looks_like_lightning_file

    given = getattr(args, "id", None)
    if given is not None and looks_like_lightning_file(given):
        return _lightning_hint(args)
    hint = f"`tierstore ls {_config_name(args)}` shows what is stored"
    message = str(exc)
    return message.replace(LIST_HINT, hint) if LIST_HINT in message else f"{message}; {hint}"


def _lightning_hint(args: argparse.Namespace) -> str:
    """What ``args.id``, a Lightning file name, is stored as (see :mod:`tierstore.cli.ids`)."""
    from tierstore.cli.commands import stored_ids
    from tierstore.cli.ids import lightning_hint

    try:
        stored = stored_ids(args)
    except Exception:  # noqa: BLE001 - a hint must not hide the error it explains
        stored = []
    return lightning_hint(args.id, stored, _config_name(args), args.command)


def _config_name(args: argparse.Namespace) -> str:
    return getattr(args, "config", None) or "tiers.toml"


def _error(message: object, status: Exit) -> int:
    print(f"tierstore: error: {message}", file=sys.stderr)
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
