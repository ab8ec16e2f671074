"""Checkpoint ids: validation and the step number that `every` is counted on."""

from __future__ import annotations

import re

__all__ = ["validate_checkpoint_id", "is_valid_checkpoint_id", "step_of"]

_ID_RE = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9._\-]*")
# Room for the hidden staging name (".tierstore-tmp.<id>.<token>") within a 255-byte file name.
MAX_ID_LENGTH = 200
_TRAILING_INT = re.compile(r"(\d+)$")


def validate_checkpoint_id(checkpoint_id: object) -> str:
    """Return ``checkpoint_id`` as a str, or raise ``ValueError`` saying what is allowed.

    An id is one path segment: letters, digits, ``.``, ``_``, ``-``, not starting with ``.``.
    """
    if checkpoint_id is None:
        raise ValueError(
            "checkpoint_id is required: pass checkpoint_id='step-100' (one path segment) "
            "to dcp.save / dcp.load with a tierstore writer or reader"
        )
    text = str(checkpoint_id)
    if not _ID_RE.fullmatch(text):
        raise ValueError(
            f"invalid checkpoint id {text!r}: an id is one path segment made of letters, digits, "
            "'.', '_' and '-', not starting with '.' (for example 'step-100')"
        )
    if len(text) > MAX_ID_LENGTH:
        raise ValueError(
            f"invalid checkpoint id {text[:20]!r}...: {len(text)} characters, at most "
            f"{MAX_ID_LENGTH} are allowed"
        )
    return text


def is_valid_checkpoint_id(checkpoint_id: object) -> bool:
    """Whether ``checkpoint_id`` is acceptable (DCP's ``validate_checkpoint_id`` protocol)."""
    try:
        validate_checkpoint_id(checkpoint_id)
    except ValueError:
        return False
    return True


def step_of(checkpoint_id: str) -> int | None:
    """The trailing integer of an id (``step-100`` -> 100), or None when it has none."""
    match = _TRAILING_INT.search(checkpoint_id)
    return int(match.group(1)) if match else None
