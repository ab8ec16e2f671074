"""How DCP write items are laid out in a data file, and how they are read back.

Items are written exactly as stock DCP's FileSystemWriter writes them (``torch.save`` of each
tensor chunk, raw bytes for BYTE_IO items), so stock ``dcp.load`` reads tierstore checkpoints.
Reading is faster than stock: a whole tensor chunk whose destination is a contiguous CPU tensor of
the same dtype is read straight into that tensor (``readinto``), skipping ``torch.load``'s
buffer and the copy after it. Every byte of a file passes through the checksum on the way.
"""

from __future__ import annotations

import ctypes
import io
import math
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from typing import IO, Callable

import numpy
import torch
from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlanner, ReadItem, SavePlanner,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed._shard._utils import narrow_tensor_by_index

from tierstore.format.checksum import Hasher, same_digest
from tierstore.format.manifest import FileEntry
from tierstore.format.tensor_records import (TEMPLATE_MAX_BYTES, host_tensor, save_tensor,
                                             storage_alignment, template_for, tensor_bytes)
from tierstore.format.values import check_value
from tierstore.format.streams import write_all

__all__ = ["NoCloseWriter", "BufferReader", "needed_ranges", "read_runs", "runs_bytes",
           "check_blocks", "block_bytes_for", "BLOCK_MIN_BYTES", "ItemLocation", "HashingWriter",
           "write_items", "write_tensor_record", "split_items", "read_items", "LoadUndo",
           "map_checked", "MappedCopy", "FileReadError", "DIRECT_READ_MIN"]

#: a file that is no file of the OS but can be read whole first (``read_whole_first``: a
#: deduplicated tier's) is checked in this process's memory up to this size, streamed above it
BUFFERED_CHECK_MAX = 512 << 20
# Tensors smaller than this are decoded with torch.load; reading them in place gains nothing.
DIRECT_READ_MIN = 256 << 10
#: small writes are gathered up to this many bytes before they reach the backend file
COALESCE_BYTES = 1 << 20
#: records of tensors under this many bytes are joined into one write
_JOIN_BELOW = 64 << 10
#: small items get another file (and writing thread) per this many bytes of them
SMALL_ITEMS_PER_FILE_BYTES = 256 << 20
#: a file's blocks (each with its digest in the manifest) are at least this large...
BLOCK_MIN_BYTES = 128 << 10
#: ...and a file has about this many at most: its manifest entry stays about 11 KiB however
#: large the file. A load that needs part of a chunk (a job at another world size) moves and
#: checks at most two blocks too many per range it reads: with 64 blocks of 1 MiB, a rank
#: reading half of each 2 MiB tensor of an 8 MiB file moved all of it; with these, 56 %.
BLOCKS_PER_FILE = 256


def block_bytes_for(size: int) -> int:
    """The block size of a file of about ``size`` bytes: a power of two of at least
    ``BLOCK_MIN_BYTES`` (so blocks start on page boundaries), about ``BLOCKS_PER_FILE``
    blocks."""
    block = BLOCK_MIN_BYTES
    while block * BLOCKS_PER_FILE < size:
        block *= 2
    return block


@dataclass(frozen=True)
class ItemLocation:
    """What ``write_data`` returns per item: DCP's own storage info plus, on the first item of
    each file, that file's manifest entry (so the coordinator can build the manifest)."""

    info: _StorageInfo
    file: tuple[str, FileEntry] | None = None
    #: where the tensor's raw bytes sit in the file (offset, length), when they were written
    #: uncompressed in one piece; lets a load read them straight into the destination
    raw_span: tuple[int, int] | None = None


#: the least bytes of an item that a file cut into chunks starts on a page (padding of less
#: than a page before each: under 0.4 % of such an item)
ALIGN_ITEMS_FROM = 1 << 20


class HashingWriter(io.RawIOBase):
    """Wraps a backend file: counts the offset and hashes every byte written through it.

    torch's serializer hands each item over in dozens of small records; writes under
    ``DIRECT_READ_MIN`` are gathered into writes of about ``COALESCE_BYTES`` (one system call
    instead of one per record). Larger ones (a tensor's storage) go straight through. Call :meth:`flush` before closing
    the backend file.

    ``raw`` is the caller's: only :meth:`flush` writes to it. :meth:`close` (which
    ``IOBase.__del__`` calls) drops what is gathered instead: a writer left behind by a failed
    write (its exception's traceback holds it in a reference cycle) is finalized by the garbage
    collector at any later time, in any thread, long after the caller closed ``raw``, and a
    flush from there would hand the bytes to a closed file whose descriptor number another file
    (the next save's data file) holds by then."""

    def __init__(self, raw: IO[bytes], hasher: Hasher | None = None, block_bytes: int = 0,
                 new_hasher: Callable[[], Hasher] | None = None):
        super().__init__()
        self.raw = raw
        #: the store's hasher for files it writes (keyed when it signs: Keyring.new_hasher)
        self.hasher = hasher if hasher is not None else Hasher()
        self.offset = 0
        #: (offset, length) of every write of at least DIRECT_READ_MIN bytes
        self.large_writes: list[tuple[int, int]] = []
        self._pending = bytearray()
        #: with ``block_bytes``: the digest of every finished block (``new_hasher()`` each)
        self.block_bytes = block_bytes
        self._blocks: list[str] = []
        self._new_hasher = new_hasher or Hasher
        self._block = self._new_hasher() if block_bytes else None
        #: where each item starts (:meth:`start_item`)
        self.cuts: list[int] = []
        #: a page size, or 0: items of at least ALIGN_ITEMS_FROM bytes start on a page of the
        #: file (:meth:`align_item`), where a tier that cuts the file into chunks cuts it
        self.align_items = 0

    def writable(self) -> bool:
        return True

    def start_item(self) -> None:
        """An item begins at the current offset: noted in :attr:`cuts`, and told to a backend
        file that cuts its bytes into chunks there (a deduplicated tier's), after what is
        gathered so far."""
        if not self.cuts or self.cuts[-1] != self.offset:
            self.cuts.append(self.offset)
        hook = getattr(self.raw, "start_item", None)
        if hook is not None:
            self.flush()
            hook()

    def align_item(self, nbytes: int) -> None:
        """An item of ``nbytes`` starts next: with :attr:`align_items`, one of at least
        :data:`ALIGN_ITEMS_FROM` bytes starts on a page, zeros before it (no item's bytes: DCP
        reads each item at its own offset). A deduplicated tier cuts the file's chunks where
        items start, and a chunk that starts on a page can be loaded through its own file's
        pages (tierstore.tiers.chunk_map)."""
        if self.align_items and nbytes >= ALIGN_ITEMS_FROM:
            gap = -self.offset % self.align_items
            if gap:
                self.write(bytes(gap))

    def blocks(self) -> list[str] | None:
        """The digests of the file's blocks as written so far (the last one may be short);
        None without ``block_bytes``."""
        if self._block is None:
            return None
        tail = [self._block.hexdigest()] if self.offset % self.block_bytes else []
        return self._blocks + tail

    def _hash(self, view: memoryview) -> None:
        """Hash ``view`` into the file's digest and, with blocks, its blocks' digests: block
        by block, so the second pass over each block reads it from the cache, not memory."""
        if self._block is None:
            self.hasher.update(view)
            return
        pos = self.offset
        while view:
            take = view[:self.block_bytes - pos % self.block_bytes]
            self.hasher.update(take)
            self._block.update(take)
            pos += len(take)
            view = view[len(take):]
            if pos % self.block_bytes == 0:
                self._blocks.append(self._block.hexdigest())
                self._block = self._new_hasher()

    def write(self, data) -> int:
        if self.closed:  # (a finalizer's late write: see the class docstring)
            raise ValueError("write to a closed HashingWriter")
        view = memoryview(data).cast("B")
        n = len(view)
        self._hash(view)
        if n < DIRECT_READ_MIN:  # larger ones may be read in place later (raw spans)
            self._pending += view
            if len(self._pending) >= COALESCE_BYTES:
                self.flush()
        else:
            self.flush()
            write_all(self.raw, view)
            self.large_writes.append((self.offset, n))
        self.offset += n
        return n

    def tell(self) -> int:
        return self.offset

    def close(self) -> None:
        """Drop what is gathered and not flushed, write nothing: the file it was for failed
        or is closed (see the class docstring)."""
        self._pending = bytearray()
        super().close()  # (IOBase.close calls flush, which finds nothing to write)

    def flush(self) -> None:
        """Write what is gathered to the backend file."""
        if self._pending:
            # A new buffer each time: the backend file may keep what it was given.
            chunk, self._pending = self._pending, bytearray()
            write_all(self.raw, chunk)


def item_size(item: WriteItem) -> int:
    """Bytes of a tensor item (0 for BYTE_IO, whose size is unknown until resolved)."""
    if item.tensor_data is None:
        return 0
    numel = 1
    for s in item.tensor_data.size:
        numel *= s
    return numel * torch._utils._element_size(item.tensor_data.properties.dtype)


#: bytes a tensor's record holds beside its data (torch.save's archive around it), about
RECORD_OVERHEAD = 1536


def _record_bytes(item: WriteItem) -> int:
    """About how many bytes ``item`` takes in its file (what a writing thread has to move)."""
    return item_size(item) + RECORD_OVERHEAD


def split_items(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Spread items over at most ``bins`` files (one writing thread each) by bytes.

    Small items (tensors under ``DIRECT_READ_MIN``, and BYTE_IO) cost CPU per item, not per
    byte: spread over threads they only fight over the GIL. They go together into as few files
    as their bytes need (one per ``SMALL_ITEMS_PER_FILE_BYTES``), in the state dict's order;
    large tensors then fill the lightest files, largest first. Empty files are dropped."""
    small = [i for i in items if item_size(i) < DIRECT_READ_MIN]
    large = sorted((i for i in items if item_size(i) >= DIRECT_READ_MIN), key=item_size,
                   reverse=True)
    small_bytes = sum(_record_bytes(i) for i in small)
    small_bins = min(bins, max(1, math.ceil(small_bytes / SMALL_ITEMS_PER_FILE_BYTES)))
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    if small:
        per_bin = math.ceil(len(small) / small_bins)
        for k in range(small_bins):
            buckets[k] = small[k * per_bin:(k + 1) * per_bin]
            sizes[k] = sum(_record_bytes(i) for i in buckets[k])
    for item in large:
        k = sizes.index(min(sizes))
        buckets[k].append(item)
        sizes[k] += _record_bytes(item)
    return [b for b in buckets if b]


class NoCloseWriter(io.RawIOBase):
    """Hands writes through and ignores close(), so closing a codec's stream (to flush its
    frame) leaves the data file open, as DCP's own writer does. What a codec's
    ``transform_to`` writes into."""

    def __init__(self, raw: IO[bytes]):
        super().__init__()
        self._raw = raw

    def writable(self) -> bool:
        """Always writable."""
        return True

    def write(self, data) -> int:
        """Write ``data`` to the wrapped stream."""
        return self._raw.write(data)

    def close(self) -> None:
        """Leave the wrapped stream open."""


def encode_to(out: IO[bytes], extensions: list) -> tuple[IO[bytes], list[str] | None]:
    """A stream that applies ``extensions`` (DCP stream transforms, first one outermost as in
    DCP) on the way to ``out``, and the descriptors to record; ``(out, None)`` without any."""
    if not extensions:
        return out, None
    stream: IO[bytes] = NoCloseWriter(out)
    for ext in reversed(extensions):
        stream = ext.transform_to(stream)
    return stream, [ext.get_descriptor() for ext in extensions]


def write_items(out: HashingWriter, items: list[WriteItem], planner: SavePlanner,
                relative_path: str, extensions: list = (),
                written_before: Callable[[WriteItem, IO[bytes]], tuple[int, int] | None | bool]
                | None = None) -> list[WriteResult]:
    """Write ``items`` into ``out`` as stock DCP does (through the codecs' stream transforms
    when there are any); resolve each one lazily (it may copy).

    ``written_before(item, stream)``, when given, writes the record of an item whose record was
    made before (a budgeted staging's spill) into ``stream`` and returns where the tensor's raw
    bytes are from the record's start (or None when unknown); it returns False for an item it
    does not hold, which is then resolved through the planner."""
    results = []
    alignment = storage_alignment()
    for item in items:
        out.align_item(item_size(item))
        out.start_item()
        offset = out.offset
        stream, descriptors = encode_to(out, list(extensions))
        span = None
        copied = False if written_before is None else written_before(item, stream)
        if copied is not False:
            if copied is not None and descriptors is None:
                span = (offset + copied[0], copied[1])
        elif item.type == WriteItemType.BYTE_IO:
            stream.write(planner.resolve_data(item).getbuffer())
        else:
            data = planner.resolve_data(item)
            if data.device.type == "meta":
                raise ValueError(
                    f"item {item.index.fqn} of the staged state dict has no data (a meta "
                    f"tensor): a budgeted staging spilled it under a name the save planner "
                    f"does not use; use DCP's default save planner (it flattens the state dict) "
                    f"or remove [store.staging] max_staging_bytes")
            span = write_tensor_record(host_tensor(data), stream, out, alignment)
            if descriptors is not None:
                span = None  # the bytes on the tier are encoded
        if stream is not out:
            stream.close()
        length = out.offset - offset
        info = _StorageInfo(relative_path, offset, length, transform_descriptors=descriptors)
        results.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=ItemLocation(info, raw_span=span)))
    out.flush()
    return results


def write_tensor_record(tensor: torch.Tensor, stream: IO[bytes], out: HashingWriter, alignment: int
                  ) -> tuple[int, int] | None:
    """Write ``tensor``'s record into ``stream`` (``out`` itself, or a codec's stream into it);
    returns where its raw bytes lie in ``out`` (meaningful only when ``stream is out``)."""
    if tensor.nbytes < TEMPLATE_MAX_BYTES:
        template = template_for(tensor, alignment)
        if template is not None:
            start = out.offset + len(template.prefix)
            if tensor.nbytes < _JOIN_BELOW:
                # One write of a joined copy: cheaper than three writes for a small record.
                stream.write(b"".join((template.prefix, tensor_bytes(tensor), template.suffix)))
            else:
                stream.write(template.prefix)
                stream.write(tensor_bytes(tensor))
                stream.write(template.suffix)
            return start, tensor.nbytes
    out.large_writes.clear()
    save_tensor(tensor, stream)
    # torch.save writes a storage's bytes in one call; find it to read it in place.
    found = [w for w in out.large_writes if w[1] == tensor.nbytes]
    return found[0] if len(found) == 1 else None


# -- reading ----------------------------------------------------------------------------------

def _chunk_sizes(metadata: Metadata, req: ReadItem) -> torch.Size | None:
    md = metadata.state_dict_metadata.get(req.storage_index.fqn)
    if not isinstance(md, TensorStorageMetadata):
        return None
    for chunk in md.chunks:
        if tuple(chunk.offsets) == tuple(req.storage_index.offset or ()):
            return chunk.sizes
    return None


@dataclass(slots=True)
class _Part:
    """One stored item of a file as a load needs it. (Kept small: a load of thousands of
    items allocates one per item, and every allocation brings Python's cyclic collector,
    which walks the whole heap of DCP's plans, nearer.)"""

    start: int
    end: int
    #: gets the item's bytes once the file is known good (decoded by torch.load); None when the
    #: item's raw bytes go straight into ``target``
    sink: "_Decoder | None" = None
    #: the destination tensor (contiguous, on the CPU) of the raw bytes at ``data_start``
    target: torch.Tensor | None = None
    data_start: int = 0
    #: the request ``target`` answers (committed to the planner once the file is known good)
    req: ReadItem | None = None
    #: large enough to be read straight into ``target``, not through a window
    in_place: bool = False
    #: ``target`` is a buffer of this load's own, not the destination: the planner's tensor
    #: (on another device, of another dtype or layout) gets its bytes when it is committed
    staged: bool = False
    #: what owns the memory a staged ``target`` views, or ``at`` points into (kept until the
    #: part is committed)
    source: object = None
    #: the address of the item's bytes in memory already checked (a mapped copy's pages, what
    #: peers sent), which ``target`` (the destination) takes when the part is committed; 0 once
    #: they are in ``target``
    at: int = 0


class FileReadError(Exception):
    """A file's bytes differ from its manifest entry (short, long or checksum mismatch)."""


#: bytes read at once for small items; their bytes are copied from the window
_WINDOW = 8 << 20
#: without verification, unneeded bytes between two items are skipped by a seek past this gap
_SEEK_GAP = 256 << 10


class LoadUndo:
    """What one load changed in the state dict so far, to put it back if the load fails, and
    what it holds back until the whole load is known good.

    Two ways to the same rule (a failed load leaves every destination bitwise as it was,
    whichever mix of tiers served its files):

    - A file read from bytes already checked and in memory (a local copy's mapped pages, what
      peers sent, the checked blocks of an object store's copy: a :class:`BufferReader`) writes
      no destination while the load runs. Each tensor keeps where its checked bytes are, and
      :meth:`apply` copies them in. That copy is the one the read would make anyway, only
      later: nothing to keep, no old bytes to save, and a later file's failure has nothing of
      this one to undo. (The memory stays until then: a mapping, what peers sent, the blocks
      read of a copy read in part, each as large as the old bytes it saves keeping.)
    - A file read as a stream, unchecked until its end (an object store's copy), lands large
      tensors straight in their destinations (and small ones from read windows) before its
      checksum is known. Holding its bytes back would cost a buffer and a copy of every
      byte; saving the destinations' old bytes costs the same buffer and copy, and only
      for the tensors such files fill. So their old bytes are copied here first, once per
      load (a fallback to another tier's copy overwrites the same tensors again and must not
      save the bad copy's bytes as "old"), and :meth:`restore` writes them back.

    Everything else a load does to the state dict (values decoded by ``torch.load``, non-tensor
    values, ``commit_tensor``) is held back until :meth:`apply`, which the reader calls once
    every file of the load is known good, on every rank of a distributed load (the ranks agree
    on that first: one whose files were good still calls :meth:`restore` when another rank's
    were not). Shared by the reading threads of one load."""

    __slots__ = ("_lock", "_saved", "_backups", "_later", "_sources")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._saved: set[int] = set()  # data_ptr of every destination saved
        #: (one buffer, [(destination address, offset in the buffer, bytes)])
        self._backups: list[tuple[torch.Tensor, list[tuple[int, int, int]]]] = []
        self._later: list[tuple[list, list, LoadPlanner]] = []
        #: checked copies whose pages the held-back tensors view (closed once those landed)
        self._sources: list[MappedCopy] = []

    def save(self, targets: list[torch.Tensor]) -> None:
        """Keep the bytes ``targets`` hold now (those not kept already by this load), in one
        buffer: one allocation per read window, not per tensor (see _Part)."""
        with self._lock:
            todo = [t for t in targets if t.nbytes and t.data_ptr() not in self._saved]
            self._saved.update(t.data_ptr() for t in todo)
        if not todo:
            return
        buf = torch.empty(sum(t.nbytes for t in todo), dtype=torch.uint8)
        base, places, offset = buf.data_ptr(), [], 0
        for t in todo:
            ctypes.memmove(base + offset, t.data_ptr(), t.nbytes)
            places.append((t.data_ptr(), offset, t.nbytes))
            offset += t.nbytes
        with self._lock:
            self._backups.append((buf, places))

    def later(self, decoded: list, filled: list, planner: LoadPlanner) -> None:
        """Hold back what a good file hands the planner until the whole load is good."""
        with self._lock:
            self._later.append((decoded, filled, planner))

    def close_after(self, copy: MappedCopy) -> None:
        """Keep ``copy`` (its pages mapped, its directory held against eviction) until what
        was read from it has landed: its tensors' bytes are copied from its pages into their
        destinations by :meth:`apply`, once every file of the load is good."""
        with self._lock:
            self._sources.append(copy)

    def _close_sources(self) -> None:
        while self._sources:
            self._sources.pop().close()

    def apply(self, each: Callable[[Callable, list], object] | None = None) -> None:
        """Hand the planner what every file brought: the bytes held back copied into their
        destinations (file by file through ``each(fn, items)``, a map over the load's reading
        threads, when given: the copies the reads would have made), tensors decoded by
        ``torch.load`` and ``commit_tensor`` next, the non-tensor values (which cannot be put
        back) last, after every step that can fail on a bad item. Restores the state dict if
        a step fails (bytes copied in from checked memory have no old bytes kept: only a copy
        to a device can fail there)."""
        try:
            held = [(planner, filled) for _, filled, planner in self._later
                    if any(p.at or p.staged for p in filled)]
            if each is None:
                for planner, filled in held:
                    _land(planner, filled)
            else:
                each(lambda job: _land(*job), held)
            for decoded, filled, planner in self._later:
                for sink, data in decoded:
                    if not sink.byte_io:
                        sink(data)
                for p in filled:
                    _commit(planner, p)
            for decoded, _, _ in self._later:
                for sink, data in decoded:
                    if sink.byte_io:
                        sink(data)
        except BaseException:
            self.restore()
            raise
        self._later.clear()
        self._backups.clear()
        self._close_sources()

    def restore(self) -> None:
        """Write back every destination's old bytes and drop what was held back."""
        self._later.clear()
        for buf, places in self._backups:
            base = buf.data_ptr()
            for address, offset, n in places:
                ctypes.memmove(address, base + offset, n)
        self._backups.clear()
        self._saved.clear()
        self._close_sources()


def read_items(f: IO[bytes], entry: FileEntry, reqs: list[ReadItem], storage_data: dict,
               metadata: Metadata, planner: LoadPlanner, verify: Hasher | None, *,
               trusted: tuple[str, ...] = (), undo: LoadUndo | None = None) -> int:
    """Read the items ``reqs`` of one data file ``f``, hand them to ``planner`` and, when
    ``verify`` (a fresh hasher made for ``entry``'s digest, keyed or not), check the whole file
    against ``entry``. Returns bytes read. Raises
    FileReadError when the file does not match (the caller may try another tier).

    Plain tensors whose raw bytes the manifest locates (its spans) land in their destination
    without ``torch.load``: large ones are read straight into it, small ones are copied from a
    window of many items read at once. Other items (codecs, BYTE_IO, partial reads, other
    dtypes or devices) are decoded from their bytes. Nothing is committed to the planner before
    the whole file is known good, nor before every non-tensor value needed from it passed
    :func:`tierstore.format.values.check_value` (with ``trusted``: ``[store] trusted_pickles``);
    a refused one raises its ``UntrustedValue`` (an IntegrityError) with no value loaded.

    A file in memory already (a :class:`BufferReader`: checked bytes) writes no destination
    here: each tensor keeps where its bytes are, and they are copied in when it is committed.
    Other files are read into their destinations; with ``undo`` (one per load, shared by its
    files), the old bytes of those are kept before anything lands in them. With ``undo``,
    nothing is committed until ``undo.apply()``: the caller calls it once every file of the
    load is good, or ``undo.restore()`` on failure (see :class:`LoadUndo`). Without ``undo``,
    a streamed file that fails its checksum leaves the tensors it was read into changed."""
    parts = _plan_parts(entry, reqs, storage_data, metadata, planner, trusted)
    reading = _FileReading(f, entry, verify)
    # Bytes in memory are not copied now but when committed: a copy made now would reach the
    # state dict before the rest of the load is known good, with nothing to put back.
    in_memory = isinstance(f, BufferReader)
    pending: list[tuple[_Decoder, memoryview]] = []
    filled: list[_Part] = []
    for start, end, group in _reads(parts, verify is not None):
        if group is None:  # one large tensor's bytes, straight into its destination
            part = parts[start]
            if in_memory:
                _defer(part, f)
                filled.append(part)
                continue
            reading.skip_to(part.data_start)
            if undo is not None and not part.staged:  # (a staged target is the load's own)
                undo.save([part.target])
            reading.read_into(tensor_bytes(part.target))
            filled.append(part)
            continue
        keeps_bytes = any(p.sink is not None for p in group)
        if in_memory:
            for p in group:
                if p.sink is None:
                    _defer(p, f)
                    filled.append(p)
            if not keeps_bytes:
                continue
            group = [p for p in group if p.sink is not None]
        reading.skip_to(start)
        window, address = reading.read_window(end - start, fresh=keeps_bytes)
        base = address - start
        if undo is not None and not in_memory:  # (a staged target is a buffer of the load's own)
            undo.save([p.target for p in group if p.sink is None and not p.staged])
        for p in group:
            if p.sink is not None:
                pending.append((p.sink, window[p.start - start:p.end - start]))
            else:
                ctypes.memmove(p.target.data_ptr(), base + p.data_start, p.target.nbytes)
                filled.append(p)
    reading.finish()
    # Hand data to the planner only once the whole file is known good, and its non-tensor
    # values too: the planner unpickles them with weights_only=False.
    checked = [(sink, sink.check(data)) for sink, data in pending]
    if undo is not None:
        undo.later(checked, filled, planner)
        return reading.pos
    for sink, data in checked:
        sink(data)
    for p in filled:
        _commit(planner, p)
    return reading.pos


def _defer(part: _Part, f: BufferReader) -> None:
    """Point ``part`` at its bytes in ``f`` (checked, in memory), to be copied into its
    destination when it is committed (:func:`_land`); ``f`` is kept with it until then."""
    if part.staged:  # the planner's tensor copies from a view of them (no buffer between)
        part.target = f.tensor_at(part.data_start, part.target)
    else:
        part.at = f.address_of(part.data_start, part.target.nbytes)
    part.source = f


def _land(planner: LoadPlanner, filled: list[_Part]) -> None:
    """Copy into their destinations the bytes of ``filled`` that are not there yet: a staged
    part's (its buffer, or its view of checked bytes) into the planner's tensor, a deferred
    one's from the checked bytes in memory. Each part then holds its destination."""
    for part in filled:
        if part.staged:
            destination = planner.resolve_tensor(part.req).detach()
            destination.copy_(part.target)
            part.target, part.staged = destination, False
        elif part.at:
            # (ctypes.memmove lets go of the GIL: files land in parallel, see LoadUndo.apply)
            ctypes.memmove(part.target.data_ptr(), part.at, part.target.nbytes)
            part.at = 0
        part.source = None  # the load's buffer, or the checked memory it was copied from


def _commit(planner: LoadPlanner, part: _Part) -> None:
    """Hand the planner ``part``'s tensor, once its file (with ``undo``: the whole load) is
    known good, its bytes copied into the planner's tensor first when they are not there."""
    _land(planner, [part])
    planner.commit_tensor(part.req, part.target)


def _reads(parts: list[_Part], verify: bool):
    """The reads that bring ``parts`` (in file order) in: ``(index, None, None)`` for a
    large tensor read straight into its destination, ``(start, end, group)`` for a window of
    bytes ``[start, end)`` holding the items of ``group`` (small ones, up to ``_WINDOW`` bytes
    in all; without verification, items more than ``_SEEK_GAP`` apart are not joined)."""
    i = 0
    while i < len(parts):
        part = parts[i]
        if part.in_place:
            yield i, None, None
            i += 1
            continue
        j, end = i + 1, part.end
        while (j < len(parts) and not parts[j].in_place and parts[j].end - part.start <= _WINDOW
               and (verify or parts[j].start - end <= _SEEK_GAP)):
            end = max(end, parts[j].end)
            j += 1
        yield part.start, end, parts[i:j]
        i = j


def needed_ranges(entry: FileEntry, reqs: list[ReadItem], storage_data: dict,
                  metadata: Metadata) -> list[tuple[int, int]]:
    """The byte ranges ``[start, end)`` of the file that :func:`read_items` reads for
    ``reqs`` without verification (a file fetched or checked in part is read so: every range
    it needs was checked). They follow from the plan and the metadata alone, never from the
    destination tensors, so that a load can know them (and check or fetch them) before
    DCP hands it its planner. Raises FileReadError when the metadata does not describe the
    file."""
    layout = _layout(entry, reqs, storage_data, metadata)
    parts = [_Part(start, end, data_start=run[0] if run else 0,
                   in_place=run is not None and run[1] >= DIRECT_READ_MIN)
             for start, end, _, _, run in layout]
    ranges = []
    for start, end, group in _reads(parts, False):
        if group is None:  # a large raw run, read alone
            offset, nbytes = layout[start][4]
            ranges.append((offset, offset + nbytes))
        else:
            ranges.append((start, end))
    return ranges


def _layout(entry: FileEntry, reqs: list[ReadItem], storage_data: dict, metadata: Metadata
            ) -> list[tuple[int, int, list[ReadItem], _StorageInfo, tuple[int, int] | None]]:
    """The stored items ``reqs`` need, in file order: ``(start, end, requests, storage info,
    run)``, where ``run`` is ``(file offset, bytes)`` of the raw bytes the one request reads
    (a whole chunk, or one contiguous run of it: rows of a chunk saved at another world size)
    when the manifest locates the item's raw bytes (its spans), else None (the item is
    decoded whole)."""
    spans = {span[0]: span for span in entry.spans or ()}  # item offset -> the manifest's triple
    by_offset: dict[int, ReadItem | list[ReadItem]] = {}
    for req in reqs:
        offset = storage_data[req.storage_index].offset
        held = by_offset.setdefault(offset, req)
        if held is not req:  # several requests read one stored item (resharding)
            by_offset[offset] = [*held, req] if isinstance(held, list) else [held, req]
    out = []
    last_end = None
    for offset in sorted(by_offset):
        held = by_offset[offset]
        group = held if isinstance(held, list) else [held]
        info: _StorageInfo = storage_data[group[0].storage_index]
        if info.offset + info.length > entry.size:
            raise FileReadError(f"item {group[0].storage_index.fqn} ends at byte "
                                f"{info.offset + info.length}, past the file's {entry.size} bytes")
        if last_end is not None and info.offset < last_end:
            # The file is read front to back once: an item inside the one before would get the
            # bytes after it. DCP never writes items that overlap.
            raise FileReadError(f"item {group[0].storage_index.fqn} starts at byte {info.offset}, "
                                f"inside the item before it (which ends at byte "
                                f"{last_end}); the metadata does not describe this file")
        last_end = info.offset + info.length
        span = spans.get(info.offset)
        run = (_raw_run(span[1:], info, group[0], metadata)
               if len(group) == 1 and span else None)
        out.append((info.offset, last_end, group, info, run))
    return out


def _plan_parts(entry: FileEntry, reqs: list[ReadItem], storage_data: dict, metadata: Metadata,
                planner: LoadPlanner, trusted: tuple[str, ...] = ()) -> list[_Part]:
    """The stored items ``reqs`` need, in file order, each with where its bytes go: a raw run
    straight into the planner's tensor when it can take them (a contiguous CPU tensor of the
    stored dtype), else into a buffer of this load's own, copied into the planner's tensor
    when committed (so that a load reads the same bytes whatever the destination is: see
    :func:`needed_ranges`); other items through ``torch.load``."""
    # (No container per item beyond what is needed: see _Part.)
    parts = []
    for start, end, group, info, run in _layout(entry, reqs, storage_data, metadata):
        if run is None:
            parts.append(_Part(start, end,
                               sink=_Decoder(group, planner, info.transform_descriptors,
                                             trusted)))
            continue
        req = group[0]
        dtype = metadata.state_dict_metadata[req.storage_index.fqn].properties.dtype
        target = planner.resolve_tensor(req).detach()
        if tuple(target.shape) != tuple(req.lengths):
            raise AssertionError(f"item {req.storage_index} has size {tuple(req.lengths)}, "
                                 f"expected {tuple(target.shape)}")
        staged = (target.device.type != "cpu" or not target.is_contiguous()
                  or target.dtype != dtype)
        if staged:
            target = torch.empty(tuple(req.lengths), dtype=dtype)
        parts.append(_Part(start, end, target=target, data_start=run[0], req=req,
                           in_place=run[1] >= DIRECT_READ_MIN, staged=staged))
    return parts


class MappedCopy:
    """A local copy's bytes, checked against its manifest entry (all of it, or the blocks
    ``held``): a load takes what it needs from these very bytes, with no second pass over the
    file.

    The bytes are the file's pages, mapped read-only, when nobody but this user can change the
    file (no copy, no memory of its own), and else a copy in this process's own memory: a
    mapping shows whatever is written to the file later, and the bytes land in the state dict
    only once every rank's plan and reads are done (DCP's plan exchange, the ranks'
    agreement), so another writer of the tier who changed the file in that window would get
    its bytes loaded under the digest of the checked ones. A mapping keeps the file it was
    made of (its inode) even when the file is replaced or deleted, and ``hold`` (the reader's
    shared lock on the checkpoint's directory) keeps the checkpoint from eviction, whose
    recycling would write over those pages, until the load ends. :meth:`close` when done."""

    def __init__(self, f: IO[bytes], data, held: list[tuple[int, int]] | None,
                 pages: mmap.mmap | None = None) -> None:
        self._f, self._data, self._pages = f, data, pages
        #: the byte ranges checked (None: the whole file)
        self.held = held
        #: released with the bytes (the reader's shared lock on the checkpoint's directory)
        self.hold = None

    @property
    def data(self):
        """The file's bytes (only those of ``held`` may be read)."""
        return self._data

    @property
    def nbytes(self) -> int:
        """Bytes checked (and readable)."""
        return len(self.data) if self.held is None else runs_bytes(self.held)

    def close(self) -> None:
        """Drop the bytes (unmap the pages) and close the file (a view still held keeps them
        until it is released)."""
        self._data = memoryview(b"")
        try:
            if self._pages is not None:
                self._pages.close()
        except BufferError:
            pass  # unmapped when the last view goes
        finally:
            self._f.close()
            if self.hold is not None:
                self.hold.release()
                self.hold = None


def only_this_user_writes(st: os.stat_result) -> bool:
    """Whether nobody but this process's user (and root) can change a file of status ``st``:
    it is this user's and neither its group nor others may write it. (The directories above
    it are checked when the tier's root is opened and made: nobody else can replace it.)"""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def map_checked(f: IO[bytes], entry: FileEntry, keyring,
                runs: list[tuple[int, int]] | None = None) -> tuple[MappedCopy | None, str | None]:
    """Check a local file against ``entry`` before a load reads it into the state dict: the
    whole file, or with ``runs`` (whole blocks of an entry that lists them) only those blocks,
    each against its own digest. ``keyring`` (a tier's ``Keyring``) checks keyed digests.

    When only this user can write the file, it is checked through its pages mapped (no copy,
    no memory of its own: a copy of the old tensors would cost a fresh page for every byte of
    them). Otherwise it is read into private memory, piece by piece, each piece hashed as it
    arrives (while it is in the CPU's cache), so that the bytes checked are the bytes the load
    later copies out, whatever another writer does to the file meanwhile.

    Returns ``(copy, "")`` when it matches: the load reads from ``copy``, which then owns
    ``f``; ``(None, why)`` when not; ``(None, None)`` when ``f`` is not a regular file (a
    stream: read it once, checking it on the way and keeping the old bytes)."""
    if getattr(f, "read_whole_first", False):
        # A file put together from pieces (a deduplicated tier's chunks): its pieces mapped
        # side by side where they are local files, else read into this process's memory;
        # checked whole, then read from there, as a mapped file is.
        mapped = getattr(f, "mapped", None)
        pages = mapped() if mapped is not None else None
        if pages is not None:
            if len(pages) != entry.size:
                pages.close()
                return None, f"file is {len(pages)} bytes, its manifest says {entry.size}"
            return _checked_pages(f, pages, entry, keyring, runs)
        if entry.size <= BUFFERED_CHECK_MAX:
            return _checked_in_memory(f, entry, keyring, runs)
    try:
        fd = f.fileno()
        st = os.fstat(fd)
    except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
        return None, None
    if not stat.S_ISREG(st.st_mode):
        return None, None
    if st.st_size != entry.size:
        return None, f"file is {st.st_size} bytes, its manifest says {entry.size}"
    if only_this_user_writes(st) and entry.size:
        return _map_checked_pages(f, fd, entry, keyring, runs)
    return _checked_in_memory(f, entry, keyring, runs)


def _checked_in_memory(f: IO[bytes], entry: FileEntry, keyring,
                       runs: list[tuple[int, int]] | None
                       ) -> tuple[MappedCopy | None, str | None]:
    """:func:`map_checked` through this process's memory: the file (or ``runs`` of it) read
    into a buffer piece by piece, each piece hashed as it arrives."""
    try:
        if runs is not None:
            data = read_runs(f, runs, entry.size)
            why = check_blocks(keyring, entry, data, runs)
        else:
            data, why = _read_hashed(f, entry, keyring)
    except FileReadError as exc:  # the file shrank since its size was read
        return None, str(exc)
    if why:
        return None, why
    return MappedCopy(f, data, runs), ""


def _map_checked_pages(f: IO[bytes], fd: int, entry: FileEntry, keyring,
                       runs: list[tuple[int, int]] | None
                       ) -> tuple[MappedCopy | None, str | None]:
    """:func:`map_checked` through the file's pages, mapped read-only."""
    return _checked_pages(f, mmap.mmap(fd, 0, access=mmap.ACCESS_READ), entry, keyring, runs)


def _checked_pages(f: IO[bytes], pages: mmap.mmap, entry: FileEntry, keyring,
                   runs: list[tuple[int, int]] | None
                   ) -> tuple[MappedCopy | None, str | None]:
    """:func:`map_checked` through ``pages``, a mapping of the whole file (closed here unless
    the copy returned owns it)."""
    try:
        if runs is None:
            hasher = keyring.hasher_for(entry.checksum)
            pages.madvise(mmap.MADV_SEQUENTIAL)
            hasher.update(pages)
            actual = hasher.hexdigest()
            why = ("" if same_digest(actual, entry.checksum) else
                   f"checksum mismatch: manifest says {entry.checksum}, the bytes give {actual}")
        else:
            view = memoryview(pages)
            try:  # (slices of the view, not of the mapping: those would be copies)
                why = check_blocks(keyring, entry, view, runs)
            finally:
                view.release()
    except BaseException:
        pages.close()
        raise
    if why:
        pages.close()
        return None, why
    return MappedCopy(f, pages, runs, pages), ""


#: bytes read and hashed at a time by :func:`_read_hashed`: small enough to be hashed while
#: still in the CPU's cache, large enough that the reads cost no more than one of the file
_CHECK_PIECE = 4 << 20


def _read_hashed(f: IO[bytes], entry: FileEntry, keyring) -> tuple[memoryview, str]:
    """All ``entry.size`` bytes of ``f`` in a buffer of this process, hashed piece by piece
    as read; and what differs from ``entry`` ("" when nothing)."""
    buf = torch.empty(entry.size, dtype=torch.uint8)
    view = memoryview(buf.numpy()) if entry.size else memoryview(bytearray())
    hasher = keyring.hasher_for(entry.checksum)
    f.seek(0)
    got = 0
    while got < entry.size:
        n = f.readinto(view[got:min(got + _CHECK_PIECE, entry.size)])
        if not n:
            raise FileReadError(f"file is shorter than its manifest says ({entry.size} bytes)")
        hasher.update(view[got:got + n])
        got += n
    actual = hasher.hexdigest()
    why = ("" if same_digest(actual, entry.checksum) else
           f"checksum mismatch: manifest says {entry.checksum}, the bytes give {actual}")
    return view, why


#: a run of blocks read from a reader that fetches ranges concurrently is asked for in pieces
#: of at most this many bytes
_RANGE_PIECE = 8 << 20


def runs_bytes(runs: list[tuple[int, int]]) -> int:
    """Bytes the byte ranges ``runs`` (``[start, end)`` each, not overlapping) hold."""
    return sum(end - start for start, end in runs)


def read_runs(f: IO[bytes], runs: list[tuple[int, int]], size: int) -> memoryview:
    """Bytes ``[start, end)`` of each of ``runs`` of a file of ``size`` bytes, at their
    offsets in a buffer of the file's size whose other pages are never touched. A reader
    with ``read_ranges(starts, ends)`` (an object store's) gets every piece at once, in
    concurrent requests; others are read with ``seek`` and ``readinto``. FileReadError when
    the file is shorter than its manifest says."""
    buf = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buf.numpy()) if size else memoryview(bytearray())
    fetch = getattr(f, "read_ranges", None)
    if fetch is not None:
        starts = [s for start, end in runs for s in range(start, end, _RANGE_PIECE)]
        ends = [min(s + _RANGE_PIECE, end) for start, end in runs
                for s in range(start, end, _RANGE_PIECE)]
        for start, end, data in zip(starts, ends, fetch(starts, ends)):
            if len(data) != end - start:
                raise FileReadError(f"file is shorter than its manifest says ({size} bytes)")
            view[start:end] = data
        return view
    for start, end in runs:
        f.seek(start)
        got = start
        while got < end:
            n = f.readinto(view[got:end])
            if not n:
                raise FileReadError(f"file is shorter than its manifest says ({size} bytes)")
            got += n
    return view


def check_blocks(keyring, entry: FileEntry, data, runs: list[tuple[int, int]] | None) -> str:
    """What does not match ``entry`` in ``data`` (a file's bytes at their offsets): the whole
    file (``runs`` None) or the blocks of ``runs``, each against its own digest; "" when all
    of it matches. ``keyring`` (a store's ``Keyring``) checks keyed digests."""
    if runs is None:
        if len(data) != entry.size or not same_digest(keyring.digest(data, like=entry.checksum),
                                                      entry.checksum):
            return "the file's checksum differs"
        return ""
    size = entry.block_bytes
    for start, end in runs:
        for b in range(start // size, -(-end // size)):
            block = data[b * size:min((b + 1) * size, entry.size)]
            if not same_digest(keyring.digest(block, like=entry.blocks[b]), entry.blocks[b]):
                return f"block {b} (bytes {b * size}-{b * size + len(block)}) differs"
    return ""


class BufferReader(io.RawIOBase):
    """A read-only file over bytes already in memory (a file a peer sent), without the copy
    ``io.BytesIO`` makes of a ``bytearray``. With ``held`` (the ranges ``[start, end)`` that
    arrived, of a file fetched in part), a read of other bytes raises FileReadError: it would
    return bytes that no check has seen."""

    def __init__(self, data, held: list[tuple[int, int]] | None = None) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0
        self._held = held
        self._base: int | None = None  # the address of the bytes (address_of), once asked

    def readable(self) -> bool:
        """Always readable."""
        return True

    def seekable(self) -> bool:
        """Always seekable."""
        return True

    def readinto(self, b) -> int:
        """Copy the next bytes into ``b``; 0 at the end."""
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        if n and self._held is not None and not any(
                start <= self._pos and self._pos + n <= end for start, end in self._held):
            raise FileReadError(f"bytes {self._pos}-{self._pos + n} of the file were not "
                                f"fetched (only {self._held})")
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def address_of(self, offset: int, n: int) -> int:
        """The address of the ``n`` bytes at ``offset``, to be read from only (they may be
        read-only pages); FileReadError when they were not fetched or lie past the end. It
        does not keep them: the caller keeps this reader, and the pages' mapping
        (LoadUndo.close_after), until it has read them."""
        if self._held is not None and not any(start <= offset and offset + n <= end
                                              for start, end in self._held):
            raise FileReadError(f"bytes {offset}-{offset + n} of the file were not "
                                f"fetched (only {self._held})")
        if offset + n > len(self._view):
            raise FileReadError(f"file is shorter than its manifest says (bytes {offset}-"
                                f"{offset + n} of {len(self._view)})")
        if self._base is None:
            # numpy takes the address of read-only memory (ctypes' from_buffer refuses it).
            self._base = (numpy.frombuffer(self._view, dtype=numpy.uint8).ctypes.data
                          if len(self._view) else 0)
        return self._base + offset

    def tensor_at(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """A tensor of ``like``'s dtype and shape over the bytes at ``offset``, without a copy
        (only read from: the bytes may be read-only pages). It does not keep them: the caller
        keeps this reader, and the pages' mapping (LoadUndo.close_after), until it is used."""
        n = like.nbytes
        address = self.address_of(offset, n)
        if n == 0:
            return torch.empty_like(like)
        # (torch.frombuffer over the memory itself would warn that it is read-only)
        raw = torch.frombuffer((ctypes.c_char * n).from_address(address), dtype=torch.uint8)
        return raw.view(like.dtype).view(like.shape)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move to ``offset`` (from the start, the current position or the end)."""
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        """The current position."""
        return self._pos


class _FileReading:
    """Reads one data file front to back, hashing every byte when verifying (then every byte
    must be read, in order), seeking over unneeded ones otherwise."""

    def __init__(self, f: IO[bytes], entry: FileEntry, hasher: Hasher | None):
        self.f, self.entry = f, entry
        self.hasher = hasher
        self.pos = 0
        self._scratch = bytearray(min(_WINDOW, max(entry.size, 1)))

    def _read_exact(self, into: memoryview) -> None:
        got = 0
        while got < len(into):
            n = self.f.readinto(into[got:])
            if not n:
                raise FileReadError(f"file is shorter than its manifest says "
                                    f"({self.entry.size} bytes)")
            got += n
        if self.hasher is not None:
            self.hasher.update(into)
        self.pos += len(into)

    def skip_to(self, target: int) -> None:
        """Move to byte ``target`` (hashing what lies between when verifying)."""
        if self.hasher is None:
            if self.pos != target:
                self.f.seek(target)
                self.pos = target
            return
        while self.pos < target:
            self._read_exact(memoryview(self._scratch)[:min(len(self._scratch),
                                                            target - self.pos)])

    def read_into(self, target: memoryview) -> None:
        """Read the next ``len(target)`` bytes into ``target``."""
        self._read_exact(target)

    def read_window(self, n: int, fresh: bool) -> tuple[memoryview, int]:
        """The next ``n`` bytes and their address; in memory of their own when ``fresh`` (kept
        after the next window is read), else in a reused buffer."""
        buf = bytearray(n) if fresh or n > len(self._scratch) else self._scratch
        view = memoryview(buf)[:n]
        self._read_exact(view)
        return view, ctypes.addressof(ctypes.c_char.from_buffer(buf)) if buf else 0

    def finish(self) -> None:
        """When verifying: read to the end and check the length and checksum."""
        if self.hasher is None:
            return
        self.skip_to(self.entry.size)
        if self.f.readinto(memoryview(self._scratch)[:1]):
            raise FileReadError(f"file is longer than its manifest says ({self.entry.size} bytes)")
        actual = self.hasher.hexdigest()
        if not same_digest(actual, self.entry.checksum):
            raise FileReadError(f"checksum mismatch: manifest says {self.entry.checksum}, "
                                f"the bytes give {actual}")


def _contiguous_slice(sizes, offsets, lengths, element_size: int) -> tuple[int, int] | None:
    """Where the box ``offsets``/``lengths`` of a row-major tensor of ``sizes`` lies in its
    bytes, ``(start, length)``, when those bytes are one run (a whole chunk, a range of rows, a
    range within one row...); None when the box is strided (a column range of a matrix)."""
    dims = len(sizes)
    if len(offsets) != dims or len(lengths) != dims:
        return None
    # From the last dimension back: whole dimensions, then at most one partial one, then
    # dimensions of length 1 keep the box one run.
    d = dims - 1
    while d >= 0 and offsets[d] == 0 and lengths[d] == sizes[d]:
        d -= 1
    if any(lengths[i] != 1 for i in range(d)):
        return None
    stride, strides = 1, [0] * dims
    for i in range(dims - 1, -1, -1):
        strides[i] = stride
        stride *= sizes[i]
    numel = 1
    for n in lengths:
        numel *= n
    start = sum(o * st for o, st in zip(offsets, strides))
    return start * element_size, numel * element_size


def _raw_run(span: tuple[int, int], info: _StorageInfo, req: ReadItem, metadata: Metadata
             ) -> tuple[int, int] | None:
    """``(file offset, bytes)`` of the raw bytes ``req`` reads of its stored item, when they
    are one contiguous run of it (a whole chunk, or rows of a chunk saved at another world
    size) of a plain tensor item whose raw bytes lie at ``span`` (``(offset, bytes)`` in the
    file, from the manifest); else None."""
    if req.type != LoadItemType.TENSOR or info.transform_descriptors:
        return None
    sizes = _chunk_sizes(metadata, req)
    if sizes is None:
        return None
    md = metadata.state_dict_metadata[req.storage_index.fqn]
    element = torch._utils._element_size(md.properties.dtype)
    run = _contiguous_slice(tuple(sizes), tuple(req.storage_offsets), tuple(req.lengths),
                            element)
    whole = element
    for n in sizes:
        whole *= n
    wanted = element
    for n in req.lengths:
        wanted *= n
    if (run is None or span[1] != whole or run[1] != wanted
            or not info.offset <= span[0] <= info.offset + info.length - span[1]):
        return None
    return span[0] + run[0], run[1]


_EXTENSIONS = ExtensionRegistry()


def register_extension(cls: type) -> None:
    """Make a codec's DCP extension class known to the reader (by its descriptor name)."""
    _EXTENSIONS.register(cls)


def decode_item(data, descriptors) -> bytes:
    """An item's bytes with the stream transforms named by ``descriptors`` undone (DCP
    applies the first descriptor outermost)."""
    if not descriptors:
        return data
    stream: IO[bytes] = io.BytesIO(data)
    for ext in _EXTENSIONS.from_descriptor_list(descriptors):
        stream = ext.transform_from(stream)
    return stream.read()


class _Decoder:
    """Hands one stored item to the planner: ``check`` first (a non-tensor value through
    :func:`~tierstore.format.values.check_value`, every one of a file before any is loaded),
    then the call (BYTE_IO to ``load_bytes``, a tensor decoded with ``weights_only=True``)."""

    __slots__ = ("group", "planner", "descriptors", "trusted", "byte_io")

    def __init__(self, group: list[ReadItem], planner: LoadPlanner, descriptors=None,
                 trusted: tuple[str, ...] = ()):
        self.group, self.planner, self.descriptors = group, planner, descriptors
        self.trusted = trusted
        self.byte_io = any(req.type == LoadItemType.BYTE_IO for req in group)

    def check(self, data: memoryview):
        """``data`` as the call takes it: a non-tensor value decoded and checked (raises
        ``UntrustedValue``); a tensor decoded (one per request, sizes checked), so that what
        can fail on a bad item fails before anything of the load reaches the state dict."""
        if not self.byte_io:
            raw = io.BytesIO(decode_item(data, self.descriptors))
            tensors = []
            for req in self.group:
                raw.seek(0)
                tensor = torch.load(raw, map_location="cpu", weights_only=True)
                tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                target = self.planner.resolve_tensor(req)
                if target.size() != tensor.size():
                    raise AssertionError(f"item {req.storage_index} has size "
                                         f"{tuple(tensor.size())}, expected {tuple(target.size())}")
                tensors.append(tensor)
            return tensors
        value = bytes(decode_item(data, self.descriptors))
        check_value(value, self.group[0].storage_index.fqn, self.trusted)
        return value

    def __call__(self, data) -> None:
        """Load what :meth:`check` returned."""
        planner = self.planner
        if not self.byte_io:
            for req, tensor in zip(self.group, data):
                target = planner.resolve_tensor(req).detach()
                target.copy_(tensor)
                planner.commit_tensor(req, target)
            return
        raw = io.BytesIO(data)
        for req in self.group:
            raw.seek(0)
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(raw.getbuffer()))
                continue
            tensor = torch.load(raw, map_location="cpu", weights_only=True)
            tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            target.copy_(tensor)
            planner.commit_tensor(req, target)
