"""The training job of the simulator: what every torchrun rank runs, once per run of a contender
(``python -m tierstore_simulate.job SPEC.json``, SPEC written by the supervisor).

The job is small but real: gloo, a state of ``state_bytes`` made of a DTensor sharded over every
rank (``w``), a tensor of each rank's own (``rank<r>``) and a step counter. Each step adds 1 to
every element and all-reduces a small gradient (so the ranks move in lock step, and a dead rank
fails the others at once), then sleeps to ``step_s``. Every element therefore counts the steps
of its history: after a restore it must equal the step restored, and at the end the number of
steps of the whole job. The job prints ``FINAL OK`` or ``FINAL BAD`` (with what differs) per
rank at the end; ``RESTORE BAD`` as soon as a restored state is wrong.

How it checkpoints is the contender's:

- ``tierstore``: ``tierstore.open`` with ``[store] events_log``, resume from ``store.latest()``,
  ``dcp.async_save`` through ``store.writer()`` every ``every`` steps, ``store.record_step``
  each step; with ``emergency``, ``store.preemption()`` turns SIGTERM into an emergency save;
  with ``lazy``, ``store.wait_staging()`` before each step (where an optimizer step would be);
- ``dcp-async`` / ``dcp-sync``: stock ``dcp.async_save`` / ``dcp.save`` of ``step-<n>``
  directories in a shared directory (or, with ``storage = "s3"``, prefixes in the object store
  through DCP's ``FsspecWriter``/``FsspecReader``), resume from the newest one with DCP's ``.metadata``, on a
  gloo group of their own (as a careful stock user does, so saves never interleave with the
  training's collectives); SIGTERM's default action kills them. With ``async_staging``, DCP's
  ``DefaultStager(StagingOptions(use_async_staging=True))`` stages in a thread and the job
  waits for its ``staging_completion`` before the next step. They append the same JSON lines
  as ``[store] events_log`` to their own log (``opened``, ``step``, ``staged``, ``committed``,
  ``loaded``), so one accounting measures every contender.

Every collective (the training's all-reduce, DCP's, the store's) fails after
``collective_timeout_s`` when a rank stops answering: how a hung rank is noticed.

Every rank writes ``<pid> <node>`` to ``<work_dir>/pids/rank<r>.pid`` first, which is how the
supervisor finds the process it strikes.
"""

from __future__ import annotations

import time

#: when this module began importing: the start-up report splits the process's start-up here
_IMPORTS_BEGAN = time.time()

import dataclasses
import faulthandler
import json
import os
import signal
import sys
import traceback
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

import tierstore
from tierstore.engine.events_log import EventsLog
from tierstore.events import Event, EventKind

_IMPORTED = time.time()

__all__ = ["JobSpec", "STARTUP_PHASES", "main", "make_state", "pid_file", "process_start",
           "startup_of", "state_problems"]

#: the phases of a run's start-up in the ``STARTUP`` line each rank prints, in order
STARTUP_PHASES = ("python", "imports", "init_process_group", "state", "open", "restore")

#: columns of the sharded tensor: its rows are what is sharded
COLUMNS = 1024
#: floats of the small gradient each step all-reduces
GRADIENT = 1024
#: the stock contenders' one tier, as their events name it
SHARED = "shared"


@dataclass(frozen=True)
class JobSpec:
    """What one contender's job needs, written as JSON by the supervisor."""

    kind: str           # tierstore | dcp-async | dcp-sync
    steps: int
    step_s: float
    state_bytes: int
    every: int          # save every this many steps
    work_dir: str
    events_log: str
    emergency: bool = False
    store: dict[str, Any] | None = None   # tierstore's config (kind tierstore)
    shared_dir: str | None = None         # where stock DCP saves (kinds dcp-*), or
    shared_url: str | None = None         # its object-store URL (FsspecWriter), with
    storage_options: dict[str, Any] | None = None  # the filesystem's options
    collective_timeout_s: float = 20.0
    lazy: bool = False                    # tierstore: lazy staging
    auto: bool = False                    # tierstore: save when store.should_save says
    async_staging: bool = False           # dcp-async: DCP's DefaultStager, async staging

    def write(self, path: str | Path) -> None:
        """Write the spec as JSON to ``path``."""
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2))

    @classmethod
    def read(cls, path: str | Path) -> "JobSpec":
        """The spec written at ``path``."""
        return cls(**json.loads(Path(path).read_text()))


def pid_file(work_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` of a job in ``work_dir`` writes ``<pid> <node>``."""
    return Path(work_dir) / "pids" / f"rank{rank}.pid"


# --------------------------------------------------------------------------- the state

def make_state(state_bytes: int, rank: int, world: int, mesh: Any) -> dict[str, Any]:
    """The job's state at step 0 (every element 0): about ``state_bytes`` in all, one eighth of
    it in tensors of each rank's own, the rest a DTensor sharded by rows over ``mesh``."""
    own = max(1, state_bytes // (8 * world) // 4)
    rows_per_rank = max(1, (state_bytes - world * own * 4) // 4 // COLUMNS // world)
    local = torch.zeros(rows_per_rank, COLUMNS)
    w = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return {"w": w, f"rank{rank}": torch.zeros(own), "step": 0}


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """This rank's tensors of ``state`` (a DTensor's local shard)."""
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()
            if isinstance(v, (torch.Tensor, DTensor))}


def train_step(state: dict[str, Any], gradient: torch.Tensor) -> None:
    """One step's work: every element counts one more step; the gradient all-reduce ties the
    ranks together as data-parallel training does."""
    with torch.no_grad():
        for t in _tensors(state).values():
            t.add_(1.0)
    gradient.fill_(1.0)
    dist.all_reduce(gradient)
    state["step"] += 1


def state_problems(state: dict[str, Any], step: int) -> list[str]:
    """What in this rank's ``state`` does not say ``step`` steps of history (empty: all does)."""
    problems = []
    if state["step"] != step:
        problems.append(f"step counter is {state['step']}, expected {step}")
    for key, t in _tensors(state).items():
        wrong = int((t != float(step)).sum())
        if wrong:
            problems.append(f"{key}: {wrong} of {t.numel()} elements differ from {step} "
                            f"(e.g. {t.flatten()[int((t != float(step)).nonzero()[0][0])]})")
    return problems


# --------------------------------------------------------------------------- checkpointing

def _upload_future(response: Any) -> Future:
    """The future that completes when an ``async_save`` is durable on its first tier (DCP
    returns a Future, or an AsyncSaveResponse with staging overlapped)."""
    return getattr(response, "upload_completion", response)


class TierstoreCheckpoints:
    """tierstore: RAM and disk tiers, async saves, emergency save on SIGTERM."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.store = tierstore.open(spec.store)
        self.preemption = self.store.preemption() if spec.emergency else None
        self.pending: Future | None = None

    def restore(self, state: dict[str, Any]) -> int:
        """Load the newest checkpoint into ``state``; the step it holds (0: none)."""
        latest = self.store.latest()
        if latest is None:
            return 0
        dcp.load(state, storage_reader=self.store.reader(), checkpoint_id=latest,
                 process_group=self.store.process_group)
        return int(state["step"])

    def record_step(self, step: int, seconds: float) -> None:
        """A ``step`` event in the store's events log."""
        self.store.record_step(step, seconds)

    def due(self, step: int) -> bool:
        """Whether to save at ``step``: every ``every`` steps, or, with an ``every = "auto"``
        tier, when the store says a tier would take it."""
        if self.spec.auto:
            return self.store.should_save(step)
        return step % self.spec.every == 0

    def before_step(self) -> None:
        """With lazy staging, wait until the last save has copied the state (on a GPU this
        orders the training stream instead); else nothing: staging finished in the call."""
        if self.spec.lazy:
            self.store.wait_staging()

    def preempt_if_asked(self, state: dict[str, Any], step: int) -> None:
        """With ``emergency``: when any rank got SIGTERM, save this step and exit 0."""
        if self.preemption is not None and self.preemption.requested_by_any():
            print(f"EMERGENCY SAVE step-{step}", flush=True)
            self.preemption.save_and_exit(state, f"step-{step}")

    def save(self, state: dict[str, Any], step: int) -> None:
        """``dcp.async_save`` of ``step-<step>`` through the store (after the previous one)."""
        if self.pending is not None:
            self.pending.result()
        self.pending = _upload_future(dcp.async_save(
            state, storage_writer=self.store.writer(), checkpoint_id=f"step-{step}",
            process_group=self.store.process_group))

    def finish(self) -> None:
        """The last save and every drain done; the store closed."""
        if self.pending is not None:
            self.pending.result()
        if self.preemption is not None:
            self.preemption.close()
        self.store.close()


class StockEventsLog:
    """What ``[store] events_log`` would append, written by the stock job itself, through the
    store's own log writer (:class:`tierstore.engine.events_log.EventsLog`): the same lines."""

    def __init__(self, path: str, rank: int):
        self.rank = rank
        self.log = EventsLog()
        self.log.start(path)

    def emit(self, kind: str, **fields: Any) -> None:
        """Append one event of ``kind`` (``fields``: the other fields of an Event)."""
        self.log.append(Event(kind, rank=self.rank, **fields))


class StockCheckpoints:
    """Stock DCP: ``step-<n>`` directories in one shared directory (``FileSystemWriter``), or
    prefixes in an object store (``FsspecWriter``/``FsspecReader``, as DCP offers for
    fsspec URLs)."""

    def __init__(self, spec: JobSpec, rank: int):
        self.spec, self.rank = spec, rank
        self.asynchronous = spec.kind == "dcp-async"
        self.options = dict(spec.storage_options or {})
        if spec.shared_url:
            import fsspec

            self.root = spec.shared_url.rstrip("/")
            self.tier = "s3"
            # Fresh listings: another run's saves must be seen.
            self.fs, _ = fsspec.url_to_fs(self.root, skip_instance_cache=True,
                                          use_listings_cache=False, **self.options)
        else:
            self.root, self.tier, self.fs = str(spec.shared_dir), SHARED, None
            Path(self.root).mkdir(parents=True, exist_ok=True)
        # A group of its own: an async save's collectives run in DCP's thread and must not
        # interleave with the training's all-reduce on the default group.
        self.group = dist.new_group(backend="gloo",
                                    timeout=timedelta(seconds=spec.collective_timeout_s))
        self.stager = None
        if spec.async_staging:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # DCP's own async staging on a CPU job: a thread copies; no pinned or shared
            # memory and no non-blocking copies (those need an accelerator).
            self.stager = DefaultStager(StagingOptions(
                use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                use_non_blocking_copy=False))
        self.staging: tuple[Any, str, float] | None = None  # (future, id, call's start)
        self.events = StockEventsLog(spec.events_log, rank)
        self.events.emit(EventKind.OPENED, detail={"pid": os.getpid(),
                                                   "world_size": dist.get_world_size()})
        self.pending: Future | None = None

    def _newest_complete(self) -> int:
        """The newest step whose directory has DCP's ``.metadata`` (written last, by the
        coordinator's ``finish``): what a stock job resumes from. Rank 0 looks; all agree."""
        found = [0]
        if self.rank == 0:
            if self.fs is None:
                names = [p.parent.name for p in Path(self.root).glob("step-*/.metadata")]
            else:
                names = [p.rstrip("/").split("/")[-2]
                         for p in self.fs.glob(f"{self.root}/step-*/.metadata")]
            steps = [int(n.split("-")[1]) for n in names if n.split("-")[1].isdigit()]
            found = [max(steps, default=0)]
        dist.broadcast_object_list(found, src=0, group=self.group)
        return found[0]

    def restore(self, state: dict[str, Any]) -> int:
        """Load the newest complete step directory into ``state``; its step (0: none)."""
        step = self._newest_complete()
        if step == 0:
            return 0
        cid = f"step-{step}"
        started = time.perf_counter()
        path = f"{self.root}/{cid}"
        reader = None
        if self.fs is not None:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            reader = FsspecReader(path, **self.options)
        # With a reader, no checkpoint_id: DCP's reset(checkpoint_id) would open the path again
        # without the filesystem's options (credentials, endpoint).
        dcp.load(state, checkpoint_id=None if reader else path, storage_reader=reader,
                 process_group=self.group)
        self.events.emit(EventKind.LOADED, checkpoint_id=cid, tier=self.tier,
                         seconds=time.perf_counter() - started)
        return int(state["step"])

    def record_step(self, step: int, seconds: float) -> None:
        """A ``step`` event, as ``store.record_step`` writes it."""
        self.events.emit(EventKind.STEP, seconds=float(seconds), detail={"step": step})

    def preempt_if_asked(self, state: dict[str, Any], step: int) -> None:
        """Stock DCP has no preemption handling: SIGTERM's default action ends the process."""

    def due(self, step: int) -> bool:
        """Whether to save at ``step``: every ``every`` steps."""
        return step % self.spec.every == 0

    def before_step(self) -> None:
        """With async staging: wait for the last save's ``staging_completion`` (the state
        must not change before it is copied); its ``staged`` event counts the call and this
        wait, the whole stall."""
        if self.staging is None:
            return
        future, cid, started = self.staging
        self.staging = None
        future.result()
        self.events.emit(EventKind.STAGED, checkpoint_id=cid,
                         seconds=time.perf_counter() - started)

    def save(self, state: dict[str, Any], step: int) -> None:
        """Save ``step-<step>``: ``dcp.save``, or ``dcp.async_save`` after the previous one
        completed (``staged``: the time the call blocked; ``committed``: once durable)."""
        cid = f"step-{step}"
        path = f"{self.root}/{cid}"
        writer = None
        if self.fs is not None:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            writer = FsspecWriter(path, **self.options)
            path = None  # see restore: the writer holds the path and its options
        if not self.asynchronous:
            started = time.perf_counter()
            dcp.save(state, checkpoint_id=path, storage_writer=writer, process_group=self.group)
            self.events.emit(EventKind.COMMITTED, checkpoint_id=cid, tier=self.tier,
                             seconds=time.perf_counter() - started, detail={"step": step})
            return
        if self.pending is not None:
            self.pending.result()
        began = time.time()
        started = time.perf_counter()
        response = dcp.async_save(state, checkpoint_id=path, storage_writer=writer,
                                  process_group=self.group, async_stager=self.stager)
        fut = _upload_future(response)
        staging = getattr(response, "staging_completion", None)
        if staging is not None:
            self.staging = (staging, cid, started)  # its stall ends in before_step
        else:
            self.events.emit(EventKind.STAGED, checkpoint_id=cid,
                             seconds=time.perf_counter() - started)

        def committed(f: Future) -> None:
            if f.exception() is None:  # a failed save is not durable anywhere
                self.events.emit(EventKind.COMMITTED, checkpoint_id=cid, tier=self.tier,
                                 seconds=time.time() - began, detail={"step": step})

        fut.add_done_callback(committed)
        self.pending = fut

    def finish(self) -> None:
        """The last save durable."""
        self.before_step()
        if self.pending is not None:
            self.pending.result()
        if self.stager is not None:
            self.stager.close()


# --------------------------------------------------------------------------- the loop

def process_start() -> float | None:
    """When this process started (wall clock), from ``/proc``; None where there is none."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, IndexError, ValueError):
        return None


def startup_of(log_text: str, rank: int = 0) -> dict[str, float] | None:
    """The start-up phases (seconds by phase name) of the ``STARTUP`` line rank ``rank`` printed
    in a node's log, or None where there is none (a rank that died before its restore)."""
    for line in log_text.splitlines():
        head, _, rest = line.partition(": ")
        if head.endswith(f"STARTUP rank {rank}"):
            phases = {}
            for part in rest.split(", "):
                name, _, value = part.partition(" ")
                try:
                    phases[name] = float(value.removesuffix(" s"))
                except ValueError:
                    return None  # a line cut by a process killed while printing it
            return phases
    return None


def _startup_line(rank: int, marks: list[tuple[str, float]]) -> str:
    """``STARTUP rank r: python 0.40 s, imports 2.10 s, ...``: where a run's start-up went
    (a restart's cost is mostly this), one line per rank in its node's log."""
    began = process_start()
    parts = [] if began is None else [f"python {_IMPORTS_BEGAN - began:.2f} s"]
    previous = _IMPORTS_BEGAN
    for name, at in marks:
        parts.append(f"{name} {at - previous:.2f} s")
        previous = at
    return f"STARTUP rank {rank}: " + ", ".join(parts)


def _write_pid(work_dir: str, rank: int, node: int) -> None:
    """``<pid> <node>`` to this rank's pid file, whole or not at all (rename)."""
    path = pid_file(work_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(f"{os.getpid()} {node}\n")
    os.replace(tmp, path)


def run(spec: JobSpec) -> int:
    """Run the job of ``spec`` in this rank to its last step (or to an emergency exit); 0 when
    its final state is right, 1 when not."""
    marks = [("imports", _IMPORTED)]
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.collective_timeout_s))
    marks.append(("init_process_group", time.time()))
    rank, world = dist.get_rank(), dist.get_world_size()
    _write_pid(spec.work_dir, rank, int(os.environ.get("GROUP_RANK", "0")))
    mesh = init_device_mesh("cpu", (world,))
    state = make_state(spec.state_bytes, rank, world, mesh)
    marks.append(("state", time.time()))
    ckpt = TierstoreCheckpoints(spec) if spec.kind == "tierstore" else \
        StockCheckpoints(spec, rank)
    marks.append(("open", time.time()))
    start = ckpt.restore(state)
    marks.append(("restore", time.time()))
    print(_startup_line(rank, marks), flush=True)
    problems = state_problems(state, start)
    if problems:
        print(f"RESTORE BAD rank {rank} step {start}: {'; '.join(problems)}", flush=True)
    if rank == 0:
        print(f"RESUMED {start}", flush=True)
    gradient = torch.zeros(GRADIENT)
    for step in range(start + 1, spec.steps + 1):
        ckpt.before_step()  # a stall: between steps, not inside one
        began = time.time()
        train_step(state, gradient)
        time.sleep(max(0.0, spec.step_s - (time.time() - began)))
        ckpt.record_step(step, time.time() - began)
        ckpt.preempt_if_asked(state, step)
        if ckpt.due(step):
            ckpt.save(state, step)
    ckpt.finish()
    problems = state_problems(state, spec.steps)
    verdict = "FINAL OK" if not problems else f"FINAL BAD: {'; '.join(problems)}"
    print(f"{verdict} rank {rank} step {state['step']}", flush=True)
    dist.destroy_process_group()
    return 0 if not problems else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m tierstore_simulate.job SPEC.json`` under torchrun."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tierstore_simulate.job SPEC.json (under torchrun)",
              file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", category=UserWarning)
    # SIGUSR1 prints every thread's stack to the log: what the supervisor sends a rank that is
    # still running when the scheduler gives up on it, so the log says where it was waiting.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        return run(JobSpec.read(argv[0]))
    except Exception:  # noqa: BLE001 - the supervisor reads the log; a failure is expected
        traceback.print_exc()
        return 2


if __name__ == "__main__":
    sys.exit(main())
