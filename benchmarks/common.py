"""What the benchmarks in this folder share: the state dict they save, filesystem helpers, the
options every one of them takes, round bookkeeping, report lines, the ``--json`` / ``--strict``
ending, and the entry and exit status of the benchmarks that run under torchrun.

Not a benchmark itself. A benchmark run as ``python benchmarks/<name>.py`` has this folder first
on ``sys.path``, so ``import common`` (or ``from common import ...``) finds this module with no
path set-up; ``tierstore`` must be importable (``pip install -e .``, as ``make`` does).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

import tierstore
from tierstore.events import EventKind

GB = 1e9
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

R = TypeVar("R")


# -- state dict ------------------------------------------------------------------------------

def make_state_dict(size_mib: int, tensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``tensors`` fp32 tensors of random data totalling ``size_mib`` MiB (the last one takes
    the remainder). 2-D where the size allows, like real weights."""
    total = size_mib * (1 << 20) // 4
    if tensors < 1 or total < tensors:
        raise SystemExit(f"--tensors must be between 1 and the number of floats ({total})")
    gen = torch.Generator().manual_seed(seed)
    per = total // tensors
    sd = {}
    for i in range(tensors):
        numel = per if i < tensors - 1 else total - per * (tensors - 1)
        shape = (numel // 1024, 1024) if numel % 1024 == 0 else (numel,)
        sd[f"layer{i:03d}.weight"] = torch.randn(shape, generator=gen, dtype=torch.float32)
    return sd


def nbytes_of(sd: dict[str, torch.Tensor]) -> int:
    """Tensor payload in bytes: the figure every contender's GB/s is computed from."""
    return sum(t.nbytes for t in sd.values())


def check_equal(what: str, dest: dict[str, torch.Tensor], sd: dict[str, torch.Tensor]) -> None:
    """Fail loudly (``<what> returned wrong data for '<key>'``) when a load did not reproduce
    the saved tensors."""
    for key, ref in sd.items():
        if not torch.equal(dest[key].to(ref.device), ref):
            raise SystemExit(f"{what} returned wrong data for '{key}'")


# -- nested state dicts (get_state_dict's {"model": ..., "optim": ...}) ---------------------------

def _is_leaf(value: Any) -> bool:
    """Whether DCP's flatten_state_dict stops at ``value``: anything but a dict, and a list with
    no tensor, dict or non-leaf list in it (a list of FQNs, a tuple of betas: one entry)."""
    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    return not any(isinstance(v, torch.Tensor) or not _is_leaf(v) for v in value)


def leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every entry DCP saves of a nested state dict, as (dotted key, value): tensors (a DTensor
    as itself) and non-tensor values, descending into dicts and lists as DCP's
    flatten_state_dict does."""
    if _is_leaf(obj):
        yield prefix, obj
        return
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for k, v in items:
        yield from leaves(v, f"{prefix}.{k}" if prefix else str(k))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def flat_tensors(obj: Any) -> dict[str, torch.Tensor]:
    """The tensors of a nested state dict under dotted keys, each DTensor as its local shard:
    what a copy loop or a raw write of this rank's state goes over."""
    return {k: local_tensor(v) for k, v in leaves(obj) if isinstance(v, torch.Tensor)}


def blank_like(obj: Any) -> Any:
    """A load destination for a nested state dict: the same nesting in new containers, every
    tensor a new zeroed one of the same shape and dtype (a DTensor one on the same mesh with the
    same placements), every other value a deep copy."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "to_local"):
            from torch.distributed.tensor import DTensor
            return DTensor.from_local(torch.zeros_like(obj.to_local()), obj.device_mesh,
                                      obj.placements, run_check=False, shape=obj.shape,
                                      stride=obj.stride())
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: blank_like(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [blank_like(v) for v in obj]
    return copy.deepcopy(obj)


def mismatched_keys(dest: Any, sd: Any) -> list[str]:
    """The dotted keys where a loaded nested state dict differs from the saved one: tensors
    compared bit for bit (``torch.equal`` of the local shards), other values with ``==``."""
    got = dict(leaves(dest))
    bad = []
    for key, ref in leaves(sd):
        if key not in got:
            bad.append(key)
        elif isinstance(ref, torch.Tensor):
            if not (isinstance(got[key], torch.Tensor)
                    and torch.equal(local_tensor(got[key]), local_tensor(ref))):
                bad.append(key)
        elif got[key] != ref:
            bad.append(key)
    return bad


def tensor_view(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's memory, without a copy (numpy may be absent)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")


def write_raw(path: str, tensors: list[torch.Tensor]) -> None:
    """The tensors' bytes written straight from their memory into one new file with
    ``os.write``, then ``fsync``: what the disk and the kernel allow."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            if t.nbytes == 0:
                continue
            view = tensor_view(t)
            done = 0
            while done < len(view):  # os.write may write less than asked
                done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


# -- observing a store -----------------------------------------------------------------------

class DrainTimer:
    """Observer passed to ``tierstore.open(plugins=[...])``: keeps each tier's drain_finished
    event and the process CPU time used between that tier's drain_started and drain_finished."""

    def __init__(self) -> None:
        self.finished: dict[str, object] = {}
        self.cpu: dict[str, float] = {}
        self._cpu0: dict[str, float] = {}
        self._lock = threading.Lock()

    @tierstore.hookimpl
    def tierstore_event(self, event) -> None:
        with self._lock:
            if event.kind == EventKind.DRAIN_STARTED:
                self._cpu0[event.tier] = time.process_time()
            elif event.kind == EventKind.DRAIN_FINISHED:
                self.cpu[event.tier] = time.process_time() - self._cpu0.pop(event.tier, 0.0)
                self.finished[event.tier] = event


# -- filesystem and network helpers ------------------------------------------------------------

def fs_type(path: str) -> str:
    """Filesystem type of ``path`` (longest mount-point prefix in /proc/mounts), or '?'."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def proc_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (0 when unknown or gone):
    a server's work during a benchmark."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def remove(path: str) -> None:
    """Delete a file or directory tree if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def warm_page_cache(path: str) -> int:
    """Read every file under ``path`` once (untimed) so a following load is served from the page
    cache for both load contenders alike. Returns bytes read."""
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb", buffering=0) as f:
                while n := f.readinto(view):
                    total += n
    return total


def checkpoint_files(ckpt_dir: str) -> list[str]:
    """Every file of a committed checkpoint directory, largest first (the drain's order)."""
    names = [n for n in os.listdir(ckpt_dir) if os.path.isfile(os.path.join(ckpt_dir, n))]
    return sorted(names, key=lambda n: (-os.path.getsize(os.path.join(ckpt_dir, n)), n))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tests_module(name: str) -> ModuleType:
    """The module ``tests/<name>.py`` of this checkout (e.g. ``servers``, the SeaweedFS
    helper), loaded from its file: ``tests/`` is not a package and not on ``sys.path``."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(_REPO, "tests", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look it up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


# -- options and rounds ----------------------------------------------------------------------------

def parse_with_cuda(p: argparse.ArgumentParser, argv: list[str] | None,
                    help: str) -> argparse.Namespace:
    """Parse ``argv`` with a ``--cuda`` flag (``help`` says what it changes), refused where
    torch sees no CUDA device."""
    p.add_argument("--cuda", action="store_true", help=help)
    args = p.parse_args(argv)
    if args.cuda and not torch.cuda.is_available():
        p.error("--cuda needs CUDA, and torch.cuda.is_available() is False here")
    return args


def benchmark_parser(doc: str, repeat: int, warmup_costs: str,
                     dir_help: str, *, size_mib: int = 1024, tensors: int = 64,
                     per_rank: bool = False) -> argparse.ArgumentParser:
    """The options every benchmark in this folder takes; each adds its own after. ``size_mib``
    and ``tensors``: this benchmark's default state (``per_rank``: each rank's)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    whose = " per rank" if per_rank else ""
    p.add_argument("--size-mib", type=int, default=size_mib,
                   help=f"state dict size{whose} (default {size_mib})")
    p.add_argument("--tensors", type=int, default=tensors,
                   help=f"number of tensors{whose} (default {tensors})")
    p.add_argument("--repeat", type=int, default=repeat, help=f"timed rounds (default {repeat})")
    p.add_argument("--warmup", type=int, default=1,
                   help=f"untimed rounds first (default 1): first-call costs ({warmup_costs}) "
                        f"would otherwise land on round 1")
    p.add_argument("--dir", default=None, help=dir_help)
    p.add_argument("--io-threads", type=int, default=None,
                   help="tierstore [store] io_threads (default: tierstore's own default)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    return p


def disk_parent(args: argparse.Namespace, why: str) -> tuple[str, str]:
    """``--dir`` (default: the system temp dir) and its filesystem type; exits when it is tmpfs,
    where fsync costs nothing and ``why`` would mean nothing."""
    parent = args.dir or tempfile.gettempdir()
    kind = fs_type(parent)
    if kind in ("tmpfs", "ramfs"):
        raise SystemExit(f"{parent} is on {kind} ({why}); point --dir at a disk-backed "
                         f"filesystem")
    return parent, kind


def progress_log(quiet: bool) -> Callable[[str], None]:
    """Per-round progress lines on stderr (none with ``--quiet``); also silences the warning DCP
    gives on every call without a process group (these benchmarks mean to do that)."""
    warnings.filterwarnings("ignore", module=r"torch\.distributed\..*")
    warnings.filterwarnings("ignore", message=".*torch.distributed.*")
    return (lambda _m: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))


def rotated(items: tuple[str, ...], k: int) -> list[str]:
    """``items`` in round-robin order starting at index ``k`` (mod len)."""
    k %= len(items)
    return list(items[k:]) + list(items[:k])


def warmup_then_rounds(args: argparse.Namespace, log: Callable[[str], None],
                       new_results: Callable[[], R],
                       one_round: Callable[[int, bool, R, Callable[[str], None]], None],
                       res: R | None = None) -> R:
    """``--warmup`` untimed rounds (each into fresh results, thrown away, without progress
    lines), then ``--repeat`` timed rounds into ``res`` (default: fresh results), which is
    returned. ``one_round(rnd, warm, results, log)`` runs round ``rnd`` (counted from 0 in
    each phase)."""
    for w in range(args.warmup):
        log(f"warm-up round {w + 1} (not counted)")
        one_round(w, True, new_results(), lambda _m: None)
    res = new_results() if res is None else res
    for rnd in range(args.repeat):
        one_round(rnd, False, res, log)
    return res


# -- figures and the report --------------------------------------------------------------------

def median_or_none(xs: list[float]) -> float | None:
    """Median, None for an empty list (JSON has no NaN)."""
    return statistics.median(xs) if xs else None


def timing_figures(seconds: list[float], cpu: list[float],
                   nbytes: list[float] | None = None, payload: int | None = None) -> dict:
    """One contender's JSON figures: its rounds' wall seconds and median, GB/s of the median
    (of ``payload`` bytes, or of the median of ``nbytes``, which is then kept as ``bytes``) and
    its rounds' process CPU seconds and median."""
    med = statistics.median(seconds)
    if nbytes is None:
        return {"seconds": seconds, "median_s": med, "gbps": payload / med / GB,
                "cpu_seconds": cpu, "median_cpu_s": statistics.median(cpu)}
    moved = statistics.median(nbytes)
    return {"seconds": seconds, "median_s": med, "bytes": moved, "gbps": moved / med / GB,
            "cpu_seconds": cpu, "median_cpu_s": statistics.median(cpu)}


def verdict(target: str, ratio: float, per_round: list[float], *, least: float | None = None,
            most: float | None = None) -> dict:
    """An acceptance target as the JSON has it: ``ratio`` must be at least ``least`` (kept as
    ``min``) or at most ``most`` (kept as ``max``); ``per_round``: the same ratio per round."""
    v: dict = {"target": target, "ratio": ratio}
    if least is not None:
        v["min"] = least
    if most is not None:
        v["max"] = most
    v["per_round"] = per_round
    v["pass"] = (least is None or ratio >= least) and (most is None or ratio <= most)
    return v


def rounds_text(seconds: list[float]) -> str:
    """A table cell with every round's seconds."""
    return " ".join(f"{t:.3f}" for t in seconds)


def print_verdicts(verdicts: list[dict], missed: str = "FAIL") -> None:
    """One line per acceptance target: PASS, or ``missed``, with the per-round ratios."""
    for v in verdicts:
        rounds = ", ".join(f"{x:.2f}" for x in v["per_round"])
        print(f"{'PASS' if v['pass'] else missed}: {v['target']}: {v['ratio']:.2f}x "
              f"(per round: {rounds})")


def print_informational(info: list[dict]) -> None:
    """One ``INFO:`` line per ratio reported without a target."""
    for v in info:
        rounds = ", ".join(f"{x:.2f}" for x in v["per_round"])
        print(f"INFO: {v['target']}: {v['ratio']:.2f}x (per round: {rounds})")


def finish_report(args: argparse.Namespace, config: dict, summary: dict, t_start: float) -> int:
    """Print the total run time (since ``t_start``, a ``time.perf_counter()``), write ``--json``
    (config, machine, figures) and return the exit status (``--strict``: 1 when a target was
    missed)."""
    elapsed = time.perf_counter() - t_start
    print(f"\n(total run time {elapsed:.0f} s)", flush=True)
    if args.json:
        doc = {
            "config": config,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "torch": torch.__version__,
                        "tierstore": tierstore.__version__},
            "elapsed_s": elapsed,
            **summary,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 1 if args.strict and not all(v["pass"] for v in summary["verdicts"]) else 0


# -- benchmarks run under torchrun (replication.py, restore.py) -----------------------------------

#: set by a launcher that runs a benchmark under torchrun: where rank 0 leaves its exit status
STATUS_ENV = "TIERSTORE_BENCH_STATUS_FILE"


def under_torchrun() -> bool:
    """True inside a torchrun worker (torchrun sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@contextmanager
def status_file(prefix: str) -> Iterator[str]:
    """An empty temp file for rank 0's exit status (pass it to the ranks as ``STATUS_ENV``),
    removed afterwards."""
    fd, path = tempfile.mkstemp(prefix=prefix)
    os.close(fd)
    try:
        yield path
    finally:
        os.remove(path)


def read_status(path: str) -> int:
    """The exit status rank 0 left in ``path`` (1 when it left none)."""
    with open(path) as f:
        text = f.read().strip()
    return int(text) if text else 1


def max_over_ranks(values: list[float]) -> list[float]:
    """Each value's maximum over the ranks of the default group (``all_reduce`` MAX): a timed
    operation's figure is its slowest rank's. Without torch.distributed: ``values`` as they are."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def finish_rank(rank: int, status: int) -> int:
    """End a torchrun rank: tear down its default process group and return its exit code.
    Under a launcher (``STATUS_ENV`` set) rank 0 leaves ``status`` in its file and every rank
    exits 0: a failed acceptance target is the report's verdict, not a crash for torchrun to
    bury under its own failure report."""
    dist.destroy_process_group()
    if not os.environ.get(STATUS_ENV):
        return status
    if rank == 0:
        with open(os.environ[STATUS_ENV], "w") as f:
            f.write(str(status))
    return 0


def torchrun_main(argv: list[str] | None, parse_args: Callable[[list[str]], argparse.Namespace],
                  worker: Callable[[argparse.Namespace], int],
                  launch: Callable[[argparse.Namespace, list[str]], int]) -> int:
    """A torchrun benchmark's entry point: inside torchrun be one rank (``worker``), else start
    the torchrun invocations (``launch``) with these arguments."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return worker(args) if under_torchrun() else launch(args, argv)


def add_mlp_trainer_args(p: argparse.ArgumentParser) -> None:
    """The options :class:`MlpTrainer` is built from: ``--state-mib``, ``--batch``,
    ``--layers``."""
    p.add_argument("--state-mib", type=int, default=1024,
                   help="params + Adam state size in MiB (default 1024: ~89M params)")
    p.add_argument("--batch", type=int, default=320,
                   help="batch rows (default 320: a ~1.1 s step at 1 GiB on 2 cores)")
    p.add_argument("--layers", type=int, default=5, help="Linear layers (default 5)")


class MlpTrainer:
    """A CPU training job for the training-loop benchmarks (``training_stall.py``,
    ``lazy_ordering.py``): square Linear layers with ReLUs between them, fused Adam (no
    full-size temporaries, so memory stays flat between steps) and one fixed batch, sized so
    that parameters and Adam's two moments take about ``args.state_mib`` MiB.
    ``forward_backward`` and ``step`` are the two halves of a step; ``state_dict`` is what a
    save takes."""

    def __init__(self, args: argparse.Namespace):
        torch.manual_seed(0)
        n_params = args.state_mib * (1 << 20) / 4 / 3
        self.width = max(64, round(math.sqrt(n_params / args.layers) / 64) * 64)
        mods: list[torch.nn.Module] = []
        for i in range(args.layers):
            mods.append(torch.nn.Linear(self.width, self.width))
            if i < args.layers - 1:
                mods.append(torch.nn.ReLU())
        self.model = torch.nn.Sequential(*mods)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-5, fused=True)
        self.x = torch.randn(args.batch, self.width)
        self.y = torch.randn(args.batch, self.width)
        self.forward_backward()     # Adam's state exists from here on: the layout never changes
        self.step()

    def forward_backward(self) -> None:
        """Forward and backward on the fixed batch (they only read the state)."""
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()

    def step(self) -> None:
        """The optimizer step (changes every parameter and moment in place), gradients zeroed
        in place."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def state_dict(self) -> dict[str, Any]:
        """What a save takes: the model's and the optimizer's state dicts."""
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state, detached, in state-dict order: the parameters, then per
        parameter its Adam state (step, exp_avg, exp_avg_sq)."""
        out = [t.detach() for t in self.model.state_dict().values()]
        for st in self.optimizer.state.values():
            out.extend(v.detach() for v in st.values() if isinstance(v, torch.Tensor))
        return out

    @property
    def n_params(self) -> int:
        """Parameters of the model."""
        return sum(p.numel() for p in self.model.parameters())


def descendants(pids: list[int]) -> list[int]:
    """Every living descendant of ``pids`` (torchrun starts its ranks in new sessions, so a
    process-group kill would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM the torchrun invocations still running (they stop their ranks), then SIGKILL
    whatever of them and their ranks is left after a grace period."""
    alive = [p for p in procs if p.poll() is None]
    if not alive:
        return
    victims = descendants([p.pid for p in alive])
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(p.poll() is None for p in alive):
        time.sleep(0.2)
    for pid in [*victims, *(p.pid for p in alive if p.poll() is None)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in alive:
        p.wait()
