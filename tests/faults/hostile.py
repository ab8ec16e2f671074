"""What the hostile kinds (``cotenant``, ``fuzz``) share: the victim tree outside the tier roots
and its snapshot, loads judged bitwise-or-clear, an event log, and one trial's outcome.

A *victim* is a directory beside the tier roots that no tier may touch: plain files, a
subdirectory, a file large enough to look like data. Its snapshot (type, mode, link target and
a content hash of every entry) is taken before a trial's job and compared afterwards: whatever
the trial did to the tiers, the victim comes out as it went in.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import stat
from typing import Any, Callable

import tierstore

from .workload import FAILURES, describe  # (shared with the fault matrix's jobs)

__all__ = ["EventLog", "FAILURES", "clear_error", "describe", "make_victim", "outcome",
           "snapshot_tree", "tree_changes", "try_load"]


def clear_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure tierstore meant: a ``TierstoreError``, or DCP's wrapper
    around nothing but ``TierstoreError``s (a load fails through DCP's planner)."""
    if isinstance(exc, tierstore.TierstoreError):
        return True
    causes = [f[0] for f in getattr(exc, "failures", {}).values() if isinstance(f, tuple)]
    return bool(causes) and all(isinstance(c, tierstore.TierstoreError) for c in causes)


def make_victim(path: str, seed: int) -> None:
    """Fill ``path`` with the victim tree of ``seed`` (a few files, a subdirectory, 256 KiB
    of data): what an attacker's links point at, and what no tier may change."""
    rng = random.Random(f"victim-{seed}")
    os.makedirs(os.path.join(path, "dir"), exist_ok=True)
    with open(os.path.join(path, "secret.txt"), "w") as f:
        f.write(f"the victim's secret {rng.random()}\n")
    with open(os.path.join(path, "data.bin"), "wb") as f:
        f.write(rng.randbytes(256 * 1024))
    for name in ("a", "b"):
        with open(os.path.join(path, "dir", name), "w") as f:
            f.write(f"{name} {rng.random()}\n")


def snapshot_tree(path: str) -> dict[str, list]:
    """Every entry under ``path`` (``path`` itself as ``.``), not following symlinks:
    relative path -> [type, mode, link target or content hash]. A missing ``path`` is empty."""
    out: dict[str, list] = {}
    if not os.path.lexists(path):
        return out

    def entry(full: str) -> list:
        st = os.lstat(full)
        if stat.S_ISLNK(st.st_mode):
            return ["link", 0, os.readlink(full)]
        if stat.S_ISDIR(st.st_mode):
            return ["dir", stat.S_IMODE(st.st_mode), ""]
        digest = hashlib.sha256()
        with open(full, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        return ["file", stat.S_IMODE(st.st_mode), digest.hexdigest()]

    out["."] = entry(path)
    if out["."][0] != "dir":
        return out
    for d, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(d, name)
            out[os.path.relpath(full, path)] = entry(full)
    return out


def tree_changes(before: dict[str, list], after: dict[str, list]) -> list[str]:
    """What differs between two snapshots: entries deleted, changed, added (a few of each)."""
    deleted = sorted(set(before) - set(after))
    added = sorted(set(after) - set(before))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    out = []
    if deleted:
        out.append(f"{len(deleted)} deleted: {deleted[:5]}")
    if changed:
        out.append(f"{len(changed)} changed: {changed[:5]}")
    if added:
        out.append(f"{len(added)} added: {added[:5]}")
    return out


class EventLog:
    """A ``tierstore_event`` plugin appending ``{kind, cid, tier, committed}`` lines to a file,
    so that a checker in another process knows what the job committed and what retention
    evicted (a save's commit is a ``committed`` event; a drain's, a ``drain_finished`` one
    with ``committed`` true)."""

    def __init__(self, path: str):
        self.path = path

    @tierstore.hookimpl
    def tierstore_event(self, event) -> None:
        line = json.dumps({"kind": event.kind, "cid": event.checkpoint_id, "tier": event.tier,
                           "committed": event.kind == "committed" or (
                               event.kind == "drain_finished"
                               and bool(event.detail.get("committed")))})
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    @staticmethod
    def read(path: str) -> list[dict[str, Any]]:
        try:
            with open(path) as f:
                return [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []


def try_load(store: tierstore.Store, cid: str, want: dict[str, Any],
             blank: Callable[[dict], dict], differences: Callable[[dict, dict], list]) -> str:
    """Load ``cid`` through ``store``: ``"ok"`` (bitwise equal to ``want``), ``"clear: ..."``
    (failed with a TierstoreError), ``"wrong: ..."`` (other data) or ``"unclear: ..."``
    (failed with another exception)."""
    import torch.distributed.checkpoint as dcp

    got = blank(want)
    try:
        dcp.load(got, storage_reader=store.reader(), checkpoint_id=cid)
    except FAILURES as exc:
        return ("clear: " if clear_error(exc) else "unclear: ") + describe(exc)
    wrong = differences(got, want)
    return "wrong: " + "; ".join(wrong)[:400] if wrong else "ok"


def outcome(spec: str, row: str, fault: str, passed_violations: list[str], notes: list[str],
            scenario: str, seconds: float, directory: str) -> dict[str, Any]:
    """A trial's outcome in the matrix's form (see matrix.run_trial)."""
    seen: list[str] = []
    for v in passed_violations:
        if v not in seen:
            seen.append(v)
    return {"spec": spec, "row": row, "fault": fault, "s3": False, "room": None, "variant": "",
            "backend": "local", "passed": not seen, "violations": seen, "notes": notes,
            "scenario": scenario, "seconds": round(seconds, 3), "timings": {}, "dir": directory}
