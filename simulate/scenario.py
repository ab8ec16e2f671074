"""What ``tierstore simulate`` runs: a job, a scheduler, a schedule of failures and the
contenders that live through it, read from a TOML file or the built-in default.

Everything is checked before anything runs; a mistake is a :class:`ScenarioError` that names
the file, the table and the key, and says how to fix it. The built-in scenario is itself TOML
(:data:`DEFAULT_TOML`), read by the same code, so it is also an example to copy::

    [job]
    steps = 60            # training steps of the whole job
    step_s = 0.2          # each step's own time (compute, then sleep up to it)
    state_mib = 16        # the state's total size, sharded over the ranks
    nodes = 2             # simulated nodes: one torchrun each, {node} in tier paths
    ranks_per_node = 2
    collective_timeout_s = 20   # a collective waits this long for a rank that hangs

    [supervisor]
    restart_delay_s = 2   # the scheduler's delay between a failure and the restart
    timeout_s = 600       # the most one contender's job (all its runs) may take
    repeat = 1            # rounds, interleaved; the report gives each contender's median one

    [[failure]]           # struck when rank 0 reports at_step; the same for every contender
    kind = "kill-rank"    # kill-rank | hang-rank (rank = ...) | lose-node (node = ...) |
    at_step = 17          # preempt | object-store-outage (duration_s = ...)
    rank = 1

    [[contender]]
    name = "stock dcp"
    kind = "dcp-async"    # dcp-async | dcp-sync: stock DCP to a shared directory
    every = 10            # save interval in steps
    async_staging = false # dcp-async: DefaultStager(StagingOptions(use_async_staging=True))
    storage = "directory" # or "s3": DCP's FsspecWriter into the simulator's object store

    [[contender]]
    name = "tierstore"
    kind = "tierstore"
    every = 5
    emergency = true      # SIGTERM -> emergency checkpoint (store.preemption())
    lazy = false          # lazy staging: async_save returns at once, copies before the step
    tiers = [{ name = "ram", backend = "memory", every = 5 },
             { name = "peer", backend = "peer", every = 5 },   # replicas on the other node
             { name = "disk", backend = "local", every = 10 },
             { name = "s3", backend = "s3", every = 20 }]      # SeaweedFS (client = "obstore" too)
"""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["Contender", "DEFAULT_TOML", "FATAL_KINDS", "Failure", "FAILURE_KINDS",
           "CONTENDER_KINDS", "Job", "NODE_BACKENDS",
           "S3_CLIENTS", "Scenario", "ScenarioError", "Supervisor", "Tier", "TIER_BACKENDS",
           "default_scenario", "load_scenario", "parse_scenario", "slug"]

FAILURE_KINDS = ("kill-rank", "hang-rank", "lose-node", "preempt", "object-store-outage")
#: failures that end the job's run (the scheduler restarts it); an outage does not
FATAL_KINDS = ("kill-rank", "hang-rank", "lose-node", "preempt")
CONTENDER_KINDS = ("dcp-async", "dcp-sync", "tierstore")
#: where stock DCP saves: a shared directory, or the simulator's object store (FsspecWriter)
STOCK_STORAGES = ("directory", "s3")
#: backends a simulated tierstore tier may use; the simulator chooses their paths
TIER_BACKENDS = ("memory", "peer", "local", "fsspec", "s3")
#: the clients an ``s3`` tier may talk to the simulator's object store with (tierstore's backends)
S3_CLIENTS = ("fsspec", "obstore")
#: backends that hold a node's own copy: RAM, and the peer tier's replicas of other nodes
NODE_BACKENDS = ("memory", "peer")


class ScenarioError(ValueError):
    """A scenario that cannot run, with what was wrong and how to fix it."""


@dataclass(frozen=True)
class Job:
    """The training job every contender runs."""

    steps: int = 60
    step_s: float = 0.2
    state_mib: float = 16.0
    nodes: int = 2
    ranks_per_node: int = 2
    #: seconds a collective (the training's and the checkpoint's) waits for a rank that does
    #: not answer before it fails: how a hung rank is noticed
    collective_timeout_s: float = 20.0

    @property
    def world_size(self) -> int:
        """Ranks of the whole job."""
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class Supervisor:
    """The scheduler's side: how it restarts a failed job and how long it lets one run."""

    restart_delay_s: float = 2.0
    timeout_s: float = 600.0
    #: rounds of the whole schedule: every contender runs once per round, interleaved (round 1
    #: runs each in turn, then round 2...), and the report gives each contender's median round
    repeat: int = 1


@dataclass(frozen=True)
class Failure:
    """One failure of the schedule, struck once rank 0 has reported step ``at_step``.

    ``rank``: the rank ``kill-rank`` kills (SIGKILL) or ``hang-rank`` stops (SIGSTOP: the
    others must notice through their collective timeout); ``node``: the node ``lose-node``
    loses (its processes killed, its node-local directories deleted); ``preempt`` sends SIGTERM
    to every rank; ``object-store-outage`` stops the simulator's object store for
    ``duration_s`` seconds and starts it again (the job goes on: nothing restarts)."""

    kind: str
    at_step: int
    rank: int | None = None
    node: int | None = None
    duration_s: float | None = None

    @property
    def fatal(self) -> bool:
        """Whether it ends the job's run (every kind but an outage)."""
        return self.kind in FATAL_KINDS


@dataclass(frozen=True)
class Tier:
    """One tier of a tierstore contender. Its path is chosen by the simulator: ``memory`` and
    ``peer`` under /dev/shm, node-local (``{node}``; the peer tier replicates each rank's files
    to a rank of the other node); ``local`` and ``fsspec`` (``file://``) in the contender's
    work directory, shared by every node unless ``node_local``; ``s3`` a bucket of the
    simulator's own SeaweedFS server."""

    name: str
    backend: str
    every: int | str       # steps, or "auto" (the store chooses, after Young/Daly)
    keep: int | None = None
    node_local: bool = False
    #: ``s3`` tiers: the client tierstore talks to the object store with (its backend)
    client: str = "fsspec"


@dataclass(frozen=True)
class Contender:
    """One way of checkpointing the job: stock DCP (``dcp-async``, ``dcp-sync``) to a shared
    directory, or ``tierstore`` with its ``tiers``. The job saves every ``every`` steps."""

    name: str
    kind: str
    every: int
    tiers: tuple[Tier, ...] = ()
    emergency: bool = False
    #: dcp-async: stage with DefaultStager(StagingOptions(use_async_staging=True))
    async_staging: bool = False
    #: tierstore: lazy staging (async_save returns at once; copies finish before the next step)
    lazy: bool = False
    #: stock DCP: where it saves, a shared ``directory`` or the simulator's ``s3`` object store
    storage: str = "directory"
    #: tierstore: ``[store] mtbf_hours`` for ``every = "auto"`` tiers (None: learnt from the
    #: restarts in the events log)
    mtbf_hours: float | None = None

    @property
    def auto(self) -> bool:
        """Whether a tier chooses its own interval: the job then saves when
        ``store.should_save(step)`` says so."""
        return any(t.every == "auto" for t in self.tiers)

    @property
    def uses_object_store(self) -> bool:
        """Whether it saves to the simulator's object store (a tier, or stock DCP's storage)."""
        return self.storage == "s3" or any(t.backend == "s3" for t in self.tiers)

    @property
    def slug(self) -> str:
        """The name as a directory name."""
        return slug(self.name)


@dataclass(frozen=True)
class Scenario:
    """A whole simulation: the job, the scheduler, the failures in order, the contenders."""

    job: Job
    supervisor: Supervisor
    failures: tuple[Failure, ...]
    contenders: tuple[Contender, ...]
    source: str = "built-in"

    def to_dict(self) -> dict[str, Any]:
        """The scenario as plain data (``report.json``'s ``scenario``)."""
        return {"source": self.source, "job": asdict(self.job),
                "supervisor": asdict(self.supervisor),
                "failures": [asdict(f) for f in self.failures],
                "contenders": [asdict(c) for c in self.contenders]}


DEFAULT_TOML = """
# 2 nodes x 2 ranks, 40 steps of 0.5 s; a rank killed, the object store down for 10 s, a node
# lost (its RAM and replicas with it) and a preemption, against stock DCP (to the object store,
# and to a shared directory more often) and tierstore with RAM and peer replicas in front of
# each of those.
[job]
steps = 40
step_s = 0.5
state_mib = 32
nodes = 2
ranks_per_node = 2
collective_timeout_s = 20

[supervisor]
restart_delay_s = 2
timeout_s = 900

[[failure]]
kind = "kill-rank"
at_step = 13
rank = 1

[[failure]]
kind = "object-store-outage"
at_step = 17
duration_s = 10

[[failure]]
kind = "lose-node"
at_step = 27
node = 1

[[failure]]
kind = "preempt"
at_step = 37

[[contender]]
name = "stock async_save to s3 every 10"
kind = "dcp-async"
every = 10
storage = "s3"

[[contender]]
name = "stock async_save to a directory every 4"
kind = "dcp-async"
every = 4

[[contender]]
name = "tierstore ram+peer+s3"
kind = "tierstore"
every = 2
emergency = true
tiers = [{ name = "ram", backend = "memory", every = 2, keep = 2 },
         { name = "peer", backend = "peer", every = 2, keep = 2 },
         { name = "s3", backend = "s3", every = 10 }]

[[contender]]
name = "tierstore ram+peer+directory"
kind = "tierstore"
every = 2
emergency = true
tiers = [{ name = "ram", backend = "memory", every = 2, keep = 2 },
         { name = "peer", backend = "peer", every = 2, keep = 2 },
         { name = "disk", backend = "local", every = 4 }]
"""


def slug(name: str) -> str:
    """``name`` as one directory name: lower case, runs of other characters as ``-``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def default_scenario() -> Scenario:
    """The built-in scenario (:data:`DEFAULT_TOML`): 2 nodes x 2 ranks, a rank killed, an
    object-store outage, a node lost and a preemption, against stock ``dcp.async_save`` to the
    object store and to a shared directory, and tierstore with RAM and peer replicas in front of
    each."""
    return parse_scenario(tomllib.loads(DEFAULT_TOML), "built-in scenario")


def load_scenario(path: str | Path | None) -> Scenario:
    """The scenario in the TOML file at ``path``, or the built-in one when ``path`` is None."""
    if path is None:
        return default_scenario()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such scenario file; give the path of a TOML file, or "
                            f"no path for the built-in scenario") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: not valid TOML: {exc}") from None
    return parse_scenario(data, str(path))


# --------------------------------------------------------------------------- checking

class _Table:
    """One TOML table being read: its values checked one by one, and any key left unread is an
    unknown key (with the nearest valid one suggested)."""

    def __init__(self, source: str, where: str, data: Any, valid: tuple[str, ...]):
        if not isinstance(data, dict):
            raise ScenarioError(f"{source}: {where} must be a table, not {_kind(data)}")
        self.source, self.where, self.data, self.valid = source, where, data, valid
        for key in data:
            if key not in valid:
                near = difflib.get_close_matches(key, valid, n=1)
                hint = f" Did you mean '{near[0]}'?" if near else ""
                raise ScenarioError(f"{source}: {where}: unknown key '{key}'.{hint} "
                                    f"Valid keys: {', '.join(sorted(valid))}.")

    def error(self, key: str, message: str) -> ScenarioError:
        """A ScenarioError about ``key`` of this table."""
        return ScenarioError(f"{self.source}: {self.where}: {key} {message}")

    def problem(self, message: str) -> ScenarioError:
        """A ScenarioError about this table as a whole."""
        return ScenarioError(f"{self.source}: {self.where}: {message}")

    def has(self, key: str) -> bool:
        return key in self.data

    def integer(self, key: str, default: int | None = None, *, least: int | None = None,
            most: int | None = None) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be a whole number, not {_kind(value)}")
        if least is not None and value < least:
            raise self.error(key, f"is {value}; it must be at least {least}")
        if most is not None and value > most:
            raise self.error(key, f"is {value}; it must be at most {most}")
        return value

    def number(self, key: str, default: float, *, positive: bool = False) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"must be a number, not {_kind(value)}")
        if value < 0 or (positive and value == 0):
            raise self.error(key, f"is {value}; it must be {'above' if positive else 'at least'}"
                                  f" 0")
        return float(value)

    def text(self, key: str, default: str | None = None, choices: tuple[str, ...] = ()) -> str:
        if key not in self.data and default is None and choices:
            raise ScenarioError(f"{self.source}: {self.where}: missing key '{key}' (one of "
                                f"{', '.join(choices)})")
        value = self._get(key, default)
        if not isinstance(value, str) or not value.strip():
            raise self.error(key, f"must be a non-empty string, not {_kind(value)}")
        if choices and value not in choices:
            near = difflib.get_close_matches(value, choices, n=1)
            hint = f" Did you mean '{near[0]}'?" if near else ""
            raise self.error(key, f"'{value}' is not one of {', '.join(choices)}.{hint}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, not {_kind(value)}")
        return value

    def _get(self, key: str, default: Any) -> Any:
        if key in self.data:
            return self.data[key]
        if default is None:
            raise ScenarioError(f"{self.source}: {self.where}: missing key '{key}'")
        return default


def _kind(value: Any) -> str:
    """How a TOML value is called in a message."""
    names = {bool: "a boolean", int: "a whole number", float: "a number", str: "a string",
             list: "an array", dict: "a table"}
    for t, name in names.items():
        if type(value) is t:
            return f"{name} ({value!r})" if t in (bool, int, float, str) else name
    return type(value).__name__


def _array_of_tables(source: str, data: dict, key: str) -> list[Any]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise ScenarioError(f"{source}: '{key}' must be an array of tables, written "
                            f"[[{key}]], not {_kind(value)}")
    return value


def parse_scenario(data: dict[str, Any], source: str = "scenario") -> Scenario:
    """Check ``data`` (a parsed TOML document) and build its :class:`Scenario`; ``source``
    names it in messages."""
    _Table(source, "the scenario", data, ("job", "supervisor", "failure", "contender"))
    job = _job(source, data.get("job", {}))
    supervisor = _supervisor(source, data.get("supervisor", {}))
    failures = tuple(_failure(source, i, f, job)
                     for i, f in enumerate(_array_of_tables(source, data, "failure")))
    for i, (a, b) in enumerate(zip(failures, failures[1:]), start=1):
        if b.at_step <= a.at_step:
            raise ScenarioError(
                f"{source}: failure[{i}] at_step {b.at_step} is not after failure[{i - 1}]'s "
                f"{a.at_step}; list failures in the order they strike, each at a later step")
    raw = _array_of_tables(source, data, "contender")
    if not raw:
        raise ScenarioError(
            f"{source}: no contender: add at least one [[contender]] table, e.g.\n"
            f"  [[contender]]\n  name = \"stock\"\n  kind = \"dcp-async\"\n  every = 10")
    contenders = tuple(_contender(source, i, c, job) for i, c in enumerate(raw))
    if any(f.kind == "object-store-outage" for f in failures) and not any(
            c.uses_object_store for c in contenders):
        raise ScenarioError(f"{source}: an object-store-outage strikes, but no contender uses "
                            f"the simulator's object store (a tier with backend = \"s3\", or "
                            f"storage = \"s3\" for stock DCP): add one, or remove the outage")
    seen: dict[str, str] = {}
    for c in contenders:
        if c.slug in seen:
            raise ScenarioError(
                f"{source}: contenders '{seen[c.slug]}' and '{c.name}' would share the work "
                f"directory '{c.slug}'; give them names that differ in letters or digits")
        seen[c.slug] = c.name
    return Scenario(job, supervisor, failures, contenders, source)


def _job(source: str, data: Any) -> Job:
    t = _Table(source, "[job]", data, tuple(f.name for f in fields(Job)))
    d = Job()
    return Job(steps=t.integer("steps", d.steps, least=2),
               step_s=t.number("step_s", d.step_s, positive=True),
               state_mib=t.number("state_mib", d.state_mib, positive=True),
               nodes=t.integer("nodes", d.nodes, least=1, most=64),
               ranks_per_node=t.integer("ranks_per_node", d.ranks_per_node, least=1, most=64),
               collective_timeout_s=t.number("collective_timeout_s", d.collective_timeout_s,
                                             positive=True))


def _supervisor(source: str, data: Any) -> Supervisor:
    t = _Table(source, "[supervisor]", data, tuple(f.name for f in fields(Supervisor)))
    d = Supervisor()
    return Supervisor(restart_delay_s=t.number("restart_delay_s", d.restart_delay_s),
                      timeout_s=t.number("timeout_s", d.timeout_s, positive=True),
                      repeat=t.integer("repeat", d.repeat, least=1))


def _failure(source: str, index: int, data: Any, job: Job) -> Failure:
    where = f"failure[{index}]"
    t = _Table(source, where, data, ("kind", "at_step", "rank", "node", "duration_s"))
    kind = t.text("kind", choices=FAILURE_KINDS)
    # The last step is not allowed: the job may end before the strike lands.
    at_step = t.integer("at_step", least=1, most=job.steps - 1) if "at_step" in data else None
    if at_step is None:
        raise t.error("at_step", f"is missing; strike at a step from 1 to {job.steps - 1}")
    if kind != "object-store-outage" and t.has("duration_s"):
        raise t.error("duration_s", f"applies only to object-store-outage; a {kind} lasts "
                                    f"until the scheduler restarts the job")
    if kind in ("kill-rank", "hang-rank"):
        if t.has("node"):
            raise t.error("node", f"does not apply to {kind} (it strikes one rank: set rank); "
                                  f"to lose a whole node use kind = \"lose-node\"")
        rank = t.integer("rank", min(1, job.world_size - 1), least=0, most=job.world_size - 1)
        return Failure(kind, at_step, rank=rank)
    if kind == "object-store-outage":
        for key in ("rank", "node"):
            if t.has(key):
                raise t.error(key, "does not apply to object-store-outage: it stops the "
                                   "object store, not a rank")
        return Failure(kind, at_step, duration_s=t.number("duration_s", 10.0, positive=True))
    if kind == "lose-node":
        if t.has("rank"):
            raise t.error("rank", "does not apply to lose-node (it loses every rank of a "
                                  "node: set node)")
        node = t.integer("node", job.nodes - 1, least=0, most=job.nodes - 1)
        return Failure(kind, at_step, node=node)
    for key in ("rank", "node"):
        if t.has(key):
            raise t.error(key, "does not apply to preempt: it sends SIGTERM to every rank")
    return Failure(kind, at_step)


def _contender(source: str, index: int, data: Any, job: Job) -> Contender:
    name = data.get("name") if isinstance(data, dict) else None
    where = f"contender[{index}]" + (f" '{name}'" if isinstance(name, str) else "")
    t = _Table(source, where, data, ("name", "kind", "every", "tiers", "emergency",
                                      "async_staging", "lazy", "storage", "mtbf_hours"))
    kind = t.text("kind", choices=CONTENDER_KINDS)
    name = t.text("name", kind)
    if not slug(name):
        raise t.error("name", f"'{name}' has no letter or digit; it names the contender's "
                              f"work directory")
    if kind != "tierstore":
        for key in ("tiers", "emergency", "lazy", "mtbf_hours"):
            if t.has(key):
                raise t.error(key, f"is only for kind = \"tierstore\"; stock DCP ({kind}) "
                                   f"saves to one shared directory and dies on SIGTERM")
        if kind != "dcp-async" and t.has("async_staging"):
            raise t.error("async_staging", "is only for kind = \"dcp-async\" (DCP's "
                                           "DefaultStager stages async saves)")
        return Contender(name, kind, t.integer("every", least=1, most=job.steps),
                         async_staging=t.flag("async_staging", False),
                         storage=t.text("storage", "directory", STOCK_STORAGES))
    if t.has("storage"):
        raise t.error("storage", "is only for stock DCP (kind dcp-async or dcp-sync); a "
                                 "tierstore contender says where it saves with its tiers")
    if t.has("async_staging"):
        raise t.error("async_staging", "is only for kind = \"dcp-async\"; tierstore's own "
                                       "staging reuses its buffers (lazy = true to overlap it)")
    raw_tiers = data.get("tiers")
    every = None
    if t.has("every"):
        every = t.integer("every", least=1, most=job.steps)
    elif raw_tiers is None:
        raise t.error("every", "is missing: how many steps between saves")
    if raw_tiers is None:
        raw_tiers = [{"name": "ram", "backend": "memory", "every": every},
                     {"name": "disk", "backend": "local", "every": 2 * every}]
    if not isinstance(raw_tiers, list) or not raw_tiers:
        raise t.error("tiers", "must be a non-empty array of tables, fastest first, e.g. "
                               "[{ name = \"ram\", backend = \"memory\", every = 5 }]")
    tiers = tuple(_tier(source, f"{where} tiers[{i}]", raw, every)
                  for i, raw in enumerate(raw_tiers))
    fixed = [tier.every for tier in tiers if tier.every != "auto"]
    if len(fixed) < len(tiers):
        # An auto tier: the job asks store.should_save each step.
        every = 1
    elif every is None:
        every = min(fixed)
    names = [tier.name for tier in tiers]
    for tier in tiers:
        if names.count(tier.name) > 1:
            raise t.problem(f"tiers: two tiers are named '{tier.name}'; give each tier a "
                            f"name of its own")
        if tier.every == "auto":
            continue
        if tier.every % every:
            raise t.problem(f"tier '{tier.name}' has every = {tier.every}, which is not a "
                            f"multiple of the save interval every = {every}; the job saves "
                            f"every {every} steps, so make each tier's every a multiple of it")
    if not any(tier.every in (every, "auto") for tier in tiers):
        raise t.problem(f"no tier has every = {every} (the save interval), so some saves would "
                        f"go to no tier; set one tier's every to {every}")
    if any(tier.backend == "peer" for tier in tiers) and job.nodes < 2:
        raise t.problem("a peer tier replicates to another node, and the job has nodes = "
                        f"{job.nodes}; set [job] nodes = 2 or more, or drop the peer tier")
    mtbf = t.number("mtbf_hours", 1.0, positive=True) if t.has("mtbf_hours") else None
    return Contender(name, kind, every, tiers, t.flag("emergency", True),
                     lazy=t.flag("lazy", False), mtbf_hours=mtbf)


def _tier(source: str, where: str, data: Any, every: int | None) -> Tier:
    t = _Table(source, where, data, ("name", "backend", "every", "keep", "node_local", "client"))
    name = t.text("name")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise t.error("name", f"'{name}' may hold only letters, digits, '_' and '-'")
    backend = t.text("backend", choices=TIER_BACKENDS)
    if every is None and not t.has("every"):
        raise t.error("every", "is missing (and the contender sets no every to default to)")
    node_local = t.flag("node_local", backend in NODE_BACKENDS)
    if backend in NODE_BACKENDS and not node_local:
        # /dev/shm is each host's own memory: a RAM tier cannot be shared between nodes.
        raise t.error("node_local", f"cannot be false for a {backend} tier: RAM is each "
                                    f"node's own")
    if backend == "s3" and node_local:
        raise t.error("node_local", "cannot be true for an s3 tier: the object store is "
                                    "shared by every node")
    client = t.text("client", "fsspec", choices=S3_CLIENTS)
    if t.has("client") and backend != "s3":
        raise t.error("client", f"is for s3 tiers (the object-store client), and this tier's "
                                f"backend is {backend}; remove it")
    tier_every: int | str = ("auto" if data.get("every") == "auto"
                             else t.integer("every", every, least=1))
    return Tier(name=name, backend=backend, every=tier_every,
                keep=t.integer("keep", least=1) if t.has("keep") else None,
                node_local=node_local, client=client)
