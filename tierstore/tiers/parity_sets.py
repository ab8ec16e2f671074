"""Parity sets as plain data (the ``erasure`` replication strategy): which bytes of which member's
files each member's parity chunk covers (:class:`ParitySet` and its :class:`ParityLayout`, over
tierstore.format.parity's chunks), the set's description kept beside each chunk
(``members.json``), what a parity tier holds, and which lost members a save's parity can
rebuild. Reading only: encoding, checking and rebuilding are tierstore.engine.parity's, which
takes each set's layout as the plain data made here with the set, once."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from tierstore.errors import IntegrityError
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.format.parity import chunk_index, common_length
from tierstore.tiers.tier import Tier

__all__ = ["PARITY_FILE", "MEMBERS_FILE", "ParityPiece", "ParityLayout", "ParitySet",
           "read_members", "plain_header", "header_of", "parity_held", "parity_of",
           "recoverable"]

#: the parity chunk a member keeps, and the set's headers, in its parity tier's checkpoint
PARITY_FILE = "parity"
MEMBERS_FILE = "members.json"
_FORMAT = 1


@dataclass(frozen=True)
class ParityPiece:
    """One range of a member's stream that one other member's parity chunk covers: ``size``
    bytes of ``member``'s file ``file`` from byte ``offset`` of the file, at byte ``at`` of
    ``holder``'s chunk. Encoding moves it from ``member`` to ``holder``; a rebuild of
    ``member`` moves it back, from ``holder``'s rebuilt chunk."""

    member: int
    holder: int
    file: str
    offset: int
    size: int
    at: int


@dataclass(frozen=True)
class ParityLayout:
    """Where every byte of a parity set's streams lies (plain data, made once with its set):
    ``ranks``, the members in set order; ``chunk``, the bytes of each member's parity chunk;
    ``sizes``, each member's files in stream order (name -> bytes); ``pieces``, every range of
    a member's file in another member's chunk, by member, then holder (both in set order),
    then stream order: the one order in which every rank of the set lists the transfers."""

    ranks: tuple[int, ...]
    chunk: int
    sizes: dict[int, dict[str, int]]
    pieces: tuple[ParityPiece, ...]

    @classmethod
    def of(cls, ranks: tuple[int, ...], chunk: int,
           sizes: dict[int, dict[str, int]]) -> "ParityLayout":
        """The layout of the set of ``ranks`` whose members' files have ``sizes`` (each
        member's in stream order), cut into chunks of ``chunk`` bytes."""
        n = len(ranks)
        pieces = []
        for j, member in enumerate(ranks):
            for r, holder in enumerate(ranks):
                if member == holder:
                    continue
                lo = chunk_index(r, j, n) * chunk
                hi, at = lo + chunk, 0
                for rel, size in sizes[member].items():
                    start, end = max(lo, at), min(hi, at + size)
                    if start < end:
                        pieces.append(ParityPiece(member, holder, rel, start - at, end - start,
                                                  start - lo))
                    at += size
        return cls(tuple(ranks), chunk, sizes, tuple(pieces))


@dataclass(frozen=True)
class ParitySet:
    """One parity set of one save, as plain data: its members (ranks, in rank order), each
    member's replication header (its files and the save's fields), the chunk length, and the
    set's :class:`ParityLayout`, computed from them once, when the set is made."""

    ranks: tuple[int, ...]
    headers: dict[int, dict]
    chunk: int
    layout: ParityLayout

    @classmethod
    def of(cls, ranks: list[int], headers: dict[int, dict]) -> "ParitySet":
        """The set of ``ranks`` with their ``headers``, its chunk length and layout computed."""
        lengths = [sum(e.size for e in headers[r]["files"].values()) for r in ranks]
        chunk = common_length(lengths, len(ranks)) // (len(ranks) - 1)
        sizes = {r: {rel: e.size for rel, e in sorted(headers[r]["files"].items())}
                 for r in ranks}
        return cls(tuple(ranks), headers, chunk, ParityLayout.of(tuple(ranks), chunk, sizes))

    def position(self, rank: int) -> int:
        """Where ``rank`` is in the set."""
        return self.ranks.index(rank)

    def files(self, rank: int) -> list[tuple[str, FileEntry]]:
        """Member ``rank``'s files in stream order."""
        return sorted(self.headers[rank]["files"].items())

    def pieces(self, member: int, holder: int) -> list[tuple[str, int, int, int]]:
        """The pieces of ``member``'s stream in ``holder``'s parity chunk: ``(file, offset in
        the file, bytes, offset in the chunk)`` (from :attr:`layout`)."""
        # A rank that is not a member, or a member's own stream, is a ValueError.
        chunk_index(self.position(holder), self.position(member), len(self.ranks))
        return [(p.file, p.offset, p.size, p.at) for p in self.layout.pieces
                if p.member == member and p.holder == holder]

    def to_json(self) -> bytes:
        """``members.json``: plain data (entries as their fields)."""
        return json.dumps({"format": _FORMAT, "ranks": list(self.ranks), "chunk": self.chunk,
                           "headers": {str(r): plain_header(h) for r, h in self.headers.items()}},
                          sort_keys=True).encode()


def plain_header(header: dict) -> dict:
    """A replication header as plain data (its file entries as their fields), for a message
    or ``members.json``."""
    return {**header, "files": {rel: dataclasses.asdict(e) for rel, e in header["files"].items()}}


def header_of(plain: dict) -> dict:
    """The replication header :func:`plain_header` wrote (its entries as FileEntry again)."""
    return {**plain, "files": {rel: FileEntry(**f) for rel, f in plain["files"].items()}}


def read_members(raw: bytes) -> ParitySet:
    """The set described by a ``members.json`` (checked against its manifest by the caller);
    IntegrityError when it is not one."""
    try:
        doc = json.loads(raw)
        if doc.get("format") != _FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, this version reads {_FORMAT}")
        ranks = tuple(int(r) for r in doc["ranks"])
        headers = {int(r): header_of(h) for r, h in doc["headers"].items()}
        if sorted(headers) != sorted(ranks) or len(ranks) < 2:
            raise ValueError("its headers do not match its members")
        found = ParitySet.of(list(ranks), headers)
        if found.chunk != int(doc["chunk"]):
            raise ValueError("its chunk length does not match its members' files")
        return found
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise IntegrityError(f"{MEMBERS_FILE} is not a parity set's description "
                             f"({type(exc).__name__}: {exc})") from None


def _set_of(manifest: Manifest) -> tuple[int, ...] | None:
    try:
        return tuple(int(r) for r in manifest.plugins["parity_set"].split(","))
    except (KeyError, ValueError, AttributeError):
        return None


def parity_held(tier: Tier | None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The saves ``tier`` (a parity tier) holds complete parity of: id -> (save token, the
    set's ranks, as its manifest records them)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    if tier is None:
        return out
    for cid, manifest in tier.complete().items():
        members = _set_of(manifest)
        if members:
            out[cid] = (manifest.save_token, members)
    return out


def parity_of(tier: Tier | None, cid: str) -> tuple[str, tuple[int, ...]] | None:
    """(save token, the set's ranks) of the parity ``tier`` holds of ``cid`` (its manifest
    checked, its files present), or None."""
    if tier is None:
        return None
    manifest, _ = tier.checked_manifest(cid)
    if manifest is None or len(tier.present_files(cid, manifest)) != len(manifest.files):
        return None
    members = _set_of(manifest)
    return (manifest.save_token, members) if members else None


def recoverable(covered: set[int], parity: dict[int, tuple[int, ...]],
                self_held: set[int] | None = None) -> dict[int, tuple[int, ...]]:
    """Ranks whose files are covered by nobody but can be rebuilt: lost member -> its set,
    for each set (``parity``: holder rank -> the set it holds parity of, for one save) where
    exactly one member is not in ``covered`` and every other member holds its parity and its
    own files (``self_held``: the ranks that hold their own files themselves, where the
    rebuild reads them; default ``covered``)."""
    own = covered if self_held is None else self_held
    out = {}
    for members in set(parity.values()):
        lost = [r for r in members if r not in covered]
        if len(lost) == 1 and all(parity.get(r) == members and r in own
                                  for r in members if r != lost[0]):
            out[lost[0]] = members
    return out
