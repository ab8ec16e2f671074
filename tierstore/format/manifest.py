"""The manifest, ``tierstore.json``: the last file written, and what makes a checkpoint exist.

It lists every file with its size and checksum, and says how the checkpoint was made (codecs,
plugins, versions, world size). A checkpoint whose manifest is missing, unreadable or does not
match the files beside it does not exist for any reader.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from tierstore.format.checksum import ALGORITHM
from tierstore.format.manifest_check import SEAL_KEY, ManifestError, check_fields
from tierstore.format.signing import UNSIGNED, Keyring

__all__ = ["MANIFEST_NAME", "METADATA_NAME", "FORMAT_VERSION", "FileEntry", "Manifest",
           "ManifestError"]

MANIFEST_NAME = "tierstore.json"
METADATA_NAME = ".metadata"
FORMAT_VERSION = 1

log = logging.getLogger("tierstore.format")
_warned_unsealed = False


def _torch_version() -> str:
    """The running torch's version, for a manifest this process writes. Imported here, not at
    the top: reading manifests (``tierstore ls``) needs no torch, whose import takes seconds."""
    import torch

    return torch.__version__


def _parse(raw: bytes) -> dict[str, Any]:
    """The JSON object of a manifest read from a tier, or ManifestError: not UTF-8, not JSON,
    not an object, nested past what the parser takes, NaN or Infinity (which JSON does not
    have, and no seal can be computed over), or a key given twice in one object (whichever
    one a reader kept, the other would hide beside it)."""
    try:
        data = json.loads(raw, parse_constant=_no_constant, parse_float=_finite,
                          object_pairs_hook=_no_duplicates)
    except ManifestError as exc:
        raise ManifestError(f"not a valid manifest: {exc}") from None
    except (ValueError, RecursionError) as exc:  # not UTF-8 / not JSON / an int of 4300 digits
        raise ManifestError(f"not a valid manifest: {type(exc).__name__}: "
                            f"{_short(str(exc))}") from None
    if not isinstance(data, dict):
        raise ManifestError(f"not a valid manifest: not a JSON object (a JSON "
                            f"{type(data).__name__})")
    return data


def _no_constant(name: str) -> float:
    raise ManifestError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):  # 1e400 reads as infinity
        raise ManifestError(f"{_short(text)} is not a finite number")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ManifestError(f"the key {_short(twice)} is given twice in one object")
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its size, checksum and the rank that wrote it (None: coordinator
    metadata)."""

    size: int
    checksum: str
    rank: int | None = None
    #: ``[item offset, raw bytes offset, raw bytes length]`` of tensors stored uncompressed in
    #: one piece: a load reads those bytes straight into the destination tensor
    spans: list[list[int]] | None = None
    #: the file's bytes in blocks of ``block_bytes`` (the last one shorter), each with its own
    #: digest (of the file checksum's kind, keyed when it is): a load that needs part of the
    #: file, from a peer or a slower tier, moves and checks only the blocks it needs
    block_bytes: int = 0
    blocks: list[str] | None = None
    #: where each of the file's items starts (written where a tier deduplicates): a
    #: deduplicated copy cuts its chunks there, so an unchanged item's chunks are the same
    #: from one checkpoint to the next whatever changed beside it
    cuts: list[int] | None = None

    def block_runs(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The byte ranges ``[start, end)`` of whole blocks covering ``ranges``, adjacent
        blocks joined; ``[(0, size)]`` when this entry has no blocks."""
        if not self.blocks or not self.block_bytes:
            return [(0, self.size)] if self.size else []
        wanted = sorted({b for start, end in ranges if end > start
                         for b in range(start // self.block_bytes,
                                        (end - 1) // self.block_bytes + 1)})
        runs: list[tuple[int, int]] = []
        for b in wanted:
            start, end = b * self.block_bytes, min((b + 1) * self.block_bytes, self.size)
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], end)
            else:
                runs.append((start, end))
        return runs


@dataclass
class Manifest:
    """Everything a reader needs to trust a checkpoint directory."""

    checkpoint_id: str
    files: dict[str, FileEntry]
    world_size: int = 1
    codecs: list[str] = field(default_factory=list)
    plugins: dict[str, str] = field(default_factory=dict)
    pinned: bool = False
    #: on a node-local tier each group of ranks holds one part: which one, of how many, and the
    #: ranks whose files it holds (a shared tier holds part 0 of 1 with every rank)
    part: int = 0
    parts: int = 1
    ranks: list[int] = field(default_factory=lambda: [0])
    #: the save that wrote it (the same on every tier and part)
    save_token: str = ""
    created: float = field(default_factory=time.time)
    committed: float = field(default_factory=time.time)
    step: int | None = None
    tierstore_version: str = ""
    torch_version: str = field(default_factory=_torch_version)
    #: set when the manifest is serialized, from its digests and the store's keys
    #: (tierstore.format.signing): "xxh3_128", or "blake3_keyed" for a signed manifest
    checksum_algorithm: str = ALGORITHM
    #: public id of the key whose MAC seals the manifest ("" when unsigned)
    signed_by: str = ""
    format: int = FORMAT_VERSION

    @property
    def has_metadata(self) -> bool:
        """Whether this part holds DCP's ``.metadata`` (the coordinator's part does)."""
        return METADATA_NAME in self.files

    @property
    def size_bytes(self) -> int:
        """Total bytes of the checkpoint's files."""
        return sum(f.size for f in self.files.values())

    @property
    def signed(self) -> bool:
        """Whether a MAC seals this manifest (as read from a tier, or as last serialized)."""
        return bool(self.signed_by)

    def to_json(self, keyring: Keyring = UNSIGNED) -> bytes:
        """Serialized form, stable key order so identical manifests are identical bytes, with
        the seal over every other field: a MAC by ``keyring``'s signing key when every
        digest is keyed, else an XXH3 checksum (tierstore.format.signing). Sets
        ``checksum_algorithm`` and ``signed_by`` to what was written."""
        data = keyring.seal(asdict(self))
        self.checksum_algorithm, self.signed_by = data["checksum_algorithm"], data["signed_by"]
        return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes, keyring: Keyring = UNSIGNED) -> "Manifest":
        """Parse a manifest read from a tier: its seal (a MAC by one of ``keyring``'s keys, or
        an unsigned seal where ``keyring`` accepts those) and every field are checked first.
        ManifestError (an IntegrityError naming the field) when it is not one to trust."""
        global _warned_unsealed
        data = _parse(raw)
        if type(data.get("format")) is not int or data["format"] != FORMAT_VERSION:
            raise ManifestError(f"unknown manifest format {_short(data.get('format'))}")
        sealed = SEAL_KEY in data
        try:
            keyring.open(data)  # refuses one without a seal unless [store] accept_unsigned
            manifest = cls._from_fields(data)
        except ManifestError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError,
                RecursionError) as exc:
            # The checks above name each field they refuse; a value they did not foresee must
            # still refuse this one checkpoint, never escape to the caller, which would take
            # the whole tier for unreachable and hide every checkpoint on it.
            raise ManifestError(f"not a valid manifest: {type(exc).__name__}: "
                                f"{_short(str(exc))}") from None
        if not sealed and not _warned_unsealed:
            _warned_unsealed = True
            log.warning("a manifest without a seal (written by an older tierstore) was read "
                        "under [store] accept_unsigned; its fields are checked but not "
                        "covered by a checksum")
        return manifest

    @classmethod
    def from_own_json(cls, raw: bytes) -> "Manifest":
        """Parse a manifest this process serialized itself (what a commit protocol is handed
        to publish): every field is checked, the seal is not (it may be a MAC by a key the
        protocol does not hold). Never for bytes read from a tier: use :meth:`from_json`."""
        data = json.loads(raw)
        data.pop(SEAL_KEY, None)
        return cls._from_fields(data)

    @classmethod
    def _from_fields(cls, data: dict[str, Any]) -> "Manifest":
        check_fields(data)
        try:
            data["files"] = {k: FileEntry(**v) for k, v in data["files"].items()}
            return cls(**data)
        except TypeError as exc:  # a missing or unknown field
            raise ManifestError(f"not a valid manifest: {exc}") from None
