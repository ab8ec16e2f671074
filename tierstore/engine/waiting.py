"""Waiting for a store's background work: its drains, its replication and the notices that tell
other nodes of its commits (:func:`wait_for_background`), and, for ``wait(all_ranks=True)``,
every rank's first failure made known to all (:func:`raise_first_failure_of_any_rank`)."""

from __future__ import annotations

import time
from typing import Any

from tierstore.errors import DrainError, ReplicationError
from tierstore.transport.collectives import all_gather_message
from tierstore.transport.shapes import as_str, as_tuple, optional

__all__ = ["wait_for_background", "raise_first_failure_of_any_rank"]

#: the failures ``wait(all_ranks=True)`` raises, by the name another rank sends (another name,
#: from a rank running other code: a DrainError with its message)
_WAIT_FAILURES = {"DrainError": DrainError, "ReplicationError": ReplicationError,
                  "TimeoutError": TimeoutError}


def wait_for_background(drainer: Any, replicator: Any, notices: Any,
                        timeout: float | None) -> None:
    """Block until ``drainer``'s copies, ``replicator``'s transfers and ``notices`` (each may
    be None but the drainer) are done, within ``timeout`` seconds in all; raise the first
    failure (``DrainError``, ``ReplicationError``, ``TimeoutError``)."""
    deadline = None if timeout is None else time.monotonic() + timeout

    def left() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    try:
        drainer.wait(left())
    finally:
        if replicator is not None:
            replicator.wait(left())
        if notices is not None:  # nodes learn of the last commits
            notices.wait(left())


def raise_first_failure_of_any_rank(failure: BaseException | None, group: Any,
                                    rank: int) -> None:
    """Collective: every rank tells the others its ``failure`` (None when it has none); all
    raise the first rank's, if any: this rank's own exception when it is the first, else one
    of the same class rebuilt from the message sent."""
    # Each rank's failure as its class's name and message (plain data, never the exception
    # itself: unpickling one would run what the sending rank chose), and, for a DrainError,
    # which copy: the checkpoint and the tier.
    told = all_gather_message(
        None if failure is None else [
            type(failure).__name__, str(failure),
            getattr(failure, "checkpoint_id", None), getattr(failure, "tier", None)],
        group,
        optional(lambda v: as_tuple(v, as_str, as_str, optional(as_str), optional(as_str))),
        "a failure's class, message, checkpoint and tier")
    first = next(((r, t) for r, t in enumerate(told) if t is not None), None)
    if first is None:
        return
    sender, (name, message, checkpoint_id, tier) = first
    if sender == rank and failure is not None:
        raise failure
    kind = _WAIT_FAILURES.get(name, DrainError)
    if issubclass(kind, DrainError):
        raise kind(message, checkpoint_id, tier)
    raise kind(message)
