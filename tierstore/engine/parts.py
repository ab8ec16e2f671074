"""Pending parts of node-local tiers (see tierstore.engine.publish): the marker a part carries
while its checkpoint's commit is not known, shared by the publisher, which marks a part, and the
drain, which carries the mark to the part's copies on the node's slower tiers; and what this
process knows was committed (:class:`KnownCommits`), which settles them."""

from __future__ import annotations

import threading
from collections import OrderedDict

from tierstore.tiers.tier import Tier

__all__ = ["PENDING_PART", "is_pending", "unmark", "KnownCommits"]

#: in the directory of a node-local part published before its checkpoint's commit was known
PENDING_PART = ".tierstore-part-pending"


def is_pending(tier: Tier, checkpoint_id: str) -> bool:
    """Whether ``checkpoint_id`` on ``tier`` is a pending part."""
    return tier.stored_size(f"{checkpoint_id}/{PENDING_PART}") is not None



def unmark(tier: Tier, checkpoint_id: str) -> None:
    """``checkpoint_id`` on ``tier`` is no longer pending: its checkpoint is known committed."""
    try:
        tier.backend.delete(f"{checkpoint_id}/{PENDING_PART}")
    except FileNotFoundError:
        pass


class KnownCommits:
    """The saves this process knows the coordinator committed: ``(checkpoint id, save token)``
    pairs, the newest ``limit`` of them. The coordinator's own commits and those it told the
    nodes of (``tierstore.engine.notices``) are recorded here; the publisher settles pending
    parts by it, and a drain that carried a part's marker to a slower tier removes it when the
    commit is known by then."""

    def __init__(self, limit: int = 4096):
        self._limit = limit
        self._tokens: OrderedDict[str, set[str]] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, checkpoint_id: str, token: str) -> None:
        """``checkpoint_id`` was committed by the save ``token``."""
        with self._lock:
            self._tokens.setdefault(checkpoint_id, set()).add(token)
            self._tokens.move_to_end(checkpoint_id)
            while len(self._tokens) > self._limit:
                self._tokens.popitem(last=False)

    def knows(self, checkpoint_id: str, token: str) -> bool:
        """Whether ``checkpoint_id`` is known committed by the save ``token``."""
        with self._lock:
            return token in self._tokens.get(checkpoint_id, ())
