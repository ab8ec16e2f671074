"""Every node learns that a save committed, in that save.

On node-local tiers the nodes other than the coordinator's publish their part of a save before
the coordinator commits it (``tierstore.engine.publish``): the part is *pending*, and ``keep``
neither counts it nor evicts anything for it until the node learns that the commit happened.
DCP tells the other ranks nothing after the coordinator's ``finish``, so the coordinator tells
them itself: right after its commit (or its failure) it leaves a notice under the save's token
in the job's key-value store (the one torch.distributed already runs; one small key per save,
the old ones removed as saves go on). Each node's leader, once it has published a pending part,
waits for that notice in the background (:class:`CommitNotices`, a background job like drains):
a commit confirms the part at once, on the tier and on the node's slower tiers it was drained
to, and ``keep`` applies there; a failure leaves the part to the next save's settle, which
removes it as an orphan on every rank alike. A node that never hears (the coordinator died)
keeps its previous checkpoint and the part stays pending, as it would without notices; the next
save settles it.

The notice is a word from rank 0 that a node acts on only to *confirm* what it holds (remove a
marker and let ``keep`` count the part): a forged notice in a job's own store could at worst
make a node count a part whose checkpoint never committed, which ``latest()`` and loads still
judge by the coordinator's ``.metadata``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from tierstore.engine.jobs import BackgroundJob, BackgroundJobs
from tierstore.errors import DrainError
from tierstore.transport.collectives import drop_posts, post, read_post, seen_lost

__all__ = ["CommitNotices", "NoticeJob", "notice_key"]

log = logging.getLogger("tierstore.notices")

#: notices of older saves than this many are removed from the job's key-value store
NOTICES_KEPT = 16
#: what a notice says
COMMITTED, FAILED = b"1", b"0"


def notice_key(token: str) -> str:
    """The key of the notice of the save ``token`` in the job's key-value store."""
    return f"tierstore/committed/{token}"


@dataclass
class NoticeJob(BackgroundJob):
    """Wait for the notice of save ``token``, whose pending part ``checkpoint_id`` this node
    published on ``source``."""

    token: str = field(kw_only=True)


class CommitNotices(BackgroundJobs[NoticeJob]):
    """Tells the nodes that a save committed (the coordinator's side: :meth:`tell`) and
    waits, in the background, for what it is told (a node's leader: :meth:`expect`).

    ``settle(checkpoint_id, token)``: what a node does on the news of a commit (confirm its
    pending part of that save wherever it is, then apply ``keep``). ``timeout``: how long a
    node waits for a notice before it leaves the part to the next save."""

    what = "commit notices"

    def __init__(self, settle: Callable[[str, str], None], timeout: float):
        self._settle, self._timeout = settle, timeout
        self._told: list[str] = []  # the coordinator's notices, oldest first
        super().__init__("tierstore-notices")

    # -- the coordinator ----------------------------------------------------------------------
    def tell(self, token: str, committed: bool) -> None:
        """The coordinator committed (or failed to commit) the save ``token``: tell every node.
        Best effort: a node that does not hear settles its part at the next save."""
        try:
            if not post(notice_key(token), COMMITTED if committed else FAILED):
                return  # one process, no job: nobody to tell
        except Exception:  # noqa: BLE001 - the next save's settle tells them instead
            log.warning("could not tell the other nodes that save %s %s", token,
                        "committed" if committed else "failed", exc_info=True)
            return
        self._told.append(token)
        if len(self._told) > NOTICES_KEPT:
            old, self._told = self._told[:-NOTICES_KEPT], self._told[-NOTICES_KEPT:]
            drop_posts([notice_key(t) for t in old])

    # -- a node's leader ------------------------------------------------------------------------
    def expect(self, job: NoticeJob) -> None:
        """Wait in the background for the notice of ``job``'s save."""
        self.submit(job)

    def protected(self, tier):  # noqa: D102 - reads nothing (Publisher spares pending parts)
        return set()

    def run_job(self, job: NoticeJob) -> None:
        # A node that cannot settle now settles at the next save: never a failure of wait().
        try:
            self._await(job)
        except Exception:  # noqa: BLE001
            log.warning("settling the part of %s after its commit failed; the next save "
                        "settles it", job.checkpoint_id, exc_info=True)

    def _await(self, job: NoticeJob) -> None:
        key = notice_key(job.token)
        deadline = time.monotonic() + self._timeout
        delay = 0.005
        while (said := read_post(key)) is None:
            if seen_lost(None, [0]):  # the coordinator failed a collective: no word will come
                return
            if time.monotonic() > deadline:
                log.info("no word of the commit of %s (save %s) within %.0f s; its part stays "
                         "pending until the next save settles it", job.checkpoint_id,
                         job.token, self._timeout)
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        if said == COMMITTED:
            self._settle(job.checkpoint_id, job.token)

    def failure(self, job: NoticeJob, exc: BaseException) -> DrainError:
        return DrainError(f"waiting for word of the commit of {job.checkpoint_id} was "
                          f"interrupted: {type(exc).__name__}: {exc}", job.checkpoint_id, None)
