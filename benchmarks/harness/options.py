"""The command line every benchmark shares: its description (the first paragraph of the
script's docstring), the state dict's size, rounds and warm-up, where its files go, the report's
outputs (``--json``, ``--strict``, ``--quiet``), ``--quick`` and ``--cuda``; and the progress
lines on stderr."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Callable


def parser(doc: str) -> argparse.ArgumentParser:
    """An empty parser described by ``doc``'s first paragraph (the script's docstring), which
    keeps the line breaks of the rest where ``--help`` shows it."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_output_args(p: argparse.ArgumentParser, *, strict: bool = True,
                    quiet: str = "no per-round progress lines") -> None:
    """``--json PATH`` (the figures, with the configuration and the machine), ``--strict``
    (exit 1 when a target is missed; not for a benchmark without targets) and ``--quiet``
    (``quiet``: what it silences)."""
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    if strict:
        p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--quiet", action="store_true", help=quiet)


def benchmark_parser(doc: str, repeat: int, warmup_costs: str,
                     dir_help: str, *, size_mib: int | None = 1024, tensors: int | None = 64,
                     per_rank: bool = False, warmup: int = 1) -> argparse.ArgumentParser:
    """The options of a benchmark that times rounds of contenders; each adds its own after.
    ``size_mib`` and ``tensors``: this benchmark's default state (``per_rank``: each rank's;
    None: no such option); ``warmup_costs``: what the untimed rounds absorb."""
    p = parser(doc)
    whose = " per rank" if per_rank else ""
    if size_mib is not None:
        p.add_argument("--size-mib", type=int, default=size_mib,
                       help=f"state dict size{whose} (default {size_mib})")
    if tensors is not None:
        p.add_argument("--tensors", type=int, default=tensors,
                       help=f"number of tensors{whose} (default {tensors})")
    p.add_argument("--repeat", type=int, default=repeat, help=f"timed rounds (default {repeat})")
    p.add_argument("--warmup", type=int, default=warmup,
                   help=f"untimed rounds first (default {warmup}): first-call costs "
                        f"({warmup_costs}) would otherwise land on round 1")
    p.add_argument("--dir", default=None, help=dir_help)
    p.add_argument("--io-threads", type=int, default=None,
                   help="tierstore [store] io_threads (default: tierstore's own default)")
    add_output_args(p)
    return p


def parse_rounds(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; ``--repeat`` must be at least 1 and ``--warmup`` at least 0."""
    args = p.parse_args(argv)
    if args.repeat < 1 or args.warmup < 0:
        p.error("--repeat must be at least 1 and --warmup at least 0")
    return args


def parse_quick(p: argparse.ArgumentParser, argv: list[str] | None, what: str,
                **quick: object) -> argparse.Namespace:
    """Parse ``argv`` with a ``--quick`` flag (``what``: what it runs) that swaps in the
    defaults ``quick``; options given beside it still count."""
    p.add_argument("--quick", action="store_true",
                   help=f"{what}; options given beside it still count")
    args = p.parse_args(argv)
    if args.quick:  # new defaults, parsed again: what the command line says still wins
        p.set_defaults(**quick)
        args = p.parse_args(argv)
    return args


def parse_with_cuda(p: argparse.ArgumentParser, argv: list[str] | None,
                    help: str) -> argparse.Namespace:
    """Parse ``argv`` with a ``--cuda`` flag (``help`` says what it changes), refused where
    torch sees no CUDA device."""
    import torch

    p.add_argument("--cuda", action="store_true", help=help)
    args = p.parse_args(argv)
    if args.cuda and not torch.cuda.is_available():
        p.error("--cuda needs CUDA, and torch.cuda.is_available() is False here")
    return args


def progress_log(quiet: bool) -> Callable[[str], None]:
    """Per-round progress lines on stderr (none with ``--quiet``); also silences the warning DCP
    gives on every call without a process group (these benchmarks mean to do that)."""
    warnings.filterwarnings("ignore", module=r"torch\.distributed\..*")
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")
    return (lambda _m: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))
