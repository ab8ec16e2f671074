"""``every = "auto"`` against fixed intervals, at three failure rates, in the failure simulator.

For each failure rate (a job of 40 steps of 0.25 s, 2 nodes x 1 rank, a 128 MiB state, killed
once, 3 times or 7 times by ``kill-rank``), ``tierstore simulate`` runs tierstore with one RAM
tier at ``every`` = 1, 2, 4 and 8 and at ``every = "auto"`` (``mtbf_hours`` set to the rate:
the job's compute time over its failures), each through the same failures. The report is each
contender's goodput, the best fixed interval's, and auto's against it (the target: within 5 %),
with the interval auto ended with; and, beside it, the part of the badput an interval moves
(checkpoint stall plus lost progress, the two terms Young/Daly trades), since on a job this
short the restarts (a new torchrun, Python and ``import torch`` each, a few seconds that move
by one or two between runs) are most of the wall time and most of its noise.

    .venv/bin/python benchmarks/auto_interval.py                 # ~12 min on 2 cores
    .venv/bin/python benchmarks/auto_interval.py --json /tmp/auto.json --out /tmp/auto
    .venv/bin/python benchmarks/auto_interval.py --repeat 3   # medians of 3 rounds (~36 min)
    .venv/bin/python benchmarks/auto_interval.py --rates 3 --repeat 3   # one rate only

Needs nothing beyond ``make test``'s set-up (no object store).
"""

from __future__ import annotations

import json
import sys
import time
import tomllib
from contextlib import nullcontext
from pathlib import Path

from tierstore_simulate.run import run
from tierstore_simulate.scenario import parse_scenario

from harness import parser, print_table, scratch

STEPS, STEP_S = 40, 0.25
FIXED = (1, 2, 4, 8)
#: the failure rates: the steps at which a rank is killed
RATES = {"1 failure": (20,), "3 failures": (10, 20, 30),
         "7 failures": (5, 10, 15, 20, 25, 30, 35)}
TARGET = 0.95


def scenario_toml(kills: tuple[int, ...], repeat: int = 1) -> str:
    """The scenario of one failure rate: the job, its kills, the fixed and auto contenders,
    ``repeat`` interleaved rounds."""
    mtbf_hours = STEPS * STEP_S / len(kills) / 3600
    lines = [f"[job]\nsteps = {STEPS}\nstep_s = {STEP_S}\nstate_mib = 128\nnodes = 2\n"
             f"ranks_per_node = 1\ncollective_timeout_s = 10\n",
             f"[supervisor]\nrestart_delay_s = 0.5\ntimeout_s = 900\nrepeat = {repeat}\n"]
    for step in kills:
        lines.append(f'[[failure]]\nkind = "kill-rank"\nat_step = {step}\nrank = 1\n')
    for every in FIXED:
        lines.append(f'[[contender]]\nname = "every {every}"\nkind = "tierstore"\n'
                     f'emergency = false\n'
                     f'tiers = [{{ name = "ram", backend = "memory", every = {every}, '
                     f'keep = 2 }}]\n')
    lines.append(f'[[contender]]\nname = "auto"\nkind = "tierstore"\nemergency = false\n'
                 f'mtbf_hours = {mtbf_hours:.8f}\n'
                 f'tiers = [{{ name = "ram", backend = "memory", every = "auto", keep = 2 }}]\n')
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--out", default=None, help="keep the simulations here (default: a temp dir)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="rounds per rate, interleaved; each contender's median round counts "
                        "(the restarts' noise shrinks; the run takes N times as long)")
    p.add_argument("--rates", default=",".join(str(len(k)) for k in RATES.values()),
                   help="failure counts to run, comma-separated (default: all, "
                        + ",".join(str(len(k)) for k in RATES.values()) + ")")
    args = p.parse_args(argv)
    wanted = {int(n) for n in args.rates.split(",")}
    unknown = wanted - {len(k) for k in RATES.values()}
    if unknown:
        p.error(f"no failure rate with {sorted(unknown)} failures; the rates: "
                + ", ".join(RATES))
    began = time.time()
    results = []
    with nullcontext(args.out) if args.out else scratch("auto-interval-") as where:
        out = Path(where)
        for rate, kills in ((r, k) for r, k in RATES.items() if len(k) in wanted):
            scenario = parse_scenario(tomllib.loads(scenario_toml(kills, args.repeat)),
                                      f"rate {rate}")
            report = run(scenario, out / rate.replace(" ", "-"),
                         progress=lambda line: print(line, flush=True)
                         if line.startswith("contender") else None)
            by_name = {c["name"]: c for c in report["contenders"]}
            bad = [n for n, c in by_name.items() if c.get("final_state") != "ok"]
            if bad:
                print(f"{rate}: final state bad for {bad}", file=sys.stderr)
                return 1
            fixed = {n: by_name[n]["goodput"] for n in by_name if n != "auto"}
            best = max(fixed, key=fixed.get)
            auto = by_name["auto"]
            moved = {n: c["badput"]["checkpoint_stall_s"] + c["badput"]["lost_progress_s"]
                     for n, c in by_name.items()}
            least = min((n for n in moved if n != "auto"), key=moved.get)
            results.append({"rate": rate, "failures": len(kills),
                            "stall_plus_lost_s": moved, "least_stall_plus_lost": least,
                            "mtbf_s": STEPS * STEP_S / len(kills),
                            "goodput": {n: c["goodput"] for n, c in by_name.items()},
                            "best_fixed": best, "auto_vs_best": auto["goodput"] / fixed[best],
                            "auto_every": auto.get("intervals", {}).get("ram"),
                            "rounds": {n: [r["goodput"] for r in c.get("rounds", [])]
                                       for n, c in by_name.items()}})
    rounds = f" (each the median of {args.repeat} rounds)" if args.repeat > 1 else ""
    print(f"\nGoodput{rounds}, and in brackets stall + lost progress in seconds:\n")
    rows = []
    for r in results:
        moved = r["stall_plus_lost_s"]
        rows.append([r["failures"],
                     *(f"{r['goodput'][f'every {e}']:.1%} ({moved[f'every {e}']:.1f})"
                       for e in FIXED),
                     f"{r['goodput']['auto']:.1%} ({moved['auto']:.1f}; every "
                     f"{r['auto_every']})", f"**{r['auto_vs_best']:.2f}x** {r['best_fixed']}"])
    print_table(["failures", *(f"every {e}" for e in FIXED), "auto (ended with every)",
                 "auto / best fixed"], rows)
    verdicts = [r["auto_vs_best"] >= TARGET for r in results]
    for r, ok in zip(results, verdicts):
        print(f"{'PASS' if ok else 'MISS'}: {r['rate']}: auto within 5 % of the best fixed "
              f"interval ({r['best_fixed']}): {r['auto_vs_best']:.3f}x")
    print(f"(total run time {time.time() - began:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "steps": STEPS,
                                               "step_s": STEP_S}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
