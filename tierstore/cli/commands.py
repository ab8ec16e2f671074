"""The commands of ``tierstore``: each opens the store of a TOML file, calls one ``Store`` method
(the same a program would call) and prints its answer, as text or, with ``--json``, as the one
JSON document the README documents. Each returns its exit status
(:class:`~tierstore.cli.exits.Exit`: done, what it checked is bad, a tier did not answer); the
usage and config errors are raised and printed by :func:`tierstore.cli.main`."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
import warnings
from typing import Any, Callable, Iterator

from tierstore.cli.exits import Exit
from tierstore.cli.progress import ProgressBars
from tierstore.config.validate import load_config
from tierstore.errors import CheckpointNotFound, ConfigError
from tierstore.plugin.host import KINDS, build_plugin_host

__all__ = ["COMMANDS", "stored_ids"]


@contextlib.contextmanager
def _store(args: argparse.Namespace, bars: ProgressBars | None = None, *,
           read_only: bool = False) -> Iterator[Any]:
    """The store of ``args.config``. ``read_only`` for the commands that only look: they run
    beside a live job, so they must neither resume its drains (racing the job's own copy of
    the same checkpoint, and waiting for it at close) nor write anything to a tier; only the
    commands that act (``wait``, ``gc``, ``promote``, ``scrub --repair``, ``pin``) may."""
    from tierstore.store import open as open_store

    # A tier that does not answer is reported (status says so), never fatal for the others.
    with open_store(args.config, plugins=[bars] if bars is not None else [],
                    tolerate_unreachable=True, read_only=read_only) as store:
        yield store


def stored_ids(args: argparse.Namespace) -> list[str]:
    """The ids of the checkpoints the store of ``args.config`` holds (read-only), newest
    first: what an id that names none is compared with."""
    with _store(args, read_only=True) as store:
        return [info.id for info in store.list()]


def _bars(args: argparse.Namespace) -> ProgressBars:
    """Bars on stderr when it is a terminal, never under ``--json``."""
    return ProgressBars(enabled=False if args.json else None)


@contextlib.contextmanager
def _bar_for(bars: ProgressBars, store: Any, checkpoint_id: str, label: str,
             copies: Callable[[Any], int] = lambda info: 1) -> Iterator[None]:
    """A bar over ``copies(info)`` copies of ``checkpoint_id`` (its bytes and files as
    ``list()`` gives them) while the block runs; none when it is not listed."""
    info = next((i for i in store.list() if i.id == checkpoint_id), None)
    if info is not None:
        n = copies(info)
        bars.start(label, info.size_bytes * n, info.files * n)
    try:
        yield
    finally:
        bars.finish()


def _emit(args: argparse.Namespace, document: Any, text: str) -> None:
    if args.json:
        json.dump(document, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif text:
        print(text)


def _count(n: int, noun: str) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
             for r in [header, *rows]]
    return "\n".join(lines)


# -- the commands -----------------------------------------------------------------------------

def cmd_ls(args: argparse.Namespace) -> int:
    """Checkpoints, newest first, and the tiers holding them (:attr:`Exit.TIER_DOWN` when a
    tier is unreachable: the listing lacks what it holds)."""
    with _store(args, read_only=True) as store:
        infos = store.list()
        # (status() asks what list() asked; a tier that did not answer is marked down by then)
        down = {t.name: t.problem for t in store.status().tiers if not t.reachable}
    rows = [[i.id, _size(i.size_bytes), _when(i.committed), "yes" if i.pinned else "",
             ", ".join(i.tiers)] for i in infos]
    _emit(args, [i.to_json() for i in infos],
          _table(["id", "size", "committed", "pinned", "tiers"], rows) if infos
          else "no checkpoints")
    for name, why in sorted(down.items()):
        print(f"tierstore: tier '{name}' is unreachable, so what it holds is not listed: {why}",
              file=sys.stderr)
    return Exit.TIER_DOWN if down else Exit.OK


def cmd_status(args: argparse.Namespace) -> int:
    """Per tier: reachable, newest, age, steps behind, bytes, free space; pending copies
    (:attr:`Exit.TIER_DOWN` when a tier is unreachable)."""
    with _store(args, read_only=True) as store:
        status = store.status()
    rows = [[t.name, "yes" if t.reachable else "NO", t.newest or "-", _age(t.newest_age_s),
             "-" if t.steps_behind is None else str(t.steps_behind), str(t.checkpoints),
             _size(t.bytes), _size(t.free_bytes)] for t in status.tiers]
    text = _table(["tier", "reachable", "newest", "age", "behind", "ckpts", "bytes", "free"],
                  rows)
    for t in status.tiers:
        if not t.reachable:
            text += f"\ntier '{t.name}' is unreachable: {t.problem}"
    text += ("\npending copies: " + ", ".join(f"{c} -> {t}" for c, t in status.pending)
             if status.pending else "\nno pending copies")
    _emit(args, status.to_json(), text)
    down = [t.name for t in status.tiers if not t.reachable]
    if down:  # monitoring that runs `status` must see it, apart from a bad checkpoint
        print(f"tierstore: {_count(len(down), 'tier')} unreachable: {', '.join(down)}",
              file=sys.stderr)
        return Exit.TIER_DOWN
    return Exit.OK


def cmd_inspect(args: argparse.Namespace) -> int:
    """Manifest, files per rank, tensors, and where each copy is."""
    with _store(args, read_only=True) as store:
        report = store.inspect(args.id)
    lines = [f"{report.checkpoint_id}: step {report.step if report.step is not None else '-'}, "
             f"world size {report.world_size}, {_size(report.size_bytes)}, committed "
             f"{_when(report.committed)}{', pinned' if report.pinned else ''}"
             f"{', codecs ' + ', '.join(report.codecs) if report.codecs else ''}",
             f"complete on: {', '.join(report.tiers)}", "",
             _table(["file", "rank", "size"],
                    [[f.name, "-" if f.rank is None else str(f.rank), _size(f.size)]
                     for f in report.files]), "",
             _table(["tensor", "shape", "dtype", "bytes"],
                    [[t.fqn, "x".join(map(str, t.shape)) or "()", t.dtype, _size(t.bytes)]
                     for t in report.tensors])]
    if report.objects:
        lines += ["", "other values: " + ", ".join(report.objects)]
    _emit(args, report.to_json(), "\n".join(lines))
    return Exit.OK


def cmd_plan(args: argparse.Namespace) -> int:
    """Where a restore at a given shape would read each file from (1 when some file is
    nowhere)."""
    for name in ("world_size", "ranks_per_node"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} is {value}; it must be at least 1")
    with _store(args, read_only=True) as store:
        plan = store.plan(args.id, args.world_size, args.ranks_per_node)
    total = plan.total_bytes or 1
    lines = [f"{plan.checkpoint_id} (saved by {_count(plan.saved_world_size, 'rank')}) "
             f"restored by {_count(plan.world_size, 'rank')}, {plan.ranks_per_node} per node:",
             _table(["source", "bytes", "share"],
                    [[s["tier"], _size(s["bytes"]), f"{100 * s['bytes'] / total:.1f}%"]
                     for s in plan.sources]),
             f"from slower tiers: {_size(plan.from_slow_tiers_bytes)} "
             f"({100 * plan.from_slow_tiers_bytes / total:.1f}%)"]
    if plan.missing:
        lines.append(f"on no tier of any node of that job: {', '.join(plan.missing)}: "
                     f"the restore would fail")
    _emit(args, plan.to_json(), "\n".join(lines))
    return Exit.BAD if plan.missing else Exit.OK


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-read one checkpoint and check sizes and checksums (1 when bad)."""
    bars = _bars(args)
    with _store(args, bars, read_only=True) as store:
        try:
            with _bar_for(bars, store, args.id, f"verify {args.id}",
                          lambda info: 1 if args.tier else len(info.tiers)):
                report = store.verify(args.id, tier=args.tier)
        except CheckpointNotFound:
            if args.json:  # the one JSON document stdout promises, then the usage error
                _emit(args, {"id": args.id, "ok": False, "problems": [
                    {"tier": None, "file": None, "problem": "on no tier"}]}, "")
            raise
    _emit(args, report.to_json(), str(report))
    return Exit.OK if report.ok else Exit.BAD


def cmd_promote(args: argparse.Namespace) -> int:
    """Copy a complete checkpoint to a tier whatever its ``every``."""
    bars = _bars(args)
    with _store(args, bars) as store, \
            _bar_for(bars, store, args.id, f"promote {args.id} -> {args.to}"):
        result = store.promote(args.id, args.to, pin=args.pin)
    text = (f"{result.checkpoint_id} is already complete on '{result.tier}'"
            if result.source == result.tier else
            f"promoted {result.checkpoint_id} to '{result.tier}' from '{result.source}' "
            f"({_size(result.bytes)} in {result.seconds:.2f} s)")
    _emit(args, result.to_json(), text + (", pinned there" if result.pinned else ""))
    return Exit.OK


def cmd_export(args: argparse.Namespace) -> int:
    """One consolidated file from the fastest good copy."""
    bars = _bars(args)
    with _store(args, bars, read_only=True) as store, \
            _bar_for(bars, store, args.id, f"export {args.id}"), \
            warnings.catch_warnings():
        # DCP warns that a load without torch.distributed runs in one process: it does.
        warnings.simplefilter("ignore", UserWarning)
        result = store.export(args.id, args.format, args.out)
    text = (f"exported {result.checkpoint_id} to {result.path} ({args.format}: "
            f"{_count(result.tensors, 'tensor')}, {_size(result.bytes)})")
    if result.skipped:
        text += f"\nleft out (not tensors): {', '.join(result.skipped)}"
    _emit(args, result.to_json(), text)
    return Exit.OK


def cmd_scrub(args: argparse.Namespace) -> int:
    """Verify every copy on every tier; ``--repair`` replaces bad copies from good ones."""
    bars = _bars(args)
    with _store(args, bars, read_only=not args.repair) as store:
        infos = store.list()
        bars.start("scrub", sum(i.size_bytes * len(i.tiers) for i in infos),
                   sum(i.files * len(i.tiers) for i in infos))
        try:
            report = store.scrub(repair=args.repair)
        finally:
            bars.finish()
    lines = [f"checked {report.checked} cop{'y' if report.checked == 1 else 'ies'}: "
             + ("all good" if not report.bad else _count(len(report.bad), "problem"))]
    lines += [f"bad: tier '{p.tier}': {p.checkpoint_id}/{p.file or ''}: {p.what}"
              for p in report.bad]
    lines += [f"repaired: {r.checkpoint_id} on '{r.tier}' from '{r.source}' "
              f"({', '.join(r.files)})" for r in report.repaired]
    lines += [f"still bad: tier '{p.tier}': {p.checkpoint_id}/{p.file or ''}: {p.what}"
              for p in report.unrepaired if args.repair]
    if report.bad and not args.repair:
        lines.append("run `tierstore scrub --repair` to replace the bad copies from good ones")
    _emit(args, report.to_json(), "\n".join(lines))
    return Exit.OK if report.ok else Exit.BAD


def cmd_wait(args: argparse.Namespace) -> int:
    """Finish the copies pending to slower tiers (those a crash or an early exit left)."""
    bars = _bars(args)
    started = time.perf_counter()
    with _store(args, bars) as store:
        pending = store.pending()
        sizes = {i.id: i for i in store.list()}
        bars.start("wait", sum(sizes[c.checkpoint_id].size_bytes for c in pending
                               if c.checkpoint_id in sizes),
                   sum(sizes[c.checkpoint_id].files for c in pending if c.checkpoint_id in sizes))
        try:
            store.wait(timeout=args.timeout)
        finally:
            bars.finish()
    copies = [{"checkpoint_id": c.checkpoint_id, "tier": c.tier} for c in pending]
    _emit(args, {"copied": copies, "seconds": time.perf_counter() - started},
          "\n".join(f"copied {c.checkpoint_id} -> {c.tier}" for c in pending)
          or "no pending copies")
    return Exit.OK


def cmd_gc(args: argparse.Namespace) -> int:
    """Remove what interrupted saves left behind."""
    with _store(args) as store:
        removed = store.gc()
    _emit(args, {"removed": removed},
          "\n".join(f"removed {r}" for r in removed) or "nothing to remove")
    return Exit.OK


def cmd_pin(args: argparse.Namespace) -> int:
    """Protect a checkpoint from ``keep`` (``unpin``: release it)."""
    with _store(args) as store:
        (store.pin if args.command == "pin" else store.unpin)(args.id)
    _emit(args, {"id": args.id, "pinned": args.command == "pin"}, f"{args.command}ned {args.id}")
    return Exit.OK


def cmd_plugins(args: argparse.Namespace) -> int:
    """Registered plugins by kind, with their origin."""
    # The config's plugins too ([store] plugins), without opening the store: nothing is built
    # or written, so this works for a config whose tiers are not reachable from here.
    host = load_config(args.config)[1] if args.config else build_plugin_host()
    found = {kind: [(name, host.lookup(kind, name)) for name in host.names(kind)]
             for kind in KINDS}
    lines = []
    for kind, regs in found.items():
        lines.append(f"{kind}:")
        lines += [f"    {name:<12} {reg.plugin} ({reg.origin})" for name, reg in regs]
    _emit(args, {kind: [{"name": name, "plugin": reg.plugin, "origin": reg.origin}
                        for name, reg in regs] for kind, regs in found.items()},
          "\n".join(lines))
    return Exit.OK


def cmd_demo(args: argparse.Namespace) -> int:
    """The demo job (what ``make demo`` runs)."""
    from tierstore.demo import main as demo_main

    if not args.json:
        demo_main(args.rest)
        return Exit.OK
    with contextlib.redirect_stdout(sys.stderr):  # only the JSON document on stdout
        demo_main(args.rest)
    _emit(args, {"demo": "finished"}, "")
    return Exit.OK


#: name -> (function, help, arguments after CONFIG)
COMMANDS = {
    "ls": cmd_ls, "status": cmd_status, "inspect": cmd_inspect, "plan": cmd_plan,
    "verify": cmd_verify,
    "promote": cmd_promote, "export": cmd_export, "scrub": cmd_scrub, "wait": cmd_wait,
    "gc": cmd_gc, "pin": cmd_pin, "unpin": cmd_pin, "plugins": cmd_plugins, "demo": cmd_demo,
}
