"""Where a budgeted staging puts its waves: records on the first tier, copied into the checkpoint's
files when DCP writes it.

With ``[store.staging] max_staging_bytes`` smaller than the state dict, the staging plugin copies
the tensors wave by wave into buffers of at most that size, and each wave must be written out
before its buffers are reused. DCP plans a save only once staging is complete (its executor
waits on the staging future), so the waves cannot go into the checkpoint's own files: they go
into a *spill* directory on the store's first tier, as the very records DCP's data files hold
(``torch.save`` archives), each file's checksum taken as it is written. The staged tree DCP plans
from holds ``meta`` tensors in their place. ``write_data`` then renames into the save's directory
each spill file all of whose records its plan writes (the writer's ``_adopt_spill_files``), and
copies the other planned records from the spill into its data files (:class:`SpillReader`:
through the tier's codecs and the checksum, in chunks, never a whole tensor in memory).

The spill directory is a save's staging directory on that tier (``Tier.begin_save`` under the
id ``SPILL_ID``): this process holds its lock until the save is over, gc in any process spares
it meanwhile, and what a killed process left is collected like any interrupted save.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import IO, Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.tensor import DTensor

from tierstore.errors import StagingError
from tierstore.format.item_io import HashingWriter, write_tensor_record
from tierstore.format.tensor_records import storage_alignment, tensor_bytes
from tierstore.tiers.tier import Tier

__all__ = ["SPILL_ID", "SpilledRecord", "SpillIndex", "Spill", "copy_record"]

log = logging.getLogger("tierstore.dcp.spill")

#: the checkpoint id spill directories are made under (``.tierstore-tmp.spill.<token>``)
SPILL_ID = "spill"
#: bytes moved at once when a record is copied into a data file
_CHUNK = 8 << 20


@dataclass(frozen=True)
class SpilledRecord:
    """One tensor's record in a spill file: where it is, and where its raw bytes are in it."""

    file: str
    offset: int
    length: int
    #: offset of the tensor's raw bytes from the record's start, and their count (None: not
    #: located, the record is copied whole all the same)
    raw: tuple[int, int] | None


@dataclass
class SpillIndex:
    """Plain data (pickled to DCP's checkpoint process with the writer): the spill's tier and
    directory, and each spilled item's record by DCP's item key (fqn, chunk offsets)."""

    tier: str
    directory: str
    records: dict[tuple[str, tuple[int, ...]], SpilledRecord] = field(default_factory=dict)
    #: each spill file's size and checksum (as a data file's manifest entry has them)
    files: dict[str, tuple[int, str]] = field(default_factory=dict)

    def find(self, fqn: str, offset: Any) -> SpilledRecord | None:
        """The record of DCP's write item at ``fqn`` and chunk ``offset``."""
        return self.records.get((fqn, tuple(offset or ())))


class Spill:
    """A spill directory being written (the wave sink a staging plugin writes into); made by
    the writer for one save in the training process, which owns it until the save is over."""

    def __init__(self, tier: Tier):
        self.tier = tier
        self.token = uuid.uuid4().hex[:16]
        self.directory = tier.begin_save(SPILL_ID, self.token)
        self._alignment = storage_alignment()
        self._lock = threading.Lock()
        self._released = False
        self._files: dict[str, tuple[int, str]] = {}

    def write_wave(self, number: int, tensors: list[torch.Tensor]) -> list[SpilledRecord]:
        """Write one wave's tensors (contiguous CPU tensors, views of staging buffers are fine)
        as records into a file of their own; durable when this returns."""
        relative = f"wave-{number}.rec"
        records = []
        try:
            with self.tier.open_write(f"{self.directory}/{relative}",
                                      sum(t.nbytes for t in tensors)) as raw:
                out = HashingWriter(raw, self.tier.keyring.new_hasher())
                for tensor in tensors:
                    start = out.offset
                    span = write_tensor_record(_own_storage(tensor), out, out, self._alignment)
                    raw_at = None if span is None else (span[0] - start, span[1])
                    records.append(SpilledRecord(relative, start, out.offset - start, raw_at))
                out.flush()
            with self._lock:
                self._files[relative] = (out.offset, out.hasher.hexdigest())
        except OSError as exc:
            raise StagingError(
                f"writing wave {number} of a budgeted staging to tier '{self.tier.name}' "
                f"({self.tier.backend.describe()}) failed: {exc}. With [store.staging] "
                f"max_staging_bytes smaller than the state dict, waves are written to the first "
                f"tier before their buffers are reused; free space there or raise "
                f"max_staging_bytes. Nothing was saved and the checkpoints before it are "
                f"intact") from exc
        return records

    def finish(self, staged: dict[str, Any],
               placed: list[tuple[torch.Tensor, SpilledRecord]]) -> SpillIndex:
        """The index of the spilled records by DCP's item keys: ``staged`` (with a meta
        placeholder in place of every spilled tensor) is flattened as DCP's default planner
        flattens it, so that ``write_data`` finds each planned item's record."""
        by_placeholder = {id(t): rec for t, rec in placed}
        index = SpillIndex(self.tier.name, self.directory, files=dict(self._files))
        flat, _ = flatten_state_dict(staged)
        for fqn, value in flat.items():
            local = value._local_tensor if isinstance(value, DTensor) else value
            if not isinstance(local, torch.Tensor) or id(local) not in by_placeholder:
                continue
            for item in _create_write_items(fqn, value):
                index.records[(item.index.fqn, tuple(item.index.offset or ()))] = \
                    by_placeholder[id(local)]
        return index

    def release(self) -> None:
        """Remove the spill directory and let go of it (idempotent; the save is over)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        try:
            self.tier.abort_save(SPILL_ID, self.directory)
        except Exception:  # what is left is gc's; the save's outcome does not depend on it
            log.warning("tier '%s': removing the staging spill %s failed; gc will collect it",
                        self.tier.name, self.directory, exc_info=True)


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous, on the CPU) as a tensor whose storage is exactly its bytes, without
    a copy: ``torch.save`` writes a tensor's whole storage, and a wave's tensors are views of one
    buffer."""
    if tensor.untyped_storage().nbytes() == tensor.nbytes and tensor.storage_offset() == 0:
        return tensor
    if tensor.nbytes == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    flat = torch.frombuffer(tensor_bytes(tensor), dtype=torch.uint8)
    return flat.view(tensor.dtype).view(tensor.shape)


def copy_record(source: IO[bytes], record: SpilledRecord, stream: IO[bytes],
                scratch: bytearray) -> None:
    """Copy ``record``'s bytes from the open spill file ``source`` into ``stream`` (a data
    file's stream, through codecs when there are any), ``len(scratch)`` bytes at a time."""
    source.seek(record.offset)
    left = record.length
    view = memoryview(scratch)
    while left:
        n = source.readinto(view[:min(left, len(view))])
        if not n:
            raise StagingError(f"the staging spill file {record.file} ended {left} bytes early; "
                               f"it was changed or removed while the save read it")
        # A copy: the stream may keep what it is given (a codec's frame, a backend's buffer).
        stream.write(bytes(view[:n]))
        left -= n


def new_scratch() -> bytearray:
    """A buffer for :func:`copy_record`."""
    return bytearray(_CHUNK)



class SpillReader:
    """``write_items``' ``written_before`` for one save: copies each spilled item's record from
    the spill into the data file being written (a file handle per writing thread)."""

    def __init__(self, tier: Tier, index: SpillIndex):
        self.tier, self.index = tier, index
        self._local = threading.local()
        self._open: list[IO[bytes]] = []
        self._lock = threading.Lock()

    def __call__(self, item: Any, stream: IO[bytes]) -> tuple[int, int] | None | bool:
        record = self.index.find(item.index.fqn, item.index.offset)
        if record is None:
            return False
        files = getattr(self._local, "files", None)
        if files is None:
            files = self._local.files = {}
            self._local.scratch = new_scratch()
        source = files.get(record.file)
        if source is None:
            source = self.tier.backend.open_read(f"{self.index.directory}/{record.file}")
            files[record.file] = source
            with self._lock:
                self._open.append(source)
        copy_record(source, record, stream, self._local.scratch)
        return record.raw

    def close(self) -> None:
        """Close every spill file opened."""
        with self._lock:
            files, self._open = self._open, []
        for f in files:
            f.close()
