"""Parity instead of replicas (the ``erasure`` replication strategy): protecting a save, and
rebuilding a lost member's files at a load.

**Protect.** After a save commits, the ranks of each parity set (``strategy.parity_set``) swap
headers (their committed files, as the replication header lists them) and lay their files one
after another into a stream each, cut into ``k`` chunks of a common length
(tierstore.format.parity). Every member sends each other member the chunk of its stream that
member's parity covers, over torch.distributed (tierstore.transport.transfer, from the files'
mapped pages), and XORs what it receives into its parity chunk. The chunk and the set's headers
(``members.json``) are committed as a checkpoint of the member's parity tier
(``.parity/held-by-<rank>`` beside the peer tier), with the save's token: a set whose members
are killed while encoding leaves the previous save's parity complete, and a half-written one is
never committed.

**Rebuild.** A load (tierstore.dcp.reader) first asks every rank what it holds. Where exactly
one member of a set lost its files and every other member holds its own files and its parity of
the same save, the survivors XOR the others' chunks into their parity (each gets one chunk of
the lost member's stream), send the pieces to the lost member's rank in this job, which writes
the files into its rebuilt replica set (``.replicas/<rank>-held-by-<rank>``), checks each
against the digest its header records, and commits it. The load then reads it as any replica.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tierstore.engine.manifests import build_manifest
from tierstore.errors import IntegrityError, TierstoreError
from tierstore.format.checksum import hash_stream, same_digest
from tierstore.format.manifest import FileEntry, Manifest
from tierstore.tiers.parity_sets import (MEMBERS_FILE, PARITY_FILE, ParityLayout, ParityPiece,
                                         ParitySet, header_of, parity_of, plain_header,
                                         read_members, recoverable)
from tierstore.tiers.tier import Tier
from tierstore.transport.collectives import all_gather_message
from tierstore.transport.shapes import as_bool, as_dict, as_int, as_list, as_str, as_tuple, optional
from tierstore.transport.ends import TransferEnd
from tierstore.transport.transfer import Transfer, exchange_objects, open_to_send, run_transfers

__all__ = ["ParityCheck", "protect", "verify_parity", "rebuild_lost"]

log = logging.getLogger("tierstore.replication")


class _XorInto(TransferEnd):
    """A receiving end that XORs each arrived piece into ``parity`` at its place (a streaming
    end: pieces come in the transfer's reused buffers, in order per transfer)."""

    in_place = False

    def __init__(self, parity: torch.Tensor, base: int):
        self._parity, self._base = parity, base  # chunk position of the file's byte 0

    def write_at(self, offset: int, data: torch.Tensor) -> None:
        at = self._base + offset
        self._parity[at:at + data.numel()].bitwise_xor_(data)


class _ChunkSource(TransferEnd):
    """A sending end over a rebuilt chunk: file ``offset`` of a piece is at ``base + offset``."""

    def __init__(self, chunk: torch.Tensor, base: int):
        self._chunk, self._base = chunk, base

    def piece(self, offset: int, length: int) -> torch.Tensor:
        at = self._base + offset
        return self._chunk[at:at + length]


def _encoding(layout: ParityLayout, rank: int,
              skip: int | None = None) -> dict[Transfer, ParityPiece]:
    """The pieces of the set's encoding that ``rank`` sends or receives (none from or to
    ``skip``), each by the transfer that moves it from its member to its holder, in the
    layout's order (the one every rank lists them in)."""
    return {Transfer(p.member, p.holder, p.file, p.size, p.offset): p for p in layout.pieces
            if skip not in (p.member, p.holder) and rank in (p.member, p.holder)}


def _xor_from_peers(group: Any, rank: int, encoding: dict[Transfer, ParityPiece],
                    parity: torch.Tensor, open_source: Callable[[Transfer], TransferEnd],
                    piece_bytes: int) -> int:
    """Run the transfers of ``encoding`` (:func:`_encoding`), XORing what this rank receives
    into ``parity`` at the place its piece has in this rank's chunk; bytes received."""

    def open_target(t: Transfer) -> TransferEnd:
        piece = encoding[t]
        return _XorInto(parity, piece.at - piece.offset)

    return run_transfers(group, rank, list(encoding), open_source, open_target,
                         lambda *_: None, piece_bytes)


# -- protect ----------------------------------------------------------------------------------

def protect(group: Any, rank: int, members: list[int], header: dict, cid: str, source: Tier,
            parity_tier: Tier, strategy: str, announce: Callable[[str], None],
            piece_bytes: int) -> tuple[int, int, int]:
    """Encode this rank's share of its set's parity for the save ``cid`` (this rank's files
    committed on ``source``, listed in ``header``) and commit it on ``parity_tier``. Every
    member of the set calls it. Returns (bytes sent, bytes received, bytes of parity kept)."""
    others = [r for r in members if r != rank]
    headers = exchange_objects(group, {r: plain_header(header) for r in others}, others)
    headers = {r: header_of(h) for r, h in headers.items()}
    headers[rank] = header
    found = ParitySet.of(members, headers)
    encoding = _encoding(found.layout, rank)
    sizes = found.layout.sizes[rank]

    def open_source(t: Transfer) -> TransferEnd:
        return open_to_send(source.backend, f"{cid}/{t.key}", sizes[t.key])

    received = []
    _write_parity(parity_tier, cid, found, rank, strategy, announce, lambda parity: received.append(
        _xor_from_peers(group, rank, encoding, parity, open_source, piece_bytes)))
    return sum(t.size for t in encoding if t.src == rank), received[0], found.chunk


def _write_parity(parity_tier: Tier, cid: str, found: ParitySet, rank: int, strategy: str,
                  announce: Callable[[str], None], fill: Callable[[torch.Tensor], None]) -> None:
    """Commit ``rank``'s parity chunk of ``found`` for ``cid`` on ``parity_tier`` (replacing
    one there): ``fill`` XORs it into a zeroed chunk in the file's own pages where the tier
    recycles them, else into a buffer written after; ``members.json`` beside it."""
    header = found.headers[rank]
    token = header["token"]
    staging = parity_tier.begin_save(cid, token)
    try:
        end = parity_tier.backend.receiving_end(f"{staging}/{PARITY_FILE}", found.chunk)
        try:
            parity = (end.piece(0, found.chunk) if end.in_place and found.chunk
                      else torch.empty(found.chunk, dtype=torch.uint8))
            parity.zero_()  # (recycled pages hold an older chunk)
            fill(parity)
            if not end.in_place and found.chunk:
                end.write_at(0, parity)
            digest = parity_tier.keyring.new_hasher()
            digest.update(parity.numpy())
        finally:
            end.close(fsync=parity_tier.backend.durable)
        described = found.to_json()
        parity_tier.backend.write_bytes(f"{staging}/{MEMBERS_FILE}", described)
        files = {PARITY_FILE: FileEntry(found.chunk, digest.hexdigest(), rank),
                 MEMBERS_FILE: FileEntry(len(described), parity_tier.keyring.digest(described),
                                         rank)}
        manifest = build_manifest(
            parity_tier, cid, files,
            plugins={"replication": strategy, "parity_set": ",".join(map(str, found.ranks))},
            world_size=header["world_size"], codecs=[], step=header["step"], part=0, parts=1,
            ranks=[rank], save_token=token, created=header["created"],
            committed=header["committed"])
        parity_tier.commit_save(cid, staging, manifest, announce)
    except BaseException:
        parity_tier.abort_save(cid, staging)
        raise


# -- checking parity against its members ------------------------------------------------------

@dataclass(frozen=True)
class ParityCheck:
    """What checking one rank's parity of one save against its set's files found (plain
    data): ``state`` is ``ok``, ``mismatch`` (found, not repaired), ``repaired`` (rewritten
    from the members' files), ``unchecked`` (a member's files or parity are not there, or do
    not match their digests: nothing to check against) or ``missing`` (this rank holds none of
    a save other ranks hold parity of)."""

    checkpoint_id: str
    rank: int
    members: tuple[int, ...]
    state: str
    detail: str = ""


def verify_parity(group: Any, rank: int, cid: str, own: list[tuple[Tier, Manifest]],
                  parity_tier: Tier | None, strategy: str, announce: Callable[[str], None],
                  piece_bytes: int, repair: bool = False) -> ParityCheck | None:
    """Collective on ``group``: encode each set's parity of ``cid`` again from its members'
    files (each checked against its digest first, from ``own``: this rank's copies) and
    compare it with the parity the members hold; with ``repair``, a chunk that differs is
    rewritten. None when no rank holds parity of ``cid``."""
    held = parity_of(parity_tier, cid)
    views = all_gather_message(held, group, optional(_parity_held_from),
                               "the parity a rank holds (save token, set)")
    if held is None:
        if all(v is None for v in views):
            return None
        return ParityCheck(cid, rank, (), "missing", "this rank holds no parity of it")
    token, members = held
    absent = [m for m in members if m >= len(views) or views[m] != held]
    if absent:
        return ParityCheck(cid, rank, members, "unchecked",
                           f"rank(s) {absent} of its set hold no parity of this save")
    # The set's description is read only once it matches its manifest (a changed one would
    # re-encode, and with repair rewrite, the parity of some other set of files), and every
    # member says whether it is ready before any transfer, so that none raises alone.
    try:
        found = read_members(_checked_read(parity_tier, cid, MEMBERS_FILE))
        files = found.headers[rank]["files"]
    except (OSError, KeyError, IntegrityError) as exc:
        files, bad = {}, [f"{MEMBERS_FILE} ({exc})"]
    else:
        copies = {rel: _own_copy(own, cid, rel, entry) for rel, entry in files.items()}
        bad = sorted(rel for rel, copy in copies.items() if copy is None)
    others = [m for m in members if m != rank]
    ready = exchange_objects(group, {m: not bad for m in others}, others)
    if bad or not all(ready.values()):
        who = [rank] if bad else [m for m, ok in ready.items() if not ok]
        return ParityCheck(cid, rank, members, "unchecked",
                           f"the files of rank(s) {who} are not all here with the digests of "
                           f"their save" + (f" ({', '.join(bad)})" if bad else ""))

    def open_own(t: Transfer) -> TransferEnd:
        return open_to_send(copies[t.key].backend, f"{cid}/{t.key}", files[t.key].size)

    fresh = torch.zeros(found.chunk, dtype=torch.uint8)
    _xor_from_peers(group, rank, _encoding(found.layout, rank), fresh, open_own, piece_bytes)
    stored = parity_tier.backend.read_bytes(f"{cid}/{PARITY_FILE}")
    if len(stored) == found.chunk and torch.equal(
            torch.frombuffer(bytearray(stored), dtype=torch.uint8) if stored else fresh, fresh):
        return ParityCheck(cid, rank, members, "ok")
    what = (f"its parity chunk ({len(stored)} bytes) differs from the XOR of its set's files "
            f"({found.chunk} bytes)")
    if not repair:
        return ParityCheck(cid, rank, members, "mismatch", what)
    _write_parity(parity_tier, cid, found, rank, strategy, announce, lambda p: p.copy_(fresh))
    return ParityCheck(cid, rank, members, "repaired", what)


def _own_copy(own: list[tuple[Tier, Manifest]], cid: str, rel: str,
              entry: FileEntry) -> Tier | None:
    """The first tier of ``own`` whose copy of ``rel`` has the size and digest ``entry``
    records (read whole and hashed), or None."""
    for tier, manifest in own:
        listed = manifest.files.get(rel)
        if listed is None or listed.checksum != entry.checksum:
            continue
        try:
            with tier.backend.open_read(f"{cid}/{rel}") as f:
                got = hash_stream(f, hasher=tier.keyring.hasher_for(entry.checksum))
        except OSError:
            continue
        if got[0] == entry.size and same_digest(got[1], entry.checksum):
            return tier
    return None


# -- what is held, and what can be rebuilt ---------------------------------------------------

def _parity_held_from(value: Any) -> tuple[str, tuple[int, ...]]:
    """(save token, the set's ranks), as :func:`parity_of` gives it, from a rank's message."""
    token, members = as_tuple(value, as_str, lambda v: as_list(v, lambda r: as_int(r, 0)))
    return token, tuple(members)


def _holds_from(value: Any) -> dict[str, Any]:
    """What a rank holds of a checkpoint (``mine`` of :func:`rebuild_lost`), from its message:
    ``{"covered": {token: [ranks]}, "parity": (token, set) or None}``."""
    fields = as_dict(value, as_str, lambda v: v)
    if set(fields) != {"covered", "parity"}:
        raise ValueError(f"fields {sorted(fields)}, not ['covered', 'parity']")
    return {"covered": as_dict(fields["covered"], as_str,
                               lambda v: as_list(v, lambda r: as_int(r, 0))),
            "parity": optional(_parity_held_from)(fields["parity"])}


def rebuild_lost(group: Any, rank: int, world: int, cid: str, mine: dict[str, Any],
                 own: list[tuple[Tier, Manifest]], parity_tier: Tier | None,
                 rebuilt_tier: Tier | None,
                 announce: Callable[[str], None], piece_bytes: int
                 ) -> tuple[Tier, Manifest] | None:
    """Collective on ``group`` (every rank of the load calls it): rebuild the files of every
    member of a parity set that no rank holds and that its set can rebuild, into the rebuilt
    replica set of the lost member's rank in this job (``rebuilt_tier`` there); a survivor
    sends from its own files of the save, the first copy of each in ``own`` (this rank's
    sources, fastest first) whose entry has the digest the set's header records. ``mine``: what
    this rank holds of ``cid``: ``{"covered": {token: [ranks]}, "parity": (token, set) or
    None}``. Returns this rank's rebuilt copy ``(tier, manifest)`` when it got one."""
    views = all_gather_message(mine, group, _holds_from,
                               "what a rank holds of the checkpoint (covered, parity)")
    plan: list[tuple[int, tuple[int, ...], str]] = []  # (lost, set, token)
    tokens = {t for v in views for t in v["covered"]}
    for token in sorted(tokens):
        covered = {r for v in views for r in v["covered"].get(token, ())}
        parity = {holder: tuple(v["parity"][1]) for holder, v in enumerate(views)
                  if v["parity"] is not None and v["parity"][0] == token}
        # A survivor sends from its own copy: one on its node (a job at another shape may
        # hold it on another node only; then the set does not rebuild, the load reads on).
        self_held = {r for r, v in enumerate(views) if r in v["covered"].get(token, ())}
        for lost, members in sorted(recoverable(covered, parity, self_held).items()):
            if lost < world and all(r < world for r in members):
                plan.append((lost, members, token))
    if not plan:
        return None
    # A survivor offers its parity only once its chunk and members.json match their digests
    # (read now, when a rebuild needs them: an intact load reads no parity): a bad chunk would
    # rebuild wrong bytes, which the lost rank would find only after both exchanges.
    mine_ok = all(_parity_sound(parity_tier, cid)
                  for lost, members, _ in plan if rank in members and rank != lost)
    sound = all_gather_message(mine_ok, group, as_bool, "whether its parity is sound")
    unsound = [(lost, [r for r in members if r != lost and not sound[r]])
               for lost, members, _ in plan]
    for lost, bad in unsound:
        if bad:
            log.warning("checkpoint %s: the files of rank %d are not rebuilt from parity: the "
                        "parity of rank(s) %s does not match its digests", cid, lost, bad)
    plan = [p for p, (_, bad) in zip(plan, unsound) if not bad]
    started = time.perf_counter()
    result = None
    for lost, members, token in plan:  # every rank walks the same plan
        got = _rebuild_one(group, rank, cid, lost, members, own, parity_tier, rebuilt_tier,
                           announce, piece_bytes)
        if got is not None:
            result = got
    log.info("checkpoint %s: rebuilt the files of rank(s) %s from parity in %.3f s", cid,
             [p[0] for p in plan], time.perf_counter() - started)
    return result


class _Dropped(TransferEnd):
    """A receiving end that keeps nothing (a rebuild whose target could not be begun)."""

    in_place = False

    def write_at(self, offset: int, data: torch.Tensor) -> None:
        """Drop the piece."""


_DROPPED = _Dropped()


def _checked_read(tier: Tier, cid: str, name: str) -> bytes:
    """File ``name`` of the parity checkpoint ``cid`` on ``tier``, once it matches the size
    and digest its manifest records; IntegrityError otherwise."""
    manifest = tier.read_manifest(cid)
    entry = manifest.files.get(name) if manifest is not None else None
    if entry is None:
        raise IntegrityError(f"checkpoint '{cid}': no manifest on tier '{tier.name}' lists "
                             f"{name}")
    raw = tier.backend.read_bytes(f"{cid}/{name}")
    hasher = tier.keyring.hasher_for(entry.checksum)
    hasher.update(raw)
    if len(raw) != entry.size or not same_digest(hasher.hexdigest(), entry.checksum):
        raise IntegrityError(f"checkpoint '{cid}': {name} on tier '{tier.name}' does not "
                             f"match its manifest")
    return raw


def _parity_sound(tier: Tier | None, cid: str) -> bool:
    """Whether the parity ``tier`` holds of ``cid`` matches its manifest (both files read and
    hashed)."""
    if tier is None:
        return False
    manifest = tier.read_manifest(cid)
    if manifest is None:
        return False
    for name in (PARITY_FILE, MEMBERS_FILE):
        entry = manifest.files.get(name)
        try:
            with tier.backend.open_read(f"{cid}/{name}") as f:
                got = hash_stream(f, hasher=tier.keyring.hasher_for(entry.checksum))
        except (OSError, AttributeError):
            return False
        if got[0] != entry.size or not same_digest(got[1], entry.checksum):
            return False
    return True


def _planned_set(raw: bytes, members: tuple[int, ...]) -> ParitySet:
    """The set a ``members.json`` (``raw``) describes, once its ranks are the set the load
    planned the rebuild for (``members``, as every rank's parity manifest records it): every
    member then lists the rebuild's transfers from its layout alike, in one order."""
    found = read_members(raw)
    if found.ranks != tuple(members):
        raise IntegrityError(f"its set's description names ranks {list(found.ranks)}, its "
                             f"parity's manifest {list(members)}")
    return found


def _survivor_ready(rank: int, lost: int, members: tuple[int, ...], cid: str,
                    own: list[tuple[Tier, Manifest]], parity_tier: Tier | None
                    ) -> tuple[ParitySet, torch.Tensor, Callable[[Transfer], TransferEnd]]:
    """What a survivor needs to help rebuild ``lost``: its set (``members.json``, with its
    layout), a copy of its parity chunk, and how to open its own files of the save (each a
    copy whose entry has the digest the set records). Raises (IntegrityError, OSError) when it
    has not all of it."""
    if parity_tier is None:
        raise IntegrityError("it holds no parity tier")
    found = _planned_set(parity_tier.backend.read_bytes(f"{cid}/{MEMBERS_FILE}"), members)
    chunk = torch.frombuffer(bytearray(parity_tier.backend.read_bytes(
        f"{cid}/{PARITY_FILE}")), dtype=torch.uint8) if found.chunk else \
        torch.empty(0, dtype=torch.uint8)
    if chunk.numel() != found.chunk:
        raise IntegrityError(f"checkpoint '{cid}': the parity on tier '{parity_tier.name}' "
                             f"is {chunk.numel()} bytes, its set's chunk {found.chunk}")
    files = found.headers[rank]["files"]
    sources = {}
    for rel, want in files.items():
        sources[rel] = next((tier for tier, manifest in own
                             if (entry := manifest.files.get(rel)) is not None
                             and entry.checksum == want.checksum), None)
        if sources[rel] is None:
            raise IntegrityError(f"checkpoint '{cid}': rank {rank} holds no copy of its {rel} "
                                 f"to rebuild rank {lost}'s files with")

    sizes = found.layout.sizes[rank]

    def open_own(t: Transfer) -> TransferEnd:
        return open_to_send(sources[t.key].backend, f"{cid}/{t.key}", sizes[t.key])

    return found, chunk, open_own


def _rebuild_one(group: Any, rank: int, cid: str, lost: int, members: tuple[int, ...],
                 own: list[tuple[Tier, Manifest]], parity_tier: Tier | None,
                 rebuilt_tier: Tier | None,
                 announce: Callable[[str], None], piece_bytes: int
                 ) -> tuple[Tier, Manifest] | None:
    survivors = [r for r in members if r != lost]
    if rank not in members:
        return None
    # Each member first readies what it needs (a survivor: its set's description and layout,
    # its parity chunk and its own files; the lost member's rank: the set, told by the lowest
    # survivor), then the set agrees: a member that cannot take part says so, instead of
    # raising while the others wait for it in the transfers until the collective timeout.
    # From there on every step takes the set's layout, read once here, as plain data.
    found, chunk, problem = None, None, ""
    if rank != lost:
        try:
            found, chunk, open_own = _survivor_ready(rank, lost, members, cid, own,
                                                     parity_tier)
        except (OSError, ValueError, KeyError, IntegrityError) as exc:
            problem = f"rank {rank}: {exc}"
    # The lowest survivor tells the lost member's rank (which has nothing) what its set is.
    told = exchange_objects(
        group, {lost: found.to_json().decode() if found is not None else ""}
        if rank == survivors[0] else {}, [survivors[0]] if rank == lost else [])
    if rank == lost:
        try:
            if not told[survivors[0]]:
                raise IntegrityError(f"rank {survivors[0]} could not read its set")
            found = _planned_set(told[survivors[0]].encode(), members)
        except (ValueError, KeyError, IntegrityError) as exc:
            problem = f"rank {rank}: {exc}"
    others = [r for r in members if r != rank]
    ready = exchange_objects(group, {r: problem for r in others}, others)
    problems = [p for p in (problem, *ready.values()) if p]
    if problems:
        if rank == lost:
            log.warning("checkpoint %s: the files of rank %d are not rebuilt from parity: %s",
                        cid, lost, "; ".join(problems))
        return None
    assert found is not None
    layout = found.layout
    # 1. Each survivor XORs the other survivors' chunks into a copy of its parity: one chunk
    #    of the lost member's stream.
    if rank != lost:
        _xor_from_peers(group, rank, _encoding(layout, rank, skip=lost), chunk, open_own,
                        piece_bytes)
    # 2. The survivors send the lost member's rank its files' pieces, each from where its
    #    holder's rebuilt chunk has it (the layout lists them by holder, in set order).
    moves = {Transfer(p.holder, lost, p.file, p.size, p.offset): p for p in layout.pieces
             if p.member == lost}
    header = found.headers[lost]
    if rank == lost:
        try:
            staging = rebuilt_tier.begin_save(cid, header["token"])
        except (OSError, TierstoreError) as exc:
            # The survivors send all the same (they cannot know): received and dropped.
            log.warning("checkpoint %s: the files of rank %d are not rebuilt from parity: %s",
                        cid, lost, exc)
            run_transfers(group, rank, list(moves), None, lambda t: _DROPPED,
                          lambda *_: None, piece_bytes)
            return None
        try:
            ends = {}

            def open_target(t: Transfer) -> TransferEnd:
                if t.key not in ends:
                    ends[t.key] = rebuilt_tier.backend.receiving_end(
                        f"{staging}/{t.key}", layout.sizes[lost][t.key])
                return ends[t.key]

            run_transfers(group, rank, list(moves), None, open_target, lambda *_: None,
                          piece_bytes)
            for end in ends.values():
                end.close(fsync=rebuilt_tier.backend.durable)
            for rel, entry in header["files"].items():
                if rel not in ends:
                    if entry.size:
                        raise IntegrityError(f"{rel} of rank {lost} was not rebuilt")
                    rebuilt_tier.backend.write_bytes(f"{staging}/{rel}", b"")
                with rebuilt_tier.backend.open_read(f"{staging}/{rel}") as f:
                    size, digest = hash_stream(f, hasher=rebuilt_tier.keyring.hasher_for(
                        entry.checksum))
                if size != entry.size or not same_digest(digest, entry.checksum):
                    raise IntegrityError(
                        f"{rel} of rank {lost}, rebuilt from the parity of ranks "
                        f"{survivors}, does not match its digest: a member's file changed "
                        f"since the save")
            manifest = build_manifest(
                rebuilt_tier, cid, header["files"],
                plugins={"replication": "rebuilt from parity"},
                world_size=header["world_size"], codecs=header["codecs"], step=header["step"],
                part=0, parts=1, ranks=[lost], save_token=header["token"],
                created=header["created"], committed=header["committed"])
            rebuilt_tier.commit_save(cid, staging, manifest, announce)
        except IntegrityError as exc:
            # Nothing is published: the load goes on as if the set could not rebuild (its
            # collective decides on every rank alike: a slower tier, or CheckpointNotFound).
            rebuilt_tier.abort_save(cid, staging)
            log.warning("checkpoint %s: rebuilding the files of rank %d from parity failed: "
                        "%s", cid, lost, exc)
            return None
        except BaseException:
            rebuilt_tier.abort_save(cid, staging)
            raise
        return rebuilt_tier, manifest
    def open_source(t: Transfer) -> TransferEnd:
        piece = moves[t]
        return _ChunkSource(chunk, piece.at - piece.offset)

    run_transfers(group, rank, list(moves), open_source, None, lambda *_: None, piece_bytes)
    return None
