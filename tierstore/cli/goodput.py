"""``tierstore goodput EVENTS.jsonl --out DIR``: the goodput of a live job, from the events its
store appended to ``[store] events_log`` over all its runs (tierstore_simulate.goodput): DIR gets
``report.json`` and the two charts, stdout a summary (or, with --json, the report)."""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["run_goodput"]


def run_goodput(args: argparse.Namespace) -> int:
    """Account the events log ``args.events`` into ``args.out``; 0, or 2 when the log has
    nothing to account."""
    # The simulator's package is a layer above the store: only this command imports it.
    from tierstore_simulate.goodput import account, read_events, report_json, summary_table
    from tierstore_simulate.plots import draw_all

    try:
        events = read_events(args.events)
    except FileNotFoundError:
        raise ValueError(f"no events log at {args.events}: set [store] events_log in the job's "
                         f"TOML to the path it should append to, then run the job") from None
    report = account(events, name=args.name)
    os.makedirs(args.out, exist_ok=True)
    document = report_json([report], {"events_log": os.path.abspath(args.events)})
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(document, f, indent=2)
    charts = draw_all([report], args.out)
    if args.json:
        json.dump(document, sys.stdout, indent=2)
        print()
    else:
        print(summary_table([report]))
        print(f"report: {os.path.join(args.out, 'report.json')}; charts: "
              f"{', '.join(str(c) for c in charts)}")
    return 0
