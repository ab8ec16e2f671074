"""Pending parts of node-local tiers (see tierstore.engine.publish): the marker a part carries
while its checkpoint's commit is not known, shared by the publisher, which marks a part, and the
drain, which carries the mark to the part's copies on the node's slower tiers."""

from __future__ import annotations

from tierstore.tiers.tier import Tier

__all__ = ["PENDING_PART", "is_pending"]

#: in the directory of a node-local part published before its checkpoint's commit was known
PENDING_PART = ".tierstore-part-pending"


def is_pending(tier: Tier, checkpoint_id: str) -> bool:
    """Whether ``checkpoint_id`` on ``tier`` is a pending part."""
    return tier.stored_size(f"{checkpoint_id}/{PENDING_PART}") is not None
