"""The ``cotenant`` kind: a second user plants entries under the tier roots while a job runs.

The job of a seed opens a store of three tiers under a per-trial directory, each with ``keep =
1``: ``mem`` (``memory``), ``local`` (``local``; on odd seeds node-local, ``{node}`` in its
path) and ``fs`` (``fsspec``, a ``file://`` URL); it saves 3 to 5 checkpoints (waiting for the
drains after each save on most seeds), collects garbage, loads what ``list()`` shows and
verifies the newest. At every phase tierstore announces (``tierstore_phase``) and between the
job's steps, the seed decides whether the *attacker* (tests/faults/cotenant_attacker.py, a
process of its own, whose entries belong to ``nobody``) acts there and what it does: a
foreign, world-writable directory where a save will go, with links inside; a checkpoint
directory, a staging-like name or a future checkpoint replaced by a link to another tier's
checkpoint or root or to the *victim* (a tree beside the tier roots); a file of a checkpoint
replaced by a symlink or a hard link to a victim file; a directory made world-writable. Before
the store opens, on some seeds, a tier's root is already a link (to the victim, to another
tier's root), a foreign world-writable directory, or the node directory is a link; on half of
those seeds (as root, with ``setpriv``) the user nobody itself makes them, in the
world-writable parent of the roots.

A fresh process then checks (the invariants):

1. nothing outside the tier roots changed: the victim tree is as it was (no entry deleted,
   changed or added), and every checkpoint of another tier that a link pointed at is as it was
   when it was linked, or gone only because its own tier evicted or collected it;
2. no tier lost the checkpoint it keeps (its newest committed, ``keep = 1``) unless the attacker
   replaced that very checkpoint;
3. each tier's kept checkpoint, from that tier alone, and ``latest()``, through the store,
   load bitwise equal to what was saved, or fail with a ``TierstoreError``; ``open``,
   ``list()`` and ``latest()`` raise nothing else;
4. every step of the job failed, if it did, with a ``TierstoreError``; neither the job nor the
   check died of a signal or hung.

A trial is ``cotenant/VARIANT:cotenant:1:SEED`` (``cotenant/node:cotenant:1:195003``); the seed
draws the job and every attack, so a trial runs again alone, the same, with ``--trial``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import tierstore

from .hostile import (FAILURES, EventLog, clear_error, describe, make_victim, outcome,
                      snapshot_tree, tree_changes, try_load)
from .plan import Trial
from .procs import run_child

__all__ = ["COTENANT_FAULT", "params", "plan_cotenant", "row_of", "run_cotenant_trial"]

ATTACKER = Path(__file__).resolve().parent / "cotenant_attacker.py"
COTENANT_FAULT = "cotenant"
#: The chance that the attacker acts at one announced phase, and between two steps of the job.
AT_PHASE, AT_STEP = 0.3, 0.7
#: Seconds one forked step (the job, the check) may take before it counts as hung.
TIMEOUT = 120.0
TIERS = ("mem", "local", "fs")
#: How to run a command as the user nobody (uid and gid 65534): as root, with setpriv; empty
#: otherwise (the attacker's entries are then the job's own user's).
NOBODY_PREFIX = (("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
                 if os.geteuid() == 0 and shutil.which("setpriv") else ())


def params(seed: int) -> dict[str, Any]:
    """Everything the job of ``seed`` takes from it (the attacks are drawn as it goes)."""
    from .cotenant_attacker import PRE_ACTIONS

    rng = random.Random(f"cotenant-{seed}")
    node = seed % 2 == 1
    pre = rng.choice([None, None, None, *[a for a in PRE_ACTIONS
                                          if node or a != "pre-node-link"]])
    return {"node": node, "saves": rng.randint(3, 5), "wait_each": rng.random() < 0.75,
            "pre": pre, "pre_as_nobody": rng.random() < 0.5}


def row_of(seed: int) -> str:
    p = params(seed)
    return f"cotenant/{'node' if p['node'] else 'plain'}{'-pre' if p['pre'] else ''}"


def describe_job(seed: int) -> str:
    p = params(seed)
    return (f"mem(memory) -> local(local{', {node}' if p['node'] else ''}) -> fs(file://), keep 1 "
            f"each; {p['saves']} saves{', wait after each' if p['wait_each'] else ''}, gc, loads, "
            f"verify; a cotenant acts at {AT_PHASE:.0%} of the phases and {AT_STEP:.0%} of the "
            f"steps" + (f"; before open: {p['pre']} (as "
                        f"{'nobody' if p['pre_as_nobody'] else 'root, then chown'})"
                        if p["pre"] else ""))


def plan_cotenant(count: int, seed: int) -> list[Trial]:
    """``count`` trials on consecutive seeds drawn from ``seed``."""
    base = seed * 100_000 + 95_000
    return [Trial(row_of(s), COTENANT_FAULT, 1, s) for s in range(base, base + count)]


def layout(base: str, seed: int) -> dict[str, Any]:
    """The trial's places: the tier roots (where their checkpoints are), the config, the
    victim, and the files the job leaves for the checker."""
    p = params(seed)
    shared = os.path.join(base, "shared")
    local = os.path.join(shared, "local", "{node}") if p["node"] else os.path.join(shared, "local")
    config = {"tier": [
        {"name": "mem", "backend": "memory", "path": os.path.join(shared, "mem"), "keep": 1},
        {"name": "local", "backend": "local", "path": local, "keep": 1},
        {"name": "fs", "backend": "fsspec", "url": "file://" + os.path.join(shared, "fs"),
         "keep": 1}]}
    roots = {"mem": os.path.join(shared, "mem"), "local": local.replace("{node}", "0"),
             "fs": os.path.join(shared, "fs")}
    return {"shared": shared, "config": config, "roots": roots, "victim":
            os.path.join(base, "victim"), "events": os.path.join(base, "events.jsonl"),
            "attacks": os.path.join(base, "attacks.jsonl"), "log": os.path.join(base, "log"),
            "node_root": roots["local"] if p["node"] else None}


class Attacker:
    """The job's side of the attacker process: asks it to act at a point, records what it did
    (and a snapshot of every other tier's checkpoint it pointed a link at)."""

    def __init__(self, seed: int, places: dict[str, Any], future: list[str]):
        self.seed, self.places, self.future = seed, places, future
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.proc = subprocess.Popen([sys.executable, str(ATTACKER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def request(self, point: str, action: str) -> None:
        req = {"action": action, "seed": f"{self.seed}-{point}", "tiers": self.places["roots"],
               "victim": self.places["victim"], "future": self.future,
               "node_root": self.places["node_root"]}
        if action.startswith("pre-") and NOBODY_PREFIX and params(self.seed)["pre_as_nobody"]:
            # Before the job, everything the attacker does happens in the world-writable parent
            # of the roots: the real user nobody can, so on half the seeds the real user nobody
            # does it (on the others, the attacker process makes the entries nobody's).
            ran = subprocess.run([*NOBODY_PREFIX, sys.executable, str(ATTACKER)],
                                 input=json.dumps(req) + "\n", capture_output=True, text=True,
                                 timeout=60)
            answer = json.loads(ran.stdout.splitlines()[-1]) if ran.stdout.strip() else \
                {"did": f"failed as nobody: {ran.stderr.strip()[-300:]}", "targets": [],
                 "tampered": []}
        else:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            answer = json.loads(self.proc.stdout.readline())
        for target in answer["targets"]:
            if "cid" in target:
                target["snapshot"] = snapshot = snapshot_tree(target["path"])
                # Only a committed copy is the other tier's to keep: one still being written
                # (no manifest yet, a lease or pending marker) may vanish with a failed copy.
                target["committed"] = "tierstore.json" in snapshot and not any(
                    name.startswith(".tierstore-") for name in snapshot)
        with open(self.places["attacks"], "a") as f:
            f.write(json.dumps({"point": point, "action": action, **answer}) + "\n")

    def maybe(self, point: str, chance: float) -> None:
        """At ``point``, act with probability ``chance`` (drawn from the seed and the point)."""
        from .cotenant_attacker import ACTIONS

        rng = random.Random(f"cotenant-{self.seed}-{point}")
        if rng.random() < chance:
            with self.lock:  # drains announce phases from their own threads
                self.request(point, rng.choice(ACTIONS))

    @tierstore.hookimpl
    def tierstore_phase(self, phase, tier) -> None:
        with self.lock:
            key = f"{phase}@{tier}"
            self.counts[key] = n = self.counts.get(key, 0) + 1
        self.maybe(f"{key}#{n}", AT_PHASE)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def job(seed: int, places: dict[str, Any]) -> dict[str, Any]:
    """The job (in a forked child): what it saved, and every step that failed (with whether
    the failure was a TierstoreError)."""
    import torch.distributed.checkpoint as dcp

    from .state import blank_like, differences, state_for

    p = params(seed)
    ids = [f"step-{k}" for k in range(1, p["saves"] + 1)]
    attacker = Attacker(seed, places, list(ids))
    errors: list[list] = []
    saved: list[str] = []

    def step(name: str, fn) -> Any:
        try:
            return fn()
        except FAILURES as exc:
            errors.append([name, clear_error(exc), describe(exc)])
            return None

    try:
        if p["pre"]:
            attacker.request("before-open", p["pre"])
        store = step("open", lambda: tierstore.open(
            places["config"], plugins=[attacker, EventLog(places["events"])]))
        if store is None:
            return {"saved": saved, "errors": errors}
        for i, cid in enumerate(ids):
            attacker.future = ids[i:]
            failed_before = len(errors)
            step(f"save {cid}", lambda: dcp.save(state_for(cid, seed),
                                                 storage_writer=store.writer(), checkpoint_id=cid))
            if len(errors) == failed_before:
                saved.append(cid)
            attacker.maybe(f"after-save-{cid}", AT_STEP)
            if p["wait_each"]:
                step("wait", store.wait)
                attacker.maybe(f"after-wait-{cid}", AT_STEP)
        attacker.future = [f"step-{p['saves'] + 1}"]
        step("wait", store.wait)
        attacker.maybe("after-wait", AT_STEP)
        step("gc", store.gc)
        attacker.maybe("after-gc", AT_STEP)
        for info in step("list", store.list) or []:
            got = step(f"load {info.id}", lambda: try_load(store, info.id,
                                                           state_for(info.id, seed),
                                                           blank_like, differences))
            if got and got.startswith(("wrong", "unclear")):
                errors.append([f"load {info.id}", False, got])
            attacker.maybe(f"after-load-{info.id}", AT_STEP)
        latest = step("latest", store.latest)
        if latest:
            step(f"verify {latest}", lambda: store.verify(latest))
        step("close", store.close)
    finally:
        attacker.close()
    return {"saved": saved, "errors": errors}


def contents(snapshot: dict[str, list]) -> dict[str, list]:
    """A checkpoint's snapshot without its modes (the attacker chmods directories itself)."""
    return {path: [kind, value] for path, (kind, _, value) in snapshot.items()}


def check(seed: int, places: dict[str, Any], victim_before: dict) -> dict[str, Any]:
    """The invariants (see the module docstring), in a fresh forked child."""
    from .state import blank_like, differences, state_for

    violations: list[str] = []
    notes: list[str] = []
    changes = tree_changes(victim_before, snapshot_tree(places["victim"]))
    if changes:
        violations.append("the victim tree outside the tier roots changed: " + "; ".join(changes))
    events = EventLog.read(places["events"])
    gone_by_own = {(e["tier"], e["cid"]) for e in events if e["kind"] in ("evicted", "collected")}
    attacks = EventLog.read(places["attacks"])
    tampered = {tuple(t) for a in attacks for t in a["tampered"]}
    for a in attacks:
        for target in a["targets"]:
            if "cid" not in target:
                continue
            key = (target["tier"], target["cid"])
            if key in tampered or not target["committed"]:
                continue
            now = contents(snapshot_tree(target["path"]))
            if not now and key not in gone_by_own:
                violations.append(f"tier '{key[0]}' lost {key[1]} (a link from another tier "
                                  f"pointed at it: {a['did']}), and its own tier never evicted it")
            elif now and now != contents(target["snapshot"]):
                changed = tree_changes(contents(target["snapshot"]), now)
                violations.append(f"{key[1]} on tier '{key[0]}' changed after a link pointed at it "
                                  f"({a['did']}): {'; '.join(changed)}")
    kept: dict[str, str] = {}
    for e in events:
        if e.get("committed") and e["tier"] in TIERS:
            kept[e["tier"]] = e["cid"]
    for tier, cid in sorted(kept.items()):
        path = os.path.join(places["roots"][tier], cid)
        if (tier, cid) in gone_by_own or (tier, cid) in tampered:
            continue
        if not os.path.lexists(path):
            violations.append(f"tier '{tier}' lost {cid}, the checkpoint it keeps (keep = 1)")
            continue
        single = {"tier": [t for t in places["config"]["tier"] if t["name"] == tier]}
        try:
            with tierstore.open(single) as store:
                got = try_load(store, cid, state_for(cid, seed), blank_like, differences)
        except FAILURES as exc:
            got = ("clear: " if clear_error(exc) else "unclear: ") + describe(exc)
        if got.startswith(("wrong", "unclear")):
            violations.append(f"{cid} from tier '{tier}' alone: {got}")
        elif got != "ok":
            notes.append(f"{cid} from tier '{tier}' alone: {got}")
    try:
        with tierstore.open(places["config"]) as store:
            listed = [info.id for info in store.list()]
            latest = store.latest()
            if latest is not None:
                got = try_load(store, latest, state_for(latest, seed), blank_like, differences)
                if got.startswith(("wrong", "unclear")):
                    violations.append(f"latest() {latest}: {got}")
            notes.append(f"list(): {listed}, latest(): {latest}")
    except FAILURES as exc:
        (notes if clear_error(exc) else violations).append(
            f"a fresh store's open/list/latest failed: {describe(exc)}")
    return {"violations": violations, "notes": notes}


def run_cotenant_trial(trial: Trial, workdir: str, name: str, keep: bool = False) \
        -> dict[str, Any]:
    """Run one trial under ``workdir/name``: the victim, the job with its attacker, the check."""
    started = time.monotonic()
    base = os.path.join(workdir, name)
    shutil.rmtree(base, ignore_errors=True)
    places = layout(base, trial.seed)
    os.makedirs(places["shared"])
    os.chmod(places["shared"], 0o1777)  # like /tmp: everyone may make entries there
    if NOBODY_PREFIX:  # the way to it open to nobody (the run's temporary directories are 700)
        for d in (base, workdir, os.path.dirname(workdir)):
            os.chmod(d, os.stat(d).st_mode | 0o011)
    make_victim(places["victim"], trial.seed)
    before = snapshot_tree(places["victim"])
    violations: list[str] = []
    ran = run_child(lambda: job(trial.seed, places), log_path=places["log"], timeout=TIMEOUT)
    if ran.value is None:
        violations.append(f"the job {ran.describe()} (see {places['log']})")
    else:
        violations += [f"{what} returned other data than was saved: {text[7:]}"
                       if text.startswith("wrong: ") else
                       f"{what} failed without a TierstoreError: {text.removeprefix('unclear: ')}"
                       for what, clear, text in ran.value["errors"] if not clear]
    checked = run_child(lambda: check(trial.seed, places, before), log_path=places["log"],
                        timeout=TIMEOUT)
    notes: list[str] = []
    if checked.value is None:
        violations.append(f"the check {checked.describe()} (see {places['log']})")
    else:
        violations = checked.value["violations"] + violations
        notes = checked.value["notes"]
    notes += [f"attack at {a['point']}: {a['action']}: {a['did']}"
              for a in EventLog.read(places["attacks"]) if a["did"]]
    if ran.value is not None:
        notes += [f"job step {what}: {text}" for what, clear, text in ran.value["errors"] if clear]
    result = outcome(trial.spec, trial.row, COTENANT_FAULT, violations, notes,
                     describe_job(trial.seed), time.monotonic() - started, base)
    if result["passed"] and not keep:
        shutil.rmtree(base, ignore_errors=True)
    return result
