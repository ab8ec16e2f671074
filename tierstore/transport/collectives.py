"""Where this process sits in the job (rank, node) and the store's own collectives.

What ranks exchange travels as typed messages (:mod:`tierstore.transport.messages`), never as
pickles: unpickling what another rank sent would run whatever code that rank chose. There is
no pickling collective here on purpose (``torch.distributed``'s ``*_object`` functions); a
check in the suite keeps it so.

Everything here works without torch.distributed: a single process is rank 0 of 1 on node 0.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, TypeVar

from tierstore.errors import RanksLostError
from tierstore.transport.messages import MessageError, decode_message, encode_message

__all__ = ["MaxInFlight", "start_all_reduce_max", "stop_roll_calls_when", "RankContext", "rank_context", "make_store_group",
           "all_gather_message", "broadcast_message", "broadcast_with_bytes", "barrier",
           "all_reduce_max", "peers_lost",
           "seen_lost", "post", "read_post", "all_posted", "drop_posts"]

log = logging.getLogger("tierstore.collectives")
T = TypeVar("T")

#: how long a rank whose collective failed waits for the others to say they are still there
_ROLL_CALL_S = 30.0

#: ``torch.distributed``, once something here needs it (:func:`_dist`): its import takes
#: seconds, which a process outside any job (``tierstore ls``) never has to wait for
dist: Any = None


def _dist() -> Any:
    """``torch.distributed``, imported on first use. (Callers bind it to a local ``dist``,
    so that what they call on it reads, and is checked, as a call of torch.distributed.)"""
    global dist
    if dist is None:
        import torch.distributed

        dist = torch.distributed
    return dist


def _initialized() -> bool:
    """Whether torch.distributed has a default process group here. A process that never
    imported torch.distributed cannot have one, and is told so without importing it."""
    if dist is None and "torch.distributed" not in sys.modules:
        return False
    module = _dist()
    return module.is_available() and module.is_initialized()


@dataclass(frozen=True)
class RankContext:
    """Rank, local rank, node index (torchrun's GROUP_RANK), world size of this process, and how
    many ranks share its node (torchrun's LOCAL_WORLD_SIZE)."""

    rank: int = 0
    local_rank: int = 0
    node: int = 0
    world_size: int = 1
    local_world_size: int = 1

    def cpu_share(self) -> int:
        """The CPUs this process may use, divided among the ranks of its node (at least 1): how
        many threads of CPU-bound work (checking and copying bytes) it can run without taking
        time from the other ranks."""
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cpus = os.cpu_count() or 1
        return max(1, cpus // max(1, self.local_world_size))

    def placeholders(self) -> dict[str, int]:
        """Values for ``{rank}``, ``{local_rank}`` and ``{node}`` in tier paths."""
        return {"rank": self.rank, "local_rank": self.local_rank, "node": self.node}


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def rank_context(process_group: Any = None) -> RankContext:
    """The context of this process, from torch.distributed when initialized, else from torchrun's
    environment variables, else rank 0 of 1."""
    if _initialized():
        dist = _dist()
        rank = dist.get_rank(process_group)
        world = dist.get_world_size(process_group)
    else:
        rank = _env_int("RANK", 0)
        world = _env_int("WORLD_SIZE", 1)
    return RankContext(rank=rank, local_rank=_env_int("LOCAL_RANK", 0),
                       node=_env_int("GROUP_RANK", 0), world_size=world,
                       local_world_size=_env_int("LOCAL_WORLD_SIZE", 1))


def make_store_group(process_group: Any = None, timeout: float | None = None) -> Any:
    """A gloo group for the store's own collectives (None without torch.distributed); its
    collectives fail after ``timeout`` seconds (``[store] collective_timeout``) instead of
    waiting for a dead or hung rank for ever.

    Collective: every rank must call it (``tierstore.open`` is called on every rank). A group of
    its own keeps checkpoint collectives, which may run in background threads, from interleaving
    with the training's collectives on the default group.
    """
    if not _initialized():
        return None
    dist = _dist()
    ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
    group = dist.new_group(ranks=ranks, backend="gloo",
                           timeout=None if timeout is None else timedelta(seconds=timeout))
    if timeout is not None and group is not None:
        _timeouts[getattr(group, "group_name", "")] = timeout
    return group


# Every rank calls a group's collectives in the same order, so the n-th collective of a group
# is the same call on every rank: a failed one is named by (group, n) in the roll call.
_counters: dict[str, itertools.count] = {}
_timeouts: dict[str, float] = {}
_counters_lock = threading.Lock()
#: global ranks this process has seen fail a collective or an exchange of the store: a fact
#: about the job (a lost rank does not come back in this process's lifetime), so that work
#: waiting on one of them, such as a drain at exit waiting for its part, stops waiting
_lost: set[int] = set()
#: checks that say this process is being stopped (a preemption handler that recorded SIGTERM):
#: then no roll call, in any thread, spends the rest of its time naming ranks
_stopping: list[Callable[[], bool]] = []


def stop_roll_calls_when(check: Callable[[], bool]) -> Callable[[], None]:
    """While ``check()`` is true, every roll call of this process ends at once (see
    :func:`_roll_call`): a process told to stop must not spend its grace period, in a save's
    thread, naming the ranks a failed collective lost. Returns what unregisters it."""
    _stopping.append(check)
    return lambda: _stopping.remove(check) if check in _stopping else None


def _told_to_stop(stop: Callable[[], bool] | None) -> bool:
    return bool(stop and stop()) or any(check() for check in list(_stopping))


def seen_lost(group: Any, ranks: list[int]) -> list[int]:
    """Which of ``ranks`` (ranks of ``group``; None: global ranks) this process has seen fail
    a collective or an exchange of the store."""
    if not _lost:
        return []
    if group is None or not _initialized():
        return [r for r in ranks if r in _lost]
    dist = _dist()
    return [r for r in ranks if dist.get_global_rank(group, r) in _lost]


def _next_call(group: Any) -> int:
    name = getattr(group, "group_name", str(id(group)))
    with _counters_lock:
        counter = _counters.setdefault(name, itertools.count())
        return next(counter)


def _collective(group: Any, what: str, run: Callable[[], T],
                stop: Callable[[], bool] | None = None) -> T:
    """Run one collective of ``group``; turn its failure (a rank died, or did not come within
    the group's timeout) into a :class:`RanksLostError` naming the ranks that did not answer.
    ``stop``: when it turns true, naming them is given up (see :func:`_roll_call`)."""
    call = _next_call(group)
    try:
        return run()
    except Exception as exc:  # gloo reports a lost peer or a timeout as a RuntimeError
        missing = _roll_call(group, call, stop)
        _lost.update(missing or ())
        who = (f"rank(s) {missing} did not answer" if missing
               else "no rank is known to be missing (the collective itself failed)")
        # Logged too: when DCP's own collectives fail next, its error replaces this one.
        dist = _dist()
        log.error("rank %d: %s failed: %s (%s)", dist.get_rank(), what, who, exc)
        raise RanksLostError(
            f"{what} failed: {who} ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}). "
            f"A rank died or hung (see [store] collective_timeout); the last committed "
            f"checkpoint is intact: restart the job") from exc


def peers_lost(group: Any, peers: list[int], what: str, exc: BaseException) -> RanksLostError:
    """The error of a point-to-point exchange with ``peers`` (ranks of ``group``) that failed:
    one of them died or did not take part within the group's timeout."""
    names = peers
    if group is not None:
        dist = _dist()
        names = sorted({dist.get_global_rank(group, p) for p in peers})
    if len(names) == 1:  # the only peer of the exchange: it is the one lost
        _lost.update(names)
    return RanksLostError(
        f"{what} failed: one of rank(s) {names} did not answer ({type(exc).__name__}: "
        f"{str(exc).splitlines()[0][:300] if str(exc) else ''}). A rank died or hung (see "
        f"[store] collective_timeout); the last committed checkpoint is intact: restart the job")


def _roll_call(group: Any, call: int, stop: Callable[[], bool] | None = None
               ) -> list[int] | None:
    """Global ranks of ``group`` that did not report the failure of its ``call``-th collective
    within ``_ROLL_CALL_S`` (or the group's timeout, if shorter), through the job's key-value
    store (torchrun's, or the one init_process_group made). None when that store is out of
    reach. A dead rank never answers, so the roll call waits its whole time: ``stop`` ends it
    early, naming the ranks not heard of so far (a process told to stop, by SIGTERM under a
    preemption handler, must not spend its grace period naming them)."""
    try:
        dist = _dist()
        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank(group)
        world = dist.get_world_size(group)
        name = getattr(group, "group_name", "group")
        key = f"tierstore/collective-failed/{name}/{call}"
        store.set(f"{key}/{me}", "1")
        deadline = time.monotonic() + min(_ROLL_CALL_S, _timeouts.get(name, _ROLL_CALL_S))
        while True:
            present = [r for r in range(world) if store.check([f"{key}/{r}"])]
            if len(present) == world or time.monotonic() > deadline or _told_to_stop(stop):
                break
            time.sleep(0.1)
        return [dist.get_global_rank(group, r) for r in range(world) if r not in present]
    except Exception as exc:  # noqa: BLE001 - naming is best effort; the failure stands
        log.debug("could not tell which ranks are missing: %s", exc)
        return None


def _read(read: Callable[[Any], Any] | None, value: Any, sender: str, what: str) -> Any:
    """``read(value)``: a message from ``sender`` as its exchange expects it. A value of
    another shape is a :class:`MessageError` naming the sender, never a crash further on."""
    if read is None:
        return value
    try:
        return read(value)
    except MessageError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise MessageError(f"{sender} sent a message that is not {what} ({exc}); every rank of "
                           f"a job must run the same tierstore") from None


def broadcast_message(obj: Any, group: Any, src_group_rank: int = 0,
                      read: Callable[[Any], Any] | None = None,
                      what: str = "what was expected") -> Any:
    """Rank ``src_group_rank``'s ``obj`` (plain data: :func:`~tierstore.transport.messages.
    encode_message`) on every rank, as a typed message, never a pickle: its length, then its
    bytes. ``obj`` itself without a group. ``read`` rebuilds what the exchange expects from
    the message on every rank (see :mod:`tierstore.transport.shapes`): a message it
    refuses raises :class:`MessageError` naming the sender (``what``: what was expected)."""
    got, _ = broadcast_with_bytes(obj, None, group, src_group_rank, read, what)
    return got


def broadcast_with_bytes(obj: Any, data: bytes | None, group: Any, src_group_rank: int = 0,
                         read: Callable[[Any], Any] | None = None,
                         what: str = "what was expected") -> tuple[Any, bytes | None]:
    """:func:`broadcast_message` of ``obj`` with ``data`` (bytes, or None) beside it, as they
    are (bytes inside a message travel in base64, a third larger). Two collectives, as for a
    message alone: both lengths, then both in one buffer. Returns ``(obj, data)``."""
    if group is None:
        return _read(read, obj, "this rank", what), data
    import torch

    dist = _dist()
    src = dist.get_rank(group) == src_group_rank
    raw = encode_message(obj) if src else b""
    blob = (data or b"") if src else b""
    size = torch.tensor([len(raw), -1 if data is None else len(blob)] if src else [0, 0],
                        dtype=torch.int64)
    sender = f"rank {src_group_rank}"
    where = f"receiving from rank {src_group_rank} of the group"
    _collective(group, where, lambda: dist.broadcast(size, group=group, group_src=src_group_rank))
    n_raw, n_blob = int(size[0].item()), int(size[1].item())
    if n_raw < 0 or n_blob < -1:
        raise MessageError(f"{sender} sent a message of {n_raw} bytes with {n_blob} beside it; "
                           f"every rank of a job must run the same tierstore")
    if src:
        buf = (torch.frombuffer(bytearray(raw + blob), dtype=torch.uint8) if raw or blob
               else torch.empty(0, dtype=torch.uint8))
    else:
        buf = torch.empty(n_raw + max(n_blob, 0), dtype=torch.uint8)
    if buf.numel():
        _collective(group, where, lambda: dist.broadcast(buf, group=group,
                                                         group_src=src_group_rank))
    if src:  # read too: every rank gets the same kind of value back
        return _read(read, obj, "this rank", what), data
    got = buf.numpy().tobytes()
    return (_read(read, decode_message(got[:n_raw], sender), sender, what),
            None if n_blob < 0 else got[n_raw:])


def all_gather_message(obj: Any, group: Any, read: Callable[[Any], Any] | None = None,
                       what: str = "what was expected") -> list[Any]:
    """Every rank's ``obj`` (plain data: :func:`~tierstore.transport.messages.encode_message`)
    in rank order, as typed messages, never pickles; ``[obj]`` without a group. Two
    collectives: the lengths, then the messages padded to the longest (so keep them small and
    of like size: what one rank sends long, every rank receives N times). ``read`` rebuilds
    what the exchange expects from each message, this rank's own too (see
    :mod:`tierstore.transport.shapes`): a message it refuses raises :class:`MessageError`
    naming the rank that sent it (``what``: what was expected)."""
    if group is None:
        return [_read(read, obj, "this rank", what)]
    import torch

    dist = _dist()
    raw = encode_message(obj)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    where = "gathering from every rank"
    _collective(group, where, lambda: dist.all_gather(
        sizes, torch.tensor([len(raw)], dtype=torch.int64), group=group))
    lengths = [int(t.item()) for t in sizes]
    bad = [r for r, n in enumerate(lengths) if n < 0]
    if bad:
        raise MessageError(f"rank {bad[0]} sent a message of {lengths[bad[0]]} bytes; every "
                           f"rank of a job must run the same tierstore")
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if raw:
        mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    _collective(group, where, lambda: dist.all_gather(bufs, mine, group=group))
    return [_read(read, decode_message(buf[:n].numpy().tobytes(), f"rank {r}"), f"rank {r}",
                  what) for r, (buf, n) in enumerate(zip(bufs, lengths))]


def all_reduce_max(value: int, group: Any, stop: Callable[[], bool] | None = None) -> int:
    """The largest ``value`` of every rank of ``group`` (``value`` itself without a group).
    ``stop``: see :func:`_collective`."""
    if group is None:
        return value
    import torch

    dist = _dist()
    flag = torch.tensor([value], dtype=torch.int64)
    _collective(group, "agreeing with every rank",
                lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group), stop)
    return int(flag.item())


class MaxInFlight:
    """An all-reduce (max) started and not waited for (:func:`start_all_reduce_max`): it runs
    while the caller works, and :meth:`result` collects it."""

    def __init__(self, flag: Any, work: Any, group: Any):
        self._flag, self._work, self._group = flag, work, group

    def result(self, stop: Callable[[], bool] | None = None) -> int:
        """Wait for it (normally done already); a lost rank raises :class:`RanksLostError`,
        as :func:`all_reduce_max` does. ``stop``: see :func:`_collective`."""
        if self._work is not None:
            work, self._work = self._work, None
            _collective(self._group, "agreeing with every rank", work.wait, stop)
        return int(self._flag.item())

    def settle(self, seconds: float) -> bool:
        """Wait at most ``seconds`` for it and drop its outcome; whether it ended (every rank
        started it a step or more ago, so it has ended unless a rank is gone or stopped)."""
        work, self._work = self._work, None
        if work is None:
            return True
        try:
            return bool(work.wait(timedelta(seconds=seconds)))
        except Exception:  # noqa: BLE001 - a lost rank: the caller is ending anyway
            log.debug("an agreement in flight did not end", exc_info=True)
            return False


def start_all_reduce_max(value: int, group: Any) -> MaxInFlight:
    """:func:`all_reduce_max` without waiting: every rank starts it at the same point of its
    work, and collects it later with :meth:`MaxInFlight.result` (so that the collective's
    latency is hidden behind that work instead of stalling it)."""
    import torch

    flag = torch.tensor([value], dtype=torch.int64)
    if group is None:
        return MaxInFlight(flag, None, None)
    dist = _dist()
    try:
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
    except Exception as exc:  # noqa: BLE001 - a peer already gone: result() names it
        work = _FailedWork(exc)
    return MaxInFlight(flag, work, group)


class _FailedWork:
    """A collective that could not start: its wait raises what starting it raised."""

    def __init__(self, exc: Exception):
        self._exc = exc

    def wait(self, *args: Any) -> None:
        raise self._exc


def barrier(group: Any) -> None:
    """Wait for every rank of ``group`` (nothing without a group)."""
    if group is not None:
        dist = _dist()
        _collective(group, "waiting for every rank", lambda: dist.barrier(group=group))


# -- posts: bytes one rank leaves for another in the job's key-value store ----------------------
#
# For work that is not paired across ranks the way collectives are (background drains, which
# each rank runs on its own schedule): the reader polls for the key, and gives up on its own
# terms (a deadline, a rank seen lost). Values are small (a few MB at most) and removed by the
# rank that consumes them last.

def _job_store() -> Any:
    """The job's key-value store (torchrun's, or the one init_process_group made); None
    without torch.distributed."""
    if not _initialized():
        return None
    dist = _dist()
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store to reach: the caller says what that means
        log.debug("the job's key-value store is out of reach", exc_info=True)
        return None


def post(key: str, data: bytes) -> bool:
    """Leave ``data`` under ``key`` for another rank (:func:`read_post`), replacing what was
    there; False when there is no job key-value store to leave it in."""
    store = _job_store()
    if store is None:
        return False
    store.set(key, data)
    return True


def read_post(key: str) -> bytes | None:
    """What a rank left under ``key``; None while nothing is there (or without a store).
    Never blocks for it: the caller polls, with its own deadline."""
    store = _job_store()
    if store is None or not store.check([key]):
        return None
    return bytes(store.get(key))


def all_posted(keys: list[str]) -> bool | None:
    """Whether every key of ``keys`` holds a post; None without a job key-value store (the
    caller finds out another way). Never blocks: a blocking wait would hold the process's one
    connection to the store, and every other thread's use of it, until it ends."""
    store = _job_store()
    if store is None:
        return None
    return bool(store.check(keys))


def drop_posts(keys: list[str]) -> None:
    """Remove ``keys`` (consumed: nobody reads them again); best effort."""
    store = _job_store()
    if store is None:
        return
    for key in keys:
        try:
            store.delete_key(key)
        except Exception:  # noqa: BLE001 - a store without deletes keeps a few small values
            log.debug("could not remove %s from the job's key-value store", key, exc_info=True)
