"""The ``fuzz`` kind: one field of a committed checkpoint's manifest or ``.metadata`` replaced.

The job of a seed saves ``step-1`` and ``step-2`` (on a ``local`` tier, or a ``file://``
``fsspec`` one, by seed; signed with ``[store] signing_keys`` on half the seeds), then replaces
one field of one of them (which one, by seed; the other is the *good* checkpoint):

- ``manifest``: one node of ``tierstore.json``, walked recursively (every value of every
  object and list, the objects and lists themselves included; a key of the ``files`` object
  too, renamed);
- ``metadata``: one node of DCP's ``.metadata`` (the unpickled ``Metadata``, walked through
  its dataclasses, dicts, lists and tuples), pickled again;

by a value of another type, NaN, +/-inf, 10**400, 2**64, -1, a non-ASCII string, an empty
string, list or object, null, a path out of the tier (``../../victim/secret.txt``), or nothing
(the field removed). On unsigned stores the checksums and the seal are then made to match (as
anyone who can write the tier can; on a quarter of the seeds they are left stale), so that the
reader's own checks of the values are what is tried; on signed stores they cannot be.

A fresh forked child then calls ``list()``, ``latest()``, loads both checkpoints, ``verify``
on both and ``tierstore ls --json``, and the invariants are: the child exits normally (no
signal, no abort, no hang); nothing but the fuzzed checkpoint is hidden (the good one is listed,
loads bitwise and verifies ok; ``latest()`` is the good one when it is the newer, and never
None); the fuzzed one loads bitwise (the field did not matter) or fails with a
``TierstoreError``, and so does ``verify`` of it (no other exception type); ``tierstore ls``
exits 0 and lists the good one; nothing outside the tier root changed (the victim tree).

A trial is ``fuzz/WHAT-SIGNED:fuzz:1:SEED`` (``fuzz/manifest-signed:fuzz:1:197003``); the
seed draws everything, so a trial runs again alone with ``--trial``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import pickle
import random
import shutil
import time
from typing import Any

import tierstore

from .hostile import (FAILURES, clear_error, describe, make_victim, outcome, snapshot_tree,
                      tree_changes, try_load)
from .plan import Trial
from .procs import run_child

__all__ = ["FUZZ_FAULT", "plan_fuzz", "row_of", "run_fuzz_trial"]

FUZZ_FAULT = "fuzz"
MANIFEST = "tierstore.json"
METADATA = ".metadata"
KEY_ENV = "TIERSTORE_FAULTS_FUZZ_KEY"
KEY = "5be1c0a27d9e4f3a8b6c2d1e0f9a8b7c"
TIMEOUT = 120.0
MISSING = "<missing>"
#: What a field is replaced by (besides a value of another type, drawn from the field's own).
VALUES: tuple[Any, ...] = (float("nan"), float("inf"), float("-inf"), 10 ** 400, 2 ** 64, -1,
                           "é☃\u202e\U0001f600", "", [], {}, None, "../../victim/secret.txt",
                           MISSING)


def params(seed: int) -> dict[str, Any]:
    rng = random.Random(f"fuzz-{seed}")
    return {"what": "manifest" if seed % 2 == 0 else "metadata",
            "signed": (seed // 2) % 2 == 1, "backend": rng.choice(["local", "fsspec"]),
            "fuzzed": rng.choice(["step-1", "step-2"]), "reseal": rng.random() < 0.75}


def row_of(seed: int) -> str:
    p = params(seed)
    return f"fuzz/{p['what']}-{'signed' if p['signed'] else 'unsigned'}"


def plan_fuzz(count: int, seed: int) -> list[Trial]:
    """``count`` trials on consecutive seeds drawn from ``seed`` (the variants alternate)."""
    base = seed * 100_000 + 97_000
    return [Trial(row_of(s), FUZZ_FAULT, 1, s) for s in range(base, base + count)]


def config(base: str, seed: int) -> dict[str, Any]:
    p = params(seed)
    root = os.path.join(base, "tier")
    tier = ({"name": "t", "backend": "local", "path": root} if p["backend"] == "local"
            else {"name": "t", "backend": "fsspec", "url": "file://" + root})
    store = {"signing_keys": [{"env": KEY_ENV}]} if p["signed"] else {}
    return {"store": store, "tier": [tier]}


def toml_of(cfg: dict[str, Any]) -> str:
    """The config as TOML (for ``tierstore ls``; only the shapes ``config`` makes)."""
    lines = []
    if cfg["store"]:
        lines += ["[store]", "signing_keys = [{ env = %s }]" % json.dumps(KEY_ENV), ""]
    for tier in cfg["tier"]:
        lines.append("[[tier]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in tier.items()]
    return "\n".join(lines) + "\n"


# -- the fields and their replacement ---------------------------------------------------------

def walk(node: Any, path: tuple = ()) -> list[tuple]:
    """Every path under ``node`` (``node`` itself excluded): steps ``("k", key)`` into a dict,
    ``("i", index)`` into a list or tuple, ``("a", name)`` into a dataclass."""
    out = []
    if isinstance(node, dict):
        children = [(("k", k), v) for k, v in node.items()]
    elif isinstance(node, (list, tuple)):
        children = [(("i", i), v) for i, v in enumerate(node)]
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        children = [(("a", f.name), getattr(node, f.name)) for f in dataclasses.fields(node)
                    if hasattr(node, f.name)]
    else:
        children = []
    for step, child in children:
        out.append(path + (step,))
        out += walk(child, path + (step,))
    return out


def replaced(node: Any, path: tuple, value: Any) -> Any:
    """A copy of ``node`` with the field at ``path`` replaced by ``value`` (removed when
    ``value`` is :data:`MISSING`; a ``("rename", new)`` value renames a dict key)."""
    (kind, key), rest = path[0], path[1:]
    if kind == "a":
        new = copy.copy(node)
        if rest:
            object.__setattr__(new, key, replaced(getattr(node, key), rest, value))
        elif value is MISSING:
            object.__delattr__(new, key)
        else:
            object.__setattr__(new, key, value)
        return new
    if kind == "k":
        new = dict(node)
        if rest:
            new[key] = replaced(node[key], rest, value)
        elif value is MISSING:
            del new[key]
        elif isinstance(value, tuple) and value[:1] == ("rename",):
            new = {(value[1] if k == key else k): v for k, v in node.items()}
        else:
            new[key] = value
        return new
    items = list(node)
    if rest:
        items[key] = replaced(items[key], rest, value)
    elif value is MISSING:
        del items[key]
    else:
        items[key] = value
    if isinstance(node, list):
        return items
    try:
        return type(node)(items)  # torch.Size refuses what is not an int: a tuple then
    except (TypeError, ValueError):
        return tuple(items)


def get(node: Any, path: tuple) -> Any:
    for kind, key in path:
        node = getattr(node, key) if kind == "a" else node[key]
    return node


def other_type(value: Any) -> Any:
    """A value of another type than ``value``, close to it where one is."""
    if isinstance(value, bool):
        return int(value) + 1
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return [value]
    if isinstance(value, str):
        return 7
    if isinstance(value, (list, tuple)):
        return {"0": list(value)[:1]}
    if isinstance(value, dict):
        return list(value)
    return "x"


def mutation(seed: int, fields: list[tuple], tree: Any, attempt: int = 0) -> tuple[tuple, Any]:
    """The field and value of ``seed`` (the ``attempt``-th draw: see ``make``). The variant
    changes with ``seed % 4`` and the field with ``seed // 4``: consecutive seeds walk every
    field of each variant in turn (the value is drawn)."""
    rng = random.Random(f"fuzz-field-{seed}" + (f"-{attempt}" if attempt else ""))
    path = rng.choice(fields) if attempt else fields[(seed // 4) % len(fields)]
    choices = [*VALUES, "OTHER"]
    if path[-1][0] == "k" and len(path) >= 2 and path[-2] == ("k", "files"):
        choices.append(("rename", "../../victim/secret.txt"))
    value = rng.choice(choices)
    if value == "OTHER":
        value = other_type(get(tree, path))
    return path, value


def show(path: tuple, value: Any) -> str:
    where = "".join(f".{k}" if kind == "a" else f"[{k!r}]" for kind, k in path)
    what = "removed" if value is MISSING else f"= {value!r}"[:60]
    return f"{where} {what}"


# -- the trial --------------------------------------------------------------------------------

def make(seed: int, base: str) -> dict[str, Any]:
    """Save both checkpoints, then fuzz one (in a forked child): what was done."""
    import torch.distributed.checkpoint as dcp

    from tierstore.format.checksum import Hasher, checksum_of
    from tierstore.format.manifest_check import SEAL_KEY, seal_of

    from .state import state_for

    p = params(seed)
    os.environ[KEY_ENV] = KEY
    with tierstore.open(config(base, seed)) as store:
        for cid in ("step-1", "step-2"):
            dcp.save(state_for(cid, seed), storage_writer=store.writer(), checkpoint_id=cid)
            store.wait()
    root = os.path.join(base, "tier", p["fuzzed"])
    with open(os.path.join(root, MANIFEST)) as f:
        manifest = json.load(f)
    if p["what"] == "manifest":
        fields = sorted(walk(manifest), key=repr)
        path, value = mutation(seed, fields, manifest)
        manifest = replaced(manifest, path, value)
    else:
        with open(os.path.join(root, METADATA), "rb") as f:
            meta = pickle.load(f)  # the test's own file, just written
        fields = sorted(walk(meta), key=repr)
        for attempt in range(100):
            path, value = mutation(seed, fields, meta, attempt)
            try:
                raw = pickle.dumps(replaced(meta, path, value))
                break
            except Exception:  # noqa: BLE001 - DCP refuses to pickle it (a memory format
                continue       # that is no enum member): draw again, as the seed says
        else:
            raise RuntimeError(f"no field of seed {seed} could be replaced and pickled")
        with open(os.path.join(root, METADATA), "wb") as f:
            f.write(raw)
        entry = manifest["files"][METADATA]
        if p["reseal"] and not p["signed"]:
            h = Hasher()
            h.update(raw)
            entry["checksum"], entry["size"] = h.hexdigest(), len(raw)
            if entry.get("blocks"):
                size = entry["block_bytes"]
                entry["blocks"] = [checksum_of(raw[i:i + size]) for i in range(0, len(raw), size)]
    sealed = False
    if p["reseal"] and not p["signed"] and isinstance(manifest, dict):
        try:
            manifest.pop(SEAL_KEY, None)
            manifest[SEAL_KEY] = seal_of(manifest)
            sealed = True
        except Exception:  # noqa: BLE001 - a value the seal cannot take: left stale
            pass
    with open(os.path.join(root, MANIFEST), "w") as f:
        f.write(json.dumps(manifest, indent=1))  # NaN and Infinity as Python writes them
    return {"field": show(path, value), "fields": len(fields), "sealed": sealed}


def check(seed: int, base: str) -> dict[str, Any]:
    """The invariants (module docstring), in a fresh forked child."""
    from tierstore.cli import main as cli

    from .state import blank_like, differences, state_for

    p = params(seed)
    os.environ[KEY_ENV] = KEY
    bad = p["fuzzed"]
    good = "step-2" if bad == "step-1" else "step-1"
    violations, notes = [], []

    def guarded(what: str, fn):
        try:
            return True, fn()
        except FAILURES as exc:
            (notes if clear_error(exc) else violations).append(
                f"{what} failed{'' if clear_error(exc) else ' without a TierstoreError'}: "
                f"{describe(exc)}")
            return False, None

    ok, store = guarded("open", lambda: tierstore.open(config(base, seed)))
    if not ok:
        violations.append("the store did not open: every checkpoint is hidden")
        return {"violations": violations, "notes": notes}
    with store:
        ok, infos = guarded("list()", store.list)
        ids = [i.id for i in infos or []]
        if good not in ids:
            violations.append(f"list() does not show the good {good}: {ids}")
        ok, latest = guarded("latest()", store.latest)
        if ok and latest is None:
            violations.append("latest() is None beside the good checkpoint")
        elif ok and good == "step-2" and latest != good:
            violations.append(f"latest() is {latest}, not the good and newer {good}")
        got = try_load(store, good, state_for(good, seed), blank_like, differences)
        if got != "ok":
            violations.append(f"the good {good} does not load: {got}")
        got = try_load(store, bad, state_for(bad, seed), blank_like, differences)
        if got.startswith(("wrong", "unclear")):
            violations.append(f"the fuzzed {bad}: {got}")
        notes.append(f"the fuzzed {bad} {'listed' if bad in ids else 'not listed'}; its load: "
                     f"{got}")
        # latest() vouches for a checkpoint's manifest (sealed or signed, and the digest of
        # every file, .metadata's included), not for .metadata's contents, which it does not
        # read (a restart reads it once, in the load): a fuzzed manifest must not be named,
        # a fuzzed .metadata may be, when its load then fails clearly (checked above).
        if latest == bad and got != "ok" and p["what"] != "metadata":
            violations.append(f"latest() is the fuzzed {bad}, which does not load: {got}")
        ok, report = guarded(f"verify({good})", lambda: store.verify(good))
        if ok and not report.ok:
            violations.append(f"verify({good}) of the good checkpoint is not ok: {report}")
        guarded(f"verify({bad})", lambda: store.verify(bad))
    toml = os.path.join(base, "tiers.toml")
    with open(toml, "w") as f:
        f.write(toml_of(config(base, seed)))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli(["ls", toml, "--json"])
        except SystemExit as exc:
            code = exc.code
    if code != 0:
        violations.append(f"tierstore ls exited {code}: {err.getvalue().strip()[:300]}")
    elif good not in out.getvalue():
        violations.append(f"tierstore ls does not show the good {good}: "
                          f"{out.getvalue()[:300]}")
    return {"violations": violations, "notes": notes}


def run_fuzz_trial(trial: Trial, workdir: str, name: str, keep: bool = False) -> dict[str, Any]:
    """Run one trial under ``workdir/name``: the saves and the fuzzing, then the check."""
    started = time.monotonic()
    base = os.path.join(workdir, name)
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    log = os.path.join(base, "log")
    victim = os.path.join(base, "victim")
    make_victim(victim, trial.seed)
    before = snapshot_tree(victim)
    violations, notes = [], []
    made = run_child(lambda: make(trial.seed, base), log_path=log, timeout=TIMEOUT)
    scenario = f"{row_of(trial.seed)} {params(trial.seed)}"
    if made.value is None:
        violations.append(f"saving and fuzzing {made.describe()} (a bug of the harness, or of "
                          f"a save; see {log})")
    else:
        scenario += f": {params(trial.seed)['fuzzed']}'s {made.value['field']} " \
                    f"(one of {made.value['fields']} fields; sealed again: " \
                    f"{made.value['sealed']})"
        checked = run_child(lambda: check(trial.seed, base), log_path=log, timeout=TIMEOUT)
        if checked.value is None:
            violations.append(f"the check {checked.describe()} (see {log})")
        else:
            violations += checked.value["violations"]
            notes += checked.value["notes"]
    changes = tree_changes(before, snapshot_tree(victim))
    if changes:
        violations.append("the victim tree outside the tier root changed: " + "; ".join(changes))
    result = outcome(trial.spec, trial.row, FUZZ_FAULT, violations, notes, scenario,
                     time.monotonic() - started, base)
    if result["passed"] and not keep:
        shutil.rmtree(base, ignore_errors=True)
    return result
