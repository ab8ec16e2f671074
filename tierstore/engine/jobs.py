"""The base of the store's background work (drains, replication): one thread running jobs in
submission order, the list of jobs not finished, their failures for ``wait()``, and what
retention must spare while a job still reads its source."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

from tierstore.errors import DrainError, ReplicationError
from tierstore.tiers.tier import Tier

__all__ = ["BackgroundJob", "BackgroundJobs"]

log = logging.getLogger("tierstore.jobs")


@dataclass
class BackgroundJob:
    """One job: work on ``checkpoint_id``, read from tier ``source``."""

    checkpoint_id: str
    source: Tier
    #: the job no longer reads ``source``: retention may evict the checkpoint there again
    released: bool = field(default=False, kw_only=True)


J = TypeVar("J", bound=BackgroundJob)


def wait_until_empty(cond: threading.Condition, pending: list, timeout: float | None,
                     message: Callable[[], str]) -> None:
    """With ``cond`` held: wait until ``pending`` is empty (its owner notifies ``cond`` when it
    shrinks); ``TimeoutError(message())`` after ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError(message())
        cond.wait(left)


class BackgroundJobs(Generic[J]):
    """A thread running jobs one after the other. Subclasses implement :meth:`run_job` (raise
    to fail the whole job, or call :meth:`record_failure` for a part of it) and
    :meth:`after_job` (runs once the job released its source, before ``wait`` returns)."""

    #: what the jobs do, for messages ("drains", "replication")
    what = "background jobs"

    def __init__(self, thread_name: str):
        self._jobs: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._pending: list[J] = []
        self._failures: list[DrainError] = []
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    # -- called by the store and the writer ---------------------------------------------------
    def submit(self, job: J) -> None:
        """Queue a job; returns at once."""
        with self._cond:
            self._pending.append(job)
        self._jobs.put(job)

    def protected(self, tier: Tier) -> set[str]:
        """Ids retention must not evict from ``tier`` yet: jobs still read them there."""
        with self._cond:
            return {j.checkpoint_id for j in self._pending if j.source is tier and not j.released}

    def pending_jobs(self) -> list[J]:
        """Jobs not finished, in order."""
        with self._cond:
            return list(self._pending)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued job is done; raise the first failure since the last call
        (naming how many more there were)."""
        with self._cond:
            wait_until_empty(self._cond, self._pending, timeout,
                             lambda: f"{self.what} still running after {timeout} s: "
                             + ", ".join(self.describe_pending()))
            failures, self._failures = self._failures, []
        if not failures:
            return
        first = failures[0]
        if len(failures) > 1:
            others = "; ".join(str(f) for f in failures[1:])
            kind = ReplicationError if isinstance(first, ReplicationError) else DrainError
            raise kind(f"{first} (and {len(failures) - 1} more: {others})",
                       first.checkpoint_id, first.tier) from first
        raise first

    def unreported_failures(self) -> list[DrainError]:
        """Failures no ``wait()`` has raised yet."""
        with self._cond:
            return list(self._failures)

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread (after ``wait``), waiting up to ``timeout`` seconds for it to end."""
        self._jobs.put(None)
        self._thread.join(timeout)

    # -- for subclasses -----------------------------------------------------------------------
    def run_job(self, job: J) -> None:
        """Do the job (in the jobs' thread)."""
        raise NotImplementedError

    def failure(self, job: J, exc: BaseException) -> DrainError:
        """The error ``wait()`` raises for ``exc`` escaping :meth:`run_job`."""
        raise NotImplementedError

    def after_job(self, job: J) -> None:
        """Runs once ``job`` released its source, before it leaves the pending list."""

    def describe_pending(self) -> list[str]:
        """The jobs not finished, in words (for the timeout message)."""
        with self._cond:
            return [j.checkpoint_id for j in self._pending]

    def record_failure(self, err: DrainError) -> None:
        """Keep ``err`` for the next ``wait()``."""
        with self._cond:
            self._failures.append(err)

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self.run_job(job)
            except BaseException as exc:  # reported through wait()
                log.exception("%s of %s failed", self.what, job.checkpoint_id)
                self.record_failure(self.failure(job, exc))
            finally:
                with self._cond:
                    job.released = True
                try:
                    self.after_job(job)
                finally:
                    with self._cond:
                        self._pending.remove(job)
                        self._cond.notify_all()
