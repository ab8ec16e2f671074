"""The ``tierstore`` command: look at and maintain a store from the shell.

    tierstore ls tiers.toml              checkpoints, newest first, and the tiers holding them
    tierstore verify tiers.toml step-100 re-read and check sizes and checksums (exit 1 if bad)
    tierstore gc tiers.toml              remove what interrupted saves left behind
    tierstore pin|unpin tiers.toml ID    protect a checkpoint from `keep`, or release it
    tierstore plugins [tiers.toml]       registered plugins by kind, with their origin
    tierstore demo                       the demo job (what `make demo` runs)
"""

from __future__ import annotations

import argparse
import datetime
import sys

from tierstore.version import __version__
from tierstore.errors import CheckpointNotFound, TierstoreError
from tierstore.config.validate import load_config
from tierstore.plugin.host import KINDS, build_plugin_host

__all__ = ["main"]


def _open(config: str):
    from tierstore.store import open as open_store

    return open_store(config)


def cmd_ls(args: argparse.Namespace) -> int:
    with _open(args.config) as store:
        infos = store.list()
        if not infos:
            print("no checkpoints")
            return 0
        print(f"{'id':<24} {'size':>10}  {'committed':<19}  {'pinned':<6}  tiers")
        for info in infos:
            when = datetime.datetime.fromtimestamp(info.committed).strftime("%Y-%m-%d %H:%M:%S")
            print(f"{info.id:<24} {info.size_bytes / 1e6:>8.1f}MB  {when}  "
                  f"{'yes' if info.pinned else '':<6}  {', '.join(info.tiers)}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    with _open(args.config) as store:
        try:
            report = store.verify(args.id, tier=args.tier)
        except CheckpointNotFound as exc:  # what it checked is missing: "bad", not a usage error
            print(f"tierstore: {exc}", file=sys.stderr)
            return 1
    print(report)
    return 0 if report.ok else 1


def cmd_gc(args: argparse.Namespace) -> int:
    with _open(args.config) as store:
        removed = store.gc()
    print("\n".join(f"removed {r}" for r in removed) or "nothing to remove")
    return 0


def cmd_pin(args: argparse.Namespace) -> int:
    with _open(args.config) as store:
        (store.pin if args.command == "pin" else store.unpin)(args.id)
    print(f"{args.command}ned {args.id}")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    # The config's plugins too ([store] plugins), without opening the store: nothing is built
    # or written, so this works for a config whose tiers are not reachable from here.
    host = load_config(args.config)[1] if args.config else build_plugin_host()
    for kind in KINDS:
        print(f"{kind}:")
        for name in host.names(kind):
            reg = host.lookup(kind, name)
            print(f"    {name:<12} {reg.plugin} ({reg.origin})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from tierstore.demo import main as demo_main

    demo_main(args.rest)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tierstore`` console script."""
    parser = argparse.ArgumentParser(prog="tierstore", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tierstore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", help="list checkpoints")
    p.add_argument("config")
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser("verify", help="check a checkpoint's sizes and checksums")
    p.add_argument("config")
    p.add_argument("id")
    p.add_argument("--tier", help="check only this tier")
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("gc", help="remove leftovers of interrupted saves")
    p.add_argument("config")
    p.set_defaults(fn=cmd_gc)
    for name in ("pin", "unpin"):
        p = sub.add_parser(name, help=f"{name} a checkpoint")
        p.add_argument("config")
        p.add_argument("id")
        p.set_defaults(fn=cmd_pin)
    p = sub.add_parser("plugins", help="list registered plugins")
    p.add_argument("config", nargs="?")
    p.set_defaults(fn=cmd_plugins)
    p = sub.add_parser("demo", help="run the demo job")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_demo)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (TierstoreError, ValueError) as exc:
        print(f"tierstore: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
