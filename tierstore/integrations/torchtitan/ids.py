"""torchtitan's checkpoint names and tierstore's checkpoint ids, one to one.

torchtitan names a checkpoint ``<checkpoint.folder>/step-<N>``; in the store it is the id
``step-<N>`` (one path segment, as tierstore's ids are), whose trailing integer is the step that
each tier's ``every`` is counted on. Everything torchtitan still writes as files (Hugging Face
exports, torchft's per-replica side checkpoints) keeps its path, which is never a store id.
"""

from __future__ import annotations

import re

__all__ = ["checkpoint_id", "step_of", "is_store_id"]

_STEP_ID = re.compile(r"step-(\d+)")


def checkpoint_id(step: int) -> str:
    """The store id of torchtitan's checkpoint of ``step``: ``step-<step>``."""
    return f"step-{int(step)}"


def step_of(checkpoint_id: str) -> int | None:
    """The step of a ``step-<N>`` id; None for an id torchtitan did not name."""
    match = _STEP_ID.fullmatch(checkpoint_id)
    return int(match.group(1)) if match else None


def is_store_id(checkpoint_id: object) -> bool:
    """Whether a ``checkpoint_id`` torchtitan hands to ``dcp_save``/``dcp_load`` is one of the
    store's (``step-<N>``), not the path of a checkpoint in files."""
    return isinstance(checkpoint_id, str) and step_of(checkpoint_id) is not None
