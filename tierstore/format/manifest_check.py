"""Checking a manifest read from a tier before anything trusts it.

A manifest is untrusted input (another job, a person or a bit flip may have changed it). Two
checks, in this order:

- its *seal*: a checksum over everything else in it (file names, sizes, checksums, spans,
  codecs, the id, part and rank fields, ...), so that no single changed field goes unnoticed.
  Unsigned, it guards against corruption and careless edits, not against someone who
  recomputes it; signed (``tierstore.format.signing``), it is a MAC nobody without the key can
  make. The data files are checked against the digests it lists either way;
- the shape and range of every field, so that nothing malformed reaches a reader, a drain or a
  tensor: each problem is named by its field.

Both raise :class:`ManifestError` (an ``IntegrityError``): the copy is treated as corrupt.
Every value a tier can put in a manifest (a wrong type, NaN, a number past what a file, a rank
or a clock can be, a string that is not Unicode) gives that one error, so that a reader skips
exactly that checkpoint and never the tier that holds it.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from tierstore.format.checksum import ALGORITHM, KEYED_ALGORITHM, KEYED_PREFIX, checksum_of
from tierstore.format.ids import is_valid_checkpoint_id
from tierstore.format.paths import is_plain_file_name
from tierstore.errors import IntegrityError

__all__ = ["ManifestError", "SEAL_KEY", "CHECKSUM_PATTERN", "MAX_INT", "canonical_fields",
           "seal_of", "check_fields", "check_entry"]


SEAL_KEY = "seal"
#: the largest size, offset or step a manifest may hold: a file offset's range (off_t)
MAX_INT = 2 ** 63 - 1
#: the most ranks (world_size, parts) a manifest may name: readers build a set of every rank
MAX_RANKS = 2 ** 20
#: the latest time (seconds since 1970, year 5138) ``created``/``committed`` may be: one the
#: command line can still print as a date
MAX_TIME = 1e11
_KEY_ID = re.compile(r"[0-9a-f]{16}")
_CHECKSUM = re.compile(rf"^(?:{ALGORITHM}:[0-9a-f]{{32}}|{KEYED_PREFIX}[0-9a-f]{{16}}:[0-9a-f]{{64}})$")
#: a file digest as a manifest (or a recipe) writes it
CHECKSUM_PATTERN = _CHECKSUM


class ManifestError(IntegrityError, ValueError):
    """A manifest that cannot be parsed, fails its seal, or has a field of the wrong shape;
    the message names the field."""


def canonical_fields(fields: dict[str, Any]) -> bytes:
    """The bytes a seal or MAC covers: every field but the seal, in one canonical JSON form so
    that any writer gets the same bytes for the same fields."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"),
                      allow_nan=False).encode()


def seal_of(fields: dict[str, Any]) -> str:
    """The unsigned seal of a manifest's fields (everything but the seal itself)."""
    return checksum_of(canonical_fields(fields))


def _fail(field: str, what: str, value: Any) -> ManifestError:
    return ManifestError(f"field '{field}' {what} (got {_short(value)})")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: Any, low: int = 0, high: int = MAX_INT) -> bool:
    return type(value) is int and low <= value <= high


def _int(data: dict, field: str, low: int = 0, *, high: int = MAX_INT,
         optional: bool = False) -> None:
    value = data.get(field)
    if value is None and optional:
        return
    if not _is_int(value, low, high):
        raise _fail(field, f"must be an integer from {low} to {high}", value)


def _is_text(value: Any) -> bool:
    """A str that is valid Unicode: JSON's ``\\ud800`` escapes make lone surrogates, which no
    file name, message or terminal can take."""
    if type(value) is not str:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _str(data: dict, field: str) -> None:
    if not _is_text(data.get(field)):
        raise _fail(field, "must be a string (valid Unicode)", data.get(field))


def check_entry(name: str, entry: Any) -> None:
    """Check one file entry (``files.<name>`` of a manifest, as JSON values): ManifestError
    naming the field that is out of shape. Also what rebuilds an entry another rank sent."""
    where = f"files.{name}"
    if not isinstance(entry, dict):
        raise _fail(where, "must be a table", entry)
    size = entry.get("size")
    if not _is_int(size):
        raise _fail(f"{where}.size", f"must be an integer from 0 to {MAX_INT}", size)
    checksum = entry.get("checksum")
    if not isinstance(checksum, str) or not _CHECKSUM.fullmatch(checksum):
        raise _fail(f"{where}.checksum", f"must be '{ALGORITHM}:<32 hex digits>' or "
                    f"'{KEYED_PREFIX}<key id>:<64 hex digits>'", checksum)
    rank = entry.get("rank")
    if rank is not None and not _is_int(rank, 0, MAX_RANKS - 1):
        raise _fail(f"{where}.rank", f"must be a rank (integer from 0 to {MAX_RANKS - 1}) or "
                    f"null", rank)
    _check_blocks(where, entry, size, checksum)
    _check_cuts(where, entry.get("cuts"), size)
    spans = entry.get("spans")
    if spans is None:
        return
    if not isinstance(spans, list):
        raise _fail(f"{where}.spans", "must be a list of [item offset, offset, length]", spans)
    for span in spans:
        if not isinstance(span, list) or len(span) != 3 or not all(_is_int(v) for v in span):
            raise _fail(f"{where}.spans", "must hold [item offset, offset, length] triples of "
                        "integers >= 0", span)
        if span[1] + span[2] > entry["size"] or span[0] > entry["size"]:
            raise _fail(f"{where}.spans", f"reach past the file's {entry['size']} bytes", span)


def _check_cuts(where: str, cuts: Any, size: int) -> None:
    """``cuts``: absent, or the offsets where the file's items start, ascending from 0."""
    if cuts is None:
        return
    if (not isinstance(cuts, list) or not all(_is_int(c, 0, max(size - 1, 0)) for c in cuts)
            or (cuts and cuts[0] != 0)
            or any(b <= a for a, b in zip(cuts, cuts[1:]))):
        raise _fail(f"{where}.cuts", "must list ascending offsets inside the file, from 0",
                    cuts if not isinstance(cuts, list) else f"{len(cuts)} entries")


def _check_blocks(where: str, entry: dict, size: int, checksum: str) -> None:
    """``block_bytes`` and ``blocks``: absent, or one digest of the file checksum's kind per
    block of the file."""
    block_bytes, blocks = entry.get("block_bytes", 0), entry.get("blocks")
    if not _is_int(block_bytes):
        raise _fail(f"{where}.block_bytes", f"must be an integer from 0 to {MAX_INT}",
                    block_bytes)
    if blocks is None:
        return
    if not block_bytes:
        raise _fail(f"{where}.block_bytes", "must be above 0 where blocks are listed",
                    block_bytes)
    count = -(-size // block_bytes)
    if not isinstance(blocks, list) or len(blocks) != count:
        raise _fail(f"{where}.blocks", f"must list {count} digests (one per {block_bytes} "
                    f"bytes of the file's {size})", blocks if not isinstance(blocks, list)
                    else f"{len(blocks)} entries")
    kind = checksum.split(":", 1)[0]
    # One match over all of them (a file lists up to a few hundred): the digest by digest
    # check below runs only to name the one that is wrong.
    pattern, length = _blocks_of(kind)
    if all(isinstance(d, str) and len(d) == length for d in blocks) and pattern.fullmatch(
            "\n".join(blocks) + "\n"):
        return
    for digest in blocks:
        if (not isinstance(digest, str) or not _CHECKSUM.fullmatch(digest)
                or digest.split(":", 1)[0] != kind):
            raise _fail(f"{where}.blocks", f"must hold digests of the file checksum's kind "
                        f"('{kind}:...')", digest)


@functools.lru_cache(maxsize=16)
def _blocks_of(kind: str) -> tuple[re.Pattern, int]:
    """Digests of ``kind`` (the prefix before ':' of a checksum this module accepted), each
    followed by a newline; and the length of one digest (every one is checked to have it
    first, so that no newline inside one can pass for the separator)."""
    hex_digits = 32 if kind == ALGORITHM else 64
    return (re.compile(rf"(?:{re.escape(kind)}:[0-9a-f]{{{hex_digits}}}\n)*"),
            len(kind) + 1 + hex_digits)


def check_fields(data: dict[str, Any]) -> None:
    """Check the shape and range of every field a reader, drain or load uses."""
    cid = data.get("checkpoint_id")
    if not isinstance(cid, str) or not is_valid_checkpoint_id(cid):
        raise _fail("checkpoint_id", "is not a valid checkpoint id", cid)
    files = data.get("files")
    if not isinstance(files, dict):
        raise _fail("files", "must be a table of file name -> entry", files)
    for name, entry in files.items():
        if not is_plain_file_name(name):
            raise _fail("files", "names a file outside the checkpoint directory (only plain "
                        "file names are allowed)", name)
        check_entry(name, entry)
    _int(data, "world_size", 1, high=MAX_RANKS)
    _int(data, "part", 0, high=MAX_RANKS - 1)
    _int(data, "parts", 1, high=MAX_RANKS)
    if data["part"] >= data["parts"]:
        raise _fail("part", f"must be below parts ({data['parts']})", data["part"])
    ranks = data.get("ranks")
    if (not isinstance(ranks, list) or not ranks
            or not all(_is_int(r, 0, data["world_size"] - 1) for r in ranks)):
        raise _fail("ranks", f"must list ranks below world_size ({data['world_size']})", ranks)
    codecs = data.get("codecs")
    if not isinstance(codecs, list) or not all(_is_text(c) for c in codecs):
        raise _fail("codecs", "must be a list of codec names", codecs)
    plugins = data.get("plugins")
    if not isinstance(plugins, dict) or not all(
            _is_text(k) and _is_text(v) for k, v in plugins.items()):
        raise _fail("plugins", "must be a table of names -> versions", plugins)
    if not isinstance(data.get("pinned"), bool):
        raise _fail("pinned", "must be true or false", data.get("pinned"))
    for name in ("save_token", "tierstore_version", "torch_version"):
        _str(data, name)
    for name in ("created", "committed"):
        value = data.get(name)
        # bounded (NaN and infinity compare false): it is sorted, compared and printed as a date
        if type(value) not in (int, float) or not 0 <= value <= MAX_TIME:
            raise _fail(name, f"must be a time in seconds since 1970 (from 0 to {MAX_TIME:.0e})",
                        value)
    _int(data, "step", 0, optional=True)
    algorithm = data.get("checksum_algorithm")
    if algorithm not in (ALGORITHM, KEYED_ALGORITHM):
        raise _fail("checksum_algorithm", f"must be {ALGORITHM!r} or {KEYED_ALGORITHM!r} (the "
                    f"ones this version reads)", algorithm)
    if algorithm == KEYED_ALGORITHM and not all(
            e["checksum"].startswith(KEYED_PREFIX) for e in files.values()):
        raise _fail("checksum_algorithm", "says every digest is keyed, but one is not",
                    algorithm)
    signed_by = data.get("signed_by", "")
    if not isinstance(signed_by, str) or not (signed_by == "" or _KEY_ID.fullmatch(signed_by)):
        raise _fail("signed_by", "must be a key id (16 hex digits) or empty", signed_by)
