"""``tierstore simulate [SCENARIO.toml] --out DIR``: a real training job under real failures
(a killed or hung rank, a lost node, a preemption, an object-store outage), restarted after
each, once per contender (stock DCP, tierstore; ``--repeat N`` rounds, interleaved, reporting
each contender's median round), and its goodput: DIR gets ``report.json``,
``timeline.png``, ``goodput.png`` and a work directory per contender; stdout a line per event
and a summary (with --json: progress on stderr, the report on stdout)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

__all__ = ["run_simulate"]


def run_simulate(args: argparse.Namespace) -> int:
    """Run the scenario ``args.scenario`` (None: the built-in one) into ``args.out``; 0 when
    every contender's job ended with the right state, 1 when one did not, 2 on a bad
    scenario."""
    # The simulator's package is a layer above the store: only this command imports it.
    from tierstore_simulate.run import run
    from tierstore_simulate.scenario import ScenarioError, load_scenario

    as_json = getattr(args, "json", False)
    try:
        scenario = load_scenario(args.scenario)
        repeat = getattr(args, "repeat", None)
        if repeat is not None:
            if repeat < 1:
                raise ScenarioError(f"--repeat is {repeat}; it must be at least 1")
            scenario = dataclasses.replace(
                scenario, supervisor=dataclasses.replace(scenario.supervisor, repeat=repeat))
        report = run(scenario, args.out, progress=_printer(as_json))
    except ScenarioError as exc:
        print(f"tierstore: error: {exc}", file=sys.stderr)
        return 2
    if as_json:
        json.dump(report, sys.stdout, indent=2)
        print()
    return 0 if all(c.get("final_state") == "ok" for c in report["contenders"]) else 1


def _printer(as_json: bool):
    """Progress lines go to stdout, or to stderr where stdout carries the JSON report."""
    stream = sys.stderr if as_json else sys.stdout

    def say(line: str) -> None:
        print(line, file=stream, flush=True)

    return say
