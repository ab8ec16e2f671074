"""Worker of the fault matrix's race kinds (tests/faults/races.py): ``backtoback``, ``auto`` and
``pins``. No fault is injected: each kind drives the library's own concurrency (drains behind
back-to-back saves, ``every = "auto"`` schedules, pins racing drains and ``keep``) and checks,
from fresh processes, what a user relies on.

argv: ``PLAN``, a JSON file: ``{"kind": KIND, "check": [TRIAL, ...], "run": [TRIAL, ...]}``.
One launch (every rank of one shape, with the environment torchrun gives its workers; a world
of one rank opens no process group) first checks the trials of ``check`` (run by an earlier
launch: these processes are fresh), then runs the job of each trial of ``run``. A trial is a
dict (``tests/faults/races.py``, ``params``): ``spec``, ``seed``, ``root`` (disk), ``shm`` (RAM
tiers) and the kind's parameters. Each trial has fresh tier roots.

Files, per trial and rank: ``root/job.r<rank>.json`` (what the job saw: saves returned, the
steps asked, errors, the events of the store, the pin operations with what they left) and
``root/check.r<rank>.json`` (``{"violations": [...], "notes": [...], "done": true}``).

- ``backtoback``: 2 nodes x 1 rank or 3 nodes x 2 ranks (``{node}`` in the node-local paths):
  ``ram`` (memory, node-local), ``disk`` (local, node-local), optionally ``shared`` (local);
  ``keep`` and ``every`` vary; N saves back to back (``dcp.save``, or ``dcp.async_save``
  without waiting between them), then ``store.wait()``. Check: every checkpoint a tier took
  and still keeps within ``keep`` is complete there on every node (each node's part present,
  of the coordinator's save, every file of every rank with its manifest's size and digest);
  nothing was collected as an orphan part; no save, wait or event failed; ``latest()`` is the
  last save; each of them loads bitwise from that tier alone (a store whose config has only
  that tier), the newest of every tier and all of the slowest node-local tier.
- ``auto``: 2 ranks, two shared ``local`` tiers with ``every = "auto"`` (``[store]
  mtbf_hours`` small, ``overwrite`` by seed), the documented loop (``if
  store.should_save(step): dcp.save(...)``), rank 1's steps slower. Check: every rank asked
  for and saved the same steps; every committed manifest's files are there with their sizes
  and digests and hold every rank's files; every committed checkpoint loads bitwise as its own
  step's state on every rank; ``latest()`` is the last save.
- ``pins``: one process, ``ram`` (memory) and ``disk`` (local), ``keep`` 1 or 2 each,
  optionally ``archive`` (local, no save goes there: ``promote`` only). A second thread pins,
  unpins and promotes (``store.pin``/``unpin``/``promote``) while saves, drains and ``keep``
  run: after each save, as a drain begins or copies (the checkpoint being drained), and as
  ``keep`` begins a pass (a checkpoint beyond ``keep`` there). After each call it reads which
  tiers hold the checkpoint pinned. Then one last save and ``store.wait()``. Check (per the
  calls that returned, in order): no copy that a pin covered (pinned there after the call, or
  committed there after the call began) was ever evicted; a pinned checkpoint has a copy left
  and every copy pinned; an unpinned one has no copy pinned; ``keep`` holds on ``ram`` and
  ``disk`` (the newest are there, nothing unpinned beyond them); every copy is complete and
  every checkpoint loads bitwise; no call failed other than with a ``TierstoreError``.
"""

import faulthandler
import json
import os
import queue
import random
import re
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash

import tierstore

# Whole lines in one write: the ranks share a pipe (see worker_common).
sys.stdout.reconfigure(line_buffering=True, write_through=False)

warnings.filterwarnings("ignore")

MANIFEST = "tierstore.json"
PENDING = ".tierstore-part-pending"
#: Seconds a trial's job, or its check, may take on a rank before it counts as hung: every
#: thread's stack goes to the log and the process ends (the launch with it).
JOB_TIMEOUT_S = 90
CHECK_TIMEOUT_S = 120
#: the events a job keeps (with their detail's small fields)
KEPT_EVENTS = ("committed", "evicted", "collected", "failed", "interval", "drain_started",
               "drain_finished")


# --------------------------------------------------------------------------- common

def rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def gather(value, world: int) -> list:
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def state(seed: int, step: int, rank: int, mesh, numel: int, zero: bool = False) -> dict:
    """What ``step-<step>`` of the trial of ``seed`` saves (this rank's view): ``w`` sharded
    over the ranks (a plain tensor in a world of one), a replicated tensor, ``numel`` floats of
    this rank's own, the step."""
    base = seed * 10_000 + step
    gen = torch.Generator().manual_seed(base)
    full, replicated = torch.randn(64, 32, generator=gen), torch.randn(16, generator=gen)
    own = torch.randn(numel, generator=torch.Generator().manual_seed(base * 64 + rank + 1))
    if zero:
        full, replicated, own = map(torch.zeros_like, (full, replicated, own))
    if mesh is not None:
        # this rank's shard, made here: distribute_tensor would be a collective, and ranks
        # whose schedules part (the bug ``auto`` looks for) would hang in it
        from torch.distributed.tensor import DTensor, Shard
        local = torch.chunk(full, mesh.size(), dim=0)[rank].clone()
        full = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape,
                                  stride=full.stride())
    return {"w": full, "replicated": replicated, f"rank{rank}": own,
            "step": 0 if zero else step}


def differs(got: dict, want: dict) -> str | None:
    """What differs between a loaded state and the expected one (None: bitwise equal)."""
    for k, v in want.items():
        a = got.get(k)
        if isinstance(v, torch.Tensor):
            a = a.to_local() if hasattr(a, "to_local") else a
            b = v.to_local() if hasattr(v, "to_local") else v
            if not isinstance(a, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape \
                    or not torch.equal(a, b):
                return f"tensor {k!r} differs"
        elif a != v:
            return f"{k!r} is {a!r}, not {v!r}"
    return None


ID = re.compile(r"step-\d+")


def step_of(cid: str) -> int:
    return int(cid.rsplit("-", 1)[1])


def ids_in(directory: str) -> list[str]:
    """The checkpoint ids (``step-N``) with a manifest in ``directory`` (not the entries a
    delete or a save moves aside, which carry a suffix)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted((n for n in names if ID.fullmatch(n)
                   and os.path.exists(os.path.join(directory, n, MANIFEST))), key=step_of)


def short(exc: BaseException, n: int = 400) -> str:
    """One line for ``exc``; DCP's CheckpointException (a traceback per rank) as the first
    rank's exception."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = sorted(failures.items())[0]
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return (f"{type(exc).__name__} (ranks {sorted(failures)}; rank {rank}: "
                    + short(inner, n) + ")")[:n]
    text = f"{type(exc).__name__}: {exc}".replace("\n", " | ")
    return text[:n]


class Recorder:
    """Keeps the store's events (``KEPT_EVENTS``) and hands phases to ``on_phase``."""

    def __init__(self, on_phase=None):
        self.events: list[dict] = []
        self.on_phase = on_phase
        self._lock = threading.Lock()

    @tierstore.hookimpl
    def tierstore_event(self, event):
        if event.kind not in KEPT_EVENTS:
            return
        detail = {k: v for k, v in (event.detail or {}).items()
                  if k in ("entry", "orphan_part", "error", "every", "during", "source",
                           "committed")
                  and isinstance(v, (str, int, float, bool))}
        with self._lock:
            self.events.append({"kind": event.kind, "cid": event.checkpoint_id,
                                "tier": event.tier, "rank": event.rank, "at": event.at,
                                "detail": detail})

    @tierstore.hookimpl
    def tierstore_phase(self, phase, checkpoint_id, tier, rank, detail):
        if self.on_phase is not None:
            self.on_phase(phase, checkpoint_id, tier)


def digest(path: str) -> tuple[int, str]:
    h = xxhash.xxh3_128()
    size = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(8 << 20)
            if not chunk:
                break
            size += len(chunk)
            h.update(chunk)
    return size, f"xxh3_128:{h.hexdigest()}"


def read_manifest(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def file_problems(directory: str, manifest: dict) -> list[str]:
    """Each file of ``manifest`` missing from ``directory`` or differing from its entry."""
    out = []
    for rel, entry in sorted(manifest["files"].items()):
        path = os.path.join(directory, rel)
        try:
            size, checksum = digest(path)
        except FileNotFoundError:
            out.append(f"{rel} (rank {entry.get('rank')}) is missing")
            continue
        if size != entry["size"]:
            out.append(f"{rel} has {size} bytes, its manifest says {entry['size']}")
        elif checksum != entry["checksum"]:
            out.append(f"{rel} does not match its manifest's digest")
    return out


def write_json(path: str, value) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def read_jobs(root: str, world: int) -> dict[int, dict | None]:
    out = {}
    for r in range(world):
        try:
            with open(os.path.join(root, f"job.r{r}.json")) as f:
                out[r] = json.load(f)
        except (OSError, ValueError):
            out[r] = None
    return out


def load_check(store, cid: str, t: dict, rank: int, world: int, mesh, numel: int,
               where: str) -> list[str]:
    """Collective: load ``cid`` through ``store`` and compare it with its step's state on
    every rank; the problems (rank 0 reports them)."""
    step = step_of(cid)
    got = state(t["seed"], step, rank, mesh, numel, zero=True)
    try:
        dcp.load(got, storage_reader=store.reader(), checkpoint_id=cid,
                 process_group=store.process_group)
        mine = differs(got, state(t["seed"], step, rank, mesh, numel))
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is one
        mine = f"does not load: {short(exc)}"
    everyone = gather(mine, world)
    bad = [(r, m) for r, m in enumerate(everyone) if m]
    if not bad:
        return []
    if all(m.startswith("does not load") for _, m in bad):
        return [f"{cid} {where} {bad[0][1]}"]
    return [f"{cid} {where} loads other data than step {step} saved: "
            + "; ".join(f"rank {r}: {m}" for r, m in bad)]


def rel_s(at: float, t0: float) -> str:
    return f"+{at - t0:.3f} s"


# --------------------------------------------------------------------------- backtoback

def bb_tiers(t: dict) -> list[dict]:
    tiers = [{"name": "ram", "backend": "memory", "path": t["shm"] + "/ram/{node}",
              "keep": t["ram_keep"], "every": 1},
             {"name": "disk", "backend": "local", "path": t["root"] + "/disk/{node}",
              "keep": t["disk_keep"], "every": t["disk_every"]}]
    if t["shared"]:
        tiers.append({"name": "shared", "backend": "local", "path": t["root"] + "/shared",
                      "keep": t["shared_keep"], "every": t["shared_every"]})
    return tiers


def bb_config(t: dict, only: str | None = None) -> dict:
    tiers = [{k: v for k, v in tier.items() if v is not None} for tier in bb_tiers(t)]
    if only is not None:
        tiers = [{k: v for k, v in tier.items() if k not in ("keep", "every")}
                 for tier in tiers if tier["name"] == only]
    return {"store": {"collective_timeout": 30, "part_timeout": 30}, "tier": tiers}


def expected_kept(steps: int, every: int, keep: int | None) -> list[str]:
    """The ids a tier taking every ``every``-th step keeps after ``steps`` saves."""
    taken = [f"step-{s}" for s in range(1, steps + 1) if s % every == 0]
    return taken if keep is None else taken[-keep:]


def job_backtoback(t: dict, rank: int, world: int, mesh) -> dict:
    rec = Recorder()
    out = {"saved": [], "errors": [], "t0": time.time()}
    numel = t["mib"] << 18
    store = tierstore.open(bb_config(t), plugins=[rec])
    try:
        futures = []
        for step in range(1, t["saves"] + 1):
            cid = f"step-{step}"
            sd = state(t["seed"], step, rank, mesh, numel)
            try:
                if t["async"]:
                    futures.append((cid, dcp.async_save(
                        sd, storage_writer=store.writer(), checkpoint_id=cid,
                        process_group=store.process_group)))
                else:
                    dcp.save(sd, storage_writer=store.writer(), checkpoint_id=cid,
                             process_group=store.process_group)
                    out["saved"].append(cid)
            except BaseException as exc:  # noqa: BLE001
                out["errors"].append(f"the save of {cid} raised {short(exc)}")
        for cid, fut in futures:
            try:
                fut.result()
                out["saved"].append(cid)
            except BaseException as exc:  # noqa: BLE001
                out["errors"].append(f"the async save of {cid} failed: {short(exc)}")
    finally:
        _wait_and_close(store, rec, out)
    return out


def _wait_and_close(store, rec, out: dict) -> None:
    """A job's end: ``store.wait()`` (its failure noted in ``out``), close, and what was seen."""
    try:
        store.wait()
    except BaseException as exc:  # noqa: BLE001
        out["errors"].append(f"store.wait() raised {short(exc)}")
    finally:
        store.close()
        out["events"] = rec.events
        out["seconds"] = time.time() - out["t0"]


def check_backtoback(t: dict, rank: int, world: int, mesh) -> tuple[list[str], list[str]]:
    nproc = t["nproc"]
    nnodes = world // nproc
    numel = t["mib"] << 18
    problems: list[str] = []
    notes: list[str] = []
    jobs = read_jobs(t["root"], world)
    t0 = min((j["t0"] for j in jobs.values() if j), default=0.0)
    orphans: dict[tuple[str, str, int], float] = {}
    if rank == 0:
        for r, job in jobs.items():
            if job is None:
                problems.append(f"rank {r}'s job did not finish (no job file)")
                continue
            problems += [f"rank {r}: {e}" for e in job["errors"]]
            for ev in job["events"]:
                node = ev["rank"] // nproc
                if ev["kind"] == "collected" and ev["detail"].get("orphan_part"):
                    orphans[(ev["tier"], ev["cid"], node)] = ev["at"]
                    problems.append(f"{ev['cid']}: node {node}'s part on tier '{ev['tier']}' "
                                    f"was collected as an orphan part ('collected ... "
                                    f"orphan_part', rank {ev['rank']}, {rel_s(ev['at'], t0)}) "
                                    f"with no fault")
                elif ev["kind"] == "failed":
                    problems.append(f"rank {ev['rank']}: a 'failed' event on tier "
                                    f"'{ev['tier']}' for {ev['cid']}: "
                                    f"{ev['detail'].get('error', '')}"[:400])
        # Every checkpoint each tier keeps, complete there on every node.
        for tier in bb_tiers(t):
            name = tier["name"]
            kept = expected_kept(t["saves"], tier["every"], tier["keep"])
            node_local = name in ("ram", "disk")
            base = tier["path"].replace("/{node}", "")
            for cid in kept:
                if not node_local:
                    d = os.path.join(base, cid)
                    m = read_manifest(d)
                    if m is None:
                        problems.append(f"{cid} on tier '{name}' (every {tier['every']}, keep "
                                        f"{tier['keep']}): committed there and within keep, "
                                        f"but its manifest is gone")
                        continue
                    problems += [f"{cid} on tier '{name}': {p}" for p in file_problems(d, m)]
                    ranks = {e.get("rank") for e in m["files"].values()}
                    missing = sorted(set(range(world)) - ranks)
                    if missing:
                        problems.append(f"{cid} on tier '{name}': its manifest lists no file of "
                                        f"ranks {missing}")
                    continue
                coordinator = read_manifest(os.path.join(base, "0", cid))
                if coordinator is None or ".metadata" not in coordinator["files"]:
                    problems.append(f"{cid} on tier '{name}' (every {tier['every']}, keep "
                                    f"{tier['keep']}): committed there and within keep, but "
                                    f"node 0's part (the coordinator's, with .metadata) is "
                                    f"{'gone' if coordinator is None else 'without .metadata'}")
                    continue
                covered = set()
                for node in range(nnodes):
                    d = os.path.join(base, str(node), cid)
                    m = read_manifest(d)
                    if m is None:
                        why = orphans.get((name, cid, node))
                        problems.append(
                            f"{cid} on tier '{name}': node {node}'s part is gone"
                            + (f" (collected as an orphan part at {rel_s(why, t0)})"
                               if why is not None else "")
                            + f"; node 0's part is committed and within keep "
                              f"({tier['keep']}): {cid} no longer loads from '{name}'")
                        continue
                    if m.get("save_token") != coordinator.get("save_token"):
                        problems.append(f"{cid} on tier '{name}': node {node}'s part is of "
                                        f"another save (token {m.get('save_token')}, node 0's "
                                        f"{coordinator.get('save_token')})")
                        continue
                    problems += [f"{cid} on tier '{name}', node {node}'s part: {p}"
                                 for p in file_problems(d, m)]
                    covered |= {e.get("rank") for e in m["files"].values()}
                missing = sorted(set(range(world)) - covered)
                if missing and not any(p.startswith(f"{cid} on tier '{name}'")
                                       for p in problems):
                    problems.append(f"{cid} on tier '{name}': no part holds the files of "
                                    f"ranks {missing}")
            # keep not applied (beyond what the tier keeps, node 0): a note only
            there = ids_in(os.path.join(base, "0") if node_local else base)
            extra = sorted(set(there) - set(kept), key=step_of)
            if extra:
                notes.append(f"tier '{name}' still holds {extra} beyond keep {tier['keep']}")
    # latest(), and bitwise loads from each tier alone.
    store = tierstore.open(bb_config(t), read_only=True)
    try:
        latest = store.latest()
    except BaseException as exc:  # noqa: BLE001
        latest = f"(raised {short(exc)})"
    store.close()
    want = f"step-{t['saves']}"
    if rank == 0 and latest != want:
        problems.append(f"latest() is {latest}, not {want}, the last save (which returned)")
    for tier in bb_tiers(t):
        kept = expected_kept(t["saves"], tier["every"], tier["keep"])
        ids = kept if tier["name"] == "disk" else kept[-1:]
        single = tierstore.open(bb_config(t, only=tier["name"]), read_only=True)
        try:
            for cid in ids:
                found = load_check(single, cid, t, rank, world, mesh, numel,
                                   f"from tier '{tier['name']}' alone")
                if rank == 0:
                    problems += found
        finally:
            single.close()
    return problems, notes


# --------------------------------------------------------------------------- auto

def auto_config(t: dict) -> dict:
    store = {"mtbf_hours": t["mtbf_hours"], "collective_timeout": 15}
    if t["overwrite"]:
        store["overwrite"] = True
    tiers = [{"name": name, "backend": "local", "path": f"{t['root']}/{name}",
              "every": "auto", **({"keep": keep} if keep else {})}
             for name, keep in (("fast", t["fast_keep"]), ("slow", t["slow_keep"]))]
    return {"store": store, "tier": tiers}


def job_auto(t: dict, rank: int, world: int, mesh) -> dict:
    rec = Recorder()
    out = {"asked": [], "saved": [], "errors": [], "t0": time.time()}
    numel = t["mib"] << 18
    store = tierstore.open(auto_config(t), plugins=[rec])
    try:
        for step in range(1, t["steps"] + 1):
            began = time.time()
            time.sleep(t["step_s"] * (1 + rank))  # rank 1's steps are slower
            store.record_step(step, time.time() - began)
            if store.should_save(step):  # the documented loop
                out["asked"].append(step)
                try:
                    dcp.save(state(t["seed"], step, rank, mesh, numel),
                             storage_writer=store.writer(), checkpoint_id=f"step-{step}",
                             process_group=store.process_group)
                    out["saved"].append(step)
                except BaseException as exc:  # noqa: BLE001
                    out["errors"].append(f"the save of step-{step} raised {short(exc)}")
    finally:
        _wait_and_close(store, rec, out)
    return out


def check_auto(t: dict, rank: int, world: int, mesh) -> tuple[list[str], list[str]]:
    numel = t["mib"] << 18
    problems: list[str] = []
    notes: list[str] = []
    jobs = read_jobs(t["root"], world)
    committed: list[str] = []
    if rank == 0:
        asked = {r: (j["asked"] if j else None) for r, j in jobs.items()}
        for r, job in jobs.items():
            if job is None:
                problems.append(f"rank {r}'s job did not finish (no job file)")
                continue
            problems += [f"rank {r}: {e}" for e in job["errors"]]
            problems += [f"rank {ev['rank']}: a 'failed' event on tier '{ev['tier']}' for "
                         f"{ev['cid']}: {ev['detail'].get('error', '')}"[:400]
                         for ev in job["events"] if ev["kind"] == "failed"]
        if None not in asked.values() and len({tuple(a) for a in asked.values()}) > 1:
            first = next(i for i in range(max(map(len, asked.values())))
                         if len({tuple(a[i:i + 1]) for a in asked.values()}) > 1)
            problems.append("the ranks took different steps (should_save): "
                            + "; ".join(f"rank {r} saved steps {', '.join(map(str, a[:first + 4]))}"
                                        f"{', ...' if len(a) > first + 4 else ''}"
                                        for r, a in asked.items())
                            + f" (they part at save #{first + 1})")
        if jobs.get(0):
            notes.append(f"steps saved: {jobs[0]['asked']}")
        for name in ("fast", "slow"):
            base = os.path.join(t["root"], name)
            for cid in ids_in(base):
                d = os.path.join(base, cid)
                m = read_manifest(d)
                if m is None:
                    continue
                committed.append(cid)
                problems += [f"{cid} on tier '{name}' (committed): {p}"
                             for p in file_problems(d, m)]
                ranks = {e.get("rank") for e in m["files"].values()}
                if set(range(world)) - ranks:
                    problems.append(f"{cid} on tier '{name}': its manifest lists no file of "
                                    f"ranks {sorted(set(range(world)) - ranks)}")
                if ".metadata" not in m["files"]:
                    problems.append(f"{cid} on tier '{name}': its manifest lists no .metadata")
                for r, a in asked.items():
                    if a is not None and step_of(cid) not in a:
                        problems.append(f"{cid} is committed on tier '{name}' but rank {r} "
                                        f"never saved step {step_of(cid)}")
    committed = gather(sorted(set(committed), key=step_of), world)[0]
    store = tierstore.open(auto_config(t), read_only=True)
    try:
        latest = store.latest()
        if rank == 0 and jobs.get(0) and jobs[0]["saved"] \
                and latest != f"step-{jobs[0]['saved'][-1]}":
            problems.append(f"latest() is {latest}, not step-{jobs[0]['saved'][-1]}, the last "
                            f"save")
        for cid in committed:
            found = load_check(store, cid, t, rank, world, mesh, numel, "(committed)")
            if rank == 0:
                problems += found
    finally:
        store.close()
    return problems, notes


# --------------------------------------------------------------------------- pins

def pins_tiers(t: dict) -> list[dict]:
    tiers = [{"name": "ram", "backend": "memory", "path": t["shm"] + "/ram",
              "keep": t["ram_keep"]},
             {"name": "disk", "backend": "local", "path": t["root"] + "/disk",
              "keep": t["disk_keep"]}]
    if t["archive"]:
        # no save goes there (every 1000): only promote does
        tiers.append({"name": "archive", "backend": "local", "path": t["root"] + "/archive",
                      "every": 1000, **({"keep": t["archive_keep"]} if t["archive_keep"]
                                        else {})})
    return tiers


def pins_config(t: dict) -> dict:
    return {"store": {}, "tier": pins_tiers(t)}


def pinned_state(t: dict, cid: str) -> dict[str, str | None]:
    """Per tier: ``pinned``, ``unpinned`` (a manifest) or None (none), read from the files."""
    out = {}
    for tier in pins_tiers(t):
        m = read_manifest(os.path.join(tier["path"], cid))
        out[tier["name"]] = None if m is None else "pinned" if m.get("pinned") else "unpinned"
    return out


class Pinner:
    """The second thread: pin, unpin and promote calls, on cues from the saves, the drains and
    ``keep`` (``cue``), each recorded with what the tiers held after it."""

    def __init__(self, t: dict, store, t0: float):
        self.t, self.store, self.t0 = t, store, t0
        self.rng = random.Random(f"pins-{t['seed']}")
        self.cues: queue.Queue = queue.Queue()
        self.ops: list[dict] = []
        self.saved: list[str] = []
        self.stop = False
        self.thread = threading.Thread(target=self.run, name="faults-pinner", daemon=True)
        self.keep = {tier["name"]: tier.get("keep") for tier in pins_tiers(t)}

    def on_phase(self, phase, cid, tier) -> None:
        """In the store's threads: hand the cue over, never wait."""
        if self.stop:
            return
        if phase in ("drain_begin", "drain_file", "drain_commit") and cid:
            self.cues.put(("drain", cid, tier, time.time()))
        elif phase == "retain" and tier:
            self.cues.put(("retain", None, tier, time.time()))

    def call(self, op: str, cid: str, to: str | None = None, pin: bool = False) -> None:
        rec = {"op": op, "cid": cid, "to": to, "pin": pin, "t0": time.time()}
        try:
            if op == "pin":
                self.store.pin(cid)
            elif op == "unpin":
                self.store.unpin(cid)
            else:
                self.store.promote(cid, to, pin=pin)
            rec["ok"] = True
        except tierstore.TierstoreError as exc:
            rec["ok"], rec["refused"] = False, short(exc, 200)
        except BaseException as exc:  # noqa: BLE001
            frames = traceback.extract_tb(exc.__traceback__)
            where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                                for f in reversed(frames[-4:]))
            rec["ok"], rec["error"] = False, f"{short(exc)} (at {where})"
            rec["trace"] = traceback.format_exc()[-3000:]
        rec["t1"] = time.time()
        rec["snap"] = pinned_state(self.t, cid)
        self.ops.append(rec)

    def beyond_keep(self, tier: str) -> list[str]:
        """Complete checkpoints of ``tier`` beyond its ``keep`` (the next victims), from the
        files."""
        keep = self.keep.get(tier)
        path = next(x["path"] for x in pins_tiers(self.t) if x["name"] == tier)
        found = []
        for cid in ids_in(path):
            m = read_manifest(os.path.join(path, cid))
            if m is not None:
                found.append((m.get("committed", 0), cid, bool(m.get("pinned"))))
        found.sort(reverse=True)
        return [cid for _, cid, pinned in found[keep or len(found):]]

    def run(self) -> None:
        rng, archive = self.rng, self.t["archive"]
        while True:
            try:
                kind, cid, tier, at = self.cues.get(timeout=0.05)
            except queue.Empty:
                if self.stop:
                    return
                continue
            if kind == "stop":
                return
            if kind != "saved" and time.time() - at > 0.05:  # stale: its moment is gone
                continue
            if kind == "saved":
                r = rng.random()
                target = cid if rng.random() < 0.5 or len(self.saved) < 2 \
                    else rng.choice(self.saved)
                if r < 0.4:
                    self.call("pin", target)
                elif r < 0.7:
                    self.call("unpin", target)
                else:
                    to = rng.choice(["disk", "archive"] if archive else ["disk"])
                    self.call("promote", target, to=to, pin=rng.random() < 0.6)
            elif kind == "drain":
                if rng.random() < self.t["drain_rate"]:
                    self.call("pin" if rng.random() < 0.65 else "unpin", cid)
            elif kind == "retain":
                if rng.random() < self.t["retain_rate"]:
                    victims = self.beyond_keep(tier)
                    if victims:
                        self.call("pin" if rng.random() < 0.75 else "unpin", rng.choice(victims))


def job_pins(t: dict, rank: int, world: int, mesh) -> dict:
    out = {"saved": [], "errors": [], "t0": time.time()}
    numel = t["mib"] << 18
    pinner = None
    rec = Recorder(on_phase=lambda *a: pinner and pinner.on_phase(*a))
    store = tierstore.open(pins_config(t), plugins=[rec])
    pinner = Pinner(t, store, out["t0"])
    pinner.thread.start()
    try:
        for step in range(1, t["saves"] + 1):
            cid = f"step-{step}"
            sd = state(t["seed"], step, rank, None, numel)
            try:
                if t["async"]:
                    fut = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id=cid)
                    fut.result()  # the cue comes once the first tier has committed
                else:
                    dcp.save(sd, storage_writer=store.writer(), checkpoint_id=cid)
                out["saved"].append(cid)
                pinner.saved.append(cid)
                pinner.cues.put(("saved", cid, None, time.time()))
            except BaseException as exc:  # noqa: BLE001
                out["errors"].append(f"the save of {cid} raised {short(exc)}")
            time.sleep(t["gap_s"])
        # The calls end; then one last save, so that keep passes once more on every tier it
        # goes to, after the last call.
        time.sleep(0.05)
        pinner.stop = True
        pinner.cues.put(("stop", None, None, time.time()))
        pinner.thread.join(60)
        if pinner.thread.is_alive():
            out["errors"].append("the pinning thread did not end within 60 s (a call hung)")
        try:
            store.wait()
        except BaseException as exc:  # noqa: BLE001
            out["errors"].append(f"store.wait() raised {short(exc)}")
        last = f"step-{t['saves'] + 1}"
        out["last"] = last
        out["last_t0"] = time.time()
        try:
            dcp.save(state(t["seed"], t["saves"] + 1, rank, None, numel),
                     storage_writer=store.writer(), checkpoint_id=last)
            out["saved"].append(last)
            store.wait()
        except BaseException as exc:  # noqa: BLE001
            out["errors"].append(f"the last save ({last}) or its wait raised {short(exc)}")
    finally:
        pinner.stop = True
        store.close()
        out["events"] = rec.events
        out["ops"] = pinner.ops
        out["seconds"] = time.time() - out["t0"]
    return out


def _describe_op(op: dict, t0: float) -> str:
    what = {"pin": "pin()", "unpin": "unpin()"}.get(op["op"]) or \
        f"promote(to={op['to']!r}, pin={op['pin']})"
    return f"{what} returned at {rel_s(op['t1'], t0)} (called at {rel_s(op['t0'], t0)})"


def covering(ops: list[dict], tier: str, at: float) -> dict | None:
    """The call (of one checkpoint's ``ops``, in order) whose pin covers ``tier`` at time
    ``at``: the calls that returned before ``at`` taken in order (pin: every tier, unpin: none,
    promote with pin: its tier); None when none covers it, or when a call was still under way
    at ``at`` (then nothing is certain)."""
    cover = None
    for op in ops:
        if op["t0"] >= at:
            break
        if op["t1"] >= at:
            return None
        if not op["ok"]:
            continue
        if op["op"] == "pin" or (op["op"] == "promote" and op["pin"] and op["to"] == tier):
            cover = op
        elif op["op"] == "unpin":
            cover = None
    return cover


def check_pins(t: dict, rank: int, world: int, mesh) -> tuple[list[str], list[str]]:
    numel = t["mib"] << 18
    problems: list[str] = []
    notes: list[str] = []
    job = read_jobs(t["root"], 1)[0]
    if job is None:
        return ["the job did not finish (no job file)"], notes
    t0 = job["t0"]
    tiers = [x["name"] for x in pins_tiers(t)]
    keep = {x["name"]: x.get("keep") for x in pins_tiers(t)}
    problems += job["errors"]
    problems += [f"a 'failed' event on tier '{ev['tier']}' for {ev['cid']}: "
                 f"{ev['detail'].get('error', '')}"[:400]
                 for ev in job["events"] if ev["kind"] == "failed"]
    ops = job["ops"]
    problems += [f"{op['op']}({op['cid']}) raised {op['error']}" for op in ops if "error" in op]
    refused = sum(1 for op in ops if "refused" in op)
    notes.append(f"{len(ops)} calls ({sum(op['ok'] for op in ops)} returned, {refused} refused "
                 f"with a TierstoreError)")
    commits: dict[tuple[str, str], list[float]] = {}
    evictions: dict[tuple[str, str], list[float]] = {}
    for ev in job["events"]:
        # a save's commit, or a drain's or promote's copy committed on its tier
        if ev["cid"] and (ev["kind"] == "committed" or (
                ev["kind"] == "drain_finished" and ev["detail"].get("committed"))):
            commits.setdefault((ev["cid"], ev["tier"]), []).append(ev["at"])
        elif ev["kind"] == "evicted":
            evictions.setdefault((ev["cid"], ev["tier"]), []).append(ev["at"])
    # The end: each tier's copies (complete or not) and whether pinned.
    end: dict[str, dict[str, bool]] = {}
    committed_at: dict[tuple[str, str], float] = {}
    for tier in pins_tiers(t):
        end[tier["name"]] = {}
        for cid in ids_in(tier["path"]):
            d = os.path.join(tier["path"], cid)
            m = read_manifest(d)
            if m is None:
                continue
            end[tier["name"]][cid] = bool(m.get("pinned"))
            committed_at[(tier["name"], cid)] = m.get("committed", 0.0)
            problems += [f"{cid} on tier '{tier['name']}': {p}" for p in file_problems(d, m)]
    by_cid: dict[str, list[dict]] = {}
    for op in ops:
        by_cid.setdefault(op["cid"], []).append(op)
    for cid, mine in sorted(by_cid.items(), key=lambda kv: step_of(kv[0])):
        mine.sort(key=lambda op: op["t0"])
        # (1) nothing a returned pin covered is evicted before an unpin is called
        for (ecid, tier), times in evictions.items():
            if ecid != cid:
                continue
            for at in times:
                cover = covering(mine, tier, at)
                if cover is None:
                    continue
                if cover["snap"].get(tier) == "pinned":
                    problems.append(f"{cid} was evicted from tier '{tier}' at {rel_s(at, t0)} "
                                    f"although pinned there: {_describe_op(cover, t0)}, after "
                                    f"which its copy there was pinned")
                    continue
                later = [c for c in commits.get((cid, tier), []) if cover["t0"] < c < at]
                if later:
                    problems.append(
                        f"{cid} was evicted from tier '{tier}' at {rel_s(at, t0)} although "
                        f"pinned: {_describe_op(cover, t0)}; its copy there committed at "
                        f"{rel_s(later[0], t0)}, after the call began, and was to be pinned "
                        f"too (a drain that copied the manifest from before the pin?)")
        # the final intent, from the calls that returned, in order
        scope: set[str] = set()
        effective = None
        for op in mine:
            if not op["ok"]:
                continue
            if op["op"] == "pin":
                scope, effective = {"*"}, op
            elif op["op"] == "unpin":
                scope, effective = set(), op
            elif op["pin"]:
                scope.add(op["to"])
                effective = op
        holding = [tier for tier in tiers if cid in end[tier]]
        if scope:
            covered = tiers if "*" in scope else sorted(scope)
            left = [tier for tier in covered if cid in end[tier]]
            if not left:
                gone = ", ".join(f"from '{tier}' at {rel_s(at, t0)}"
                                 for (ecid, tier), ts in evictions.items() if ecid == cid
                                 for at in ts)
                problems.append(f"{cid} is pinned ({_describe_op(effective, t0)}) but no copy "
                                f"of it is left on {covered}" + (f": evicted {gone}" if gone
                                                                 else ""))
            for tier in left:
                if not end[tier][cid]:
                    when = commits.get((cid, tier), [])
                    problems.append(
                        f"{cid} is pinned ({_describe_op(effective, t0)}) but its copy on tier "
                        f"'{tier}' is not pinned"
                        + (f" (committed there at {rel_s(when[-1], t0)})" if when else ""))
        elif effective is not None:
            for tier in holding:
                if end[tier][cid]:
                    when = commits.get((cid, tier), [])
                    problems.append(
                        f"{cid} was unpinned ({_describe_op(effective, t0)}) but its copy on "
                        f"tier '{tier}' is still pinned"
                        + (f" (committed there at {rel_s(when[-1], t0)})" if when else ""))
    # keep: after the last save (and the calls before it), nothing unpinned is left beyond
    # the newest `keep` of the tiers it went to (retention's order: the manifests' commit
    # times)
    for tier in ("ram", "disk"):
        k = keep[tier]
        present = sorted(end[tier], key=lambda c: (committed_at[(tier, c)], c), reverse=True)
        beyond = [c for c in present[k:] if not end[tier][c]]
        if beyond:
            problems.append(f"tier '{tier}' (keep = {k}) still holds {beyond} unpinned beyond "
                            f"its {k} newest ({present[:k]}) after the last save and wait()")
    # every copy loads: each checkpoint from each tier holding it alone
    ids = sorted({cid for held in end.values() for cid in held}, key=step_of)
    for tier in pins_tiers(t):
        cfg = {"store": {}, "tier": [{k: v for k, v in tier.items()
                                      if k not in ("keep", "every")}]}
        single = tierstore.open(cfg, read_only=True)
        try:
            for cid in ids:
                if cid in end[tier["name"]]:
                    problems += load_check(single, cid, t, rank, world, None, numel,
                                           f"from tier '{tier['name']}' alone")
        finally:
            single.close()
    return problems, notes


# --------------------------------------------------------------------------- main

JOBS = {"backtoback": job_backtoback, "auto": job_auto, "pins": job_pins}
CHECKS = {"backtoback": check_backtoback, "auto": check_auto, "pins": check_pins}


def main() -> int:
    rank, world = rank_world()
    torch.set_num_threads(1)
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    kind = plan["kind"]
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        dist.init_process_group("gloo", timeout=timedelta(seconds=180))
        mesh = init_device_mesh("cpu", (world,))
    for t in plan["check"]:
        barrier(world)
        started = time.time()
        # a check that hangs (a collective some rank never joins) ends the launch, with every
        # thread's stack in the log; the launcher reports it and goes on without it
        faulthandler.dump_traceback_later(CHECK_TIMEOUT_S, exit=True)
        try:
            problems, notes = CHECKS[kind](t, rank, world, mesh)
        except BaseException as exc:  # noqa: BLE001
            problems = [f"the check failed on rank {rank}: {short(exc, 600)}"]
            notes = []
            traceback.print_exc()
        faulthandler.cancel_dump_traceback_later()
        write_json(os.path.join(t["root"], f"check.r{rank}.json"),
                   {"violations": problems, "notes": notes, "done": True,
                    "seconds": time.time() - started})
        for p in problems:
            print(f"RANK {rank} {t['spec']} VIOLATION: {p}", flush=True)
    for t in plan["run"]:
        barrier(world)
        os.makedirs(t["root"], exist_ok=True)
        with open(os.path.join(t["root"], f"begun.r{rank}"), "w"):
            pass
        print(f"RANK {rank} JOB {t['spec']}", flush=True)
        faulthandler.dump_traceback_later(JOB_TIMEOUT_S, exit=True)
        try:
            out = JOBS[kind](t, rank, world, mesh)
        except BaseException as exc:  # noqa: BLE001
            traceback.print_exc()
            out = {"errors": [f"the job failed on rank {rank}: {short(exc, 600)}"],
                   "saved": [], "asked": [], "events": [], "ops": [], "t0": time.time()}
        faulthandler.cancel_dump_traceback_later()
        write_json(os.path.join(t["root"], f"job.r{rank}.json"), out)
    barrier(world)
    if world > 1:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
