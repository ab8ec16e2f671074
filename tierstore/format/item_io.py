"""How DCP write items are laid out in a data file, and how they are read back.

Items are written exactly as stock DCP's FileSystemWriter writes them (``torch.save`` of each
tensor chunk, raw bytes for BYTE_IO items), so stock ``dcp.load`` reads tierstore checkpoints.
Reading is faster than stock: a whole tensor chunk whose destination is a contiguous CPU tensor of
the same dtype is read straight into that tensor (``readinto``), skipping ``torch.load``'s
buffer and the copy after it. Every byte of a file passes through the checksum on the way.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import IO, Callable

import torch
from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlanner, ReadItem, SavePlanner,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed._shard._utils import narrow_tensor_by_index

from tierstore.format.checksum import Hasher
from tierstore.format.manifest import FileEntry

__all__ = ["NoCloseWriter",
           "ItemLocation", "HashingWriter", "write_items", "split_items", "read_items",
           "FileReadError", "DIRECT_READ_MIN"]

# Tensors smaller than this are decoded with torch.load; reading them in place gains nothing.
DIRECT_READ_MIN = 256 << 10
#: small writes are gathered up to this many bytes before they reach the backend file
COALESCE_BYTES = 1 << 20
_SCRATCH = 8 << 20


@dataclass(frozen=True)
class ItemLocation:
    """What ``write_data`` returns per item: DCP's own storage info plus, on the first item of
    each file, that file's manifest entry (so the coordinator can build the manifest)."""

    info: _StorageInfo
    file: tuple[str, FileEntry] | None = None
    #: where the tensor's raw bytes sit in the file (offset, length), when they were written
    #: uncompressed in one piece; lets a load read them straight into the destination
    raw_span: tuple[int, int] | None = None


class HashingWriter(io.RawIOBase):
    """Wraps a backend file: counts the offset and hashes every byte written through it.

    torch's serializer hands each item over in dozens of small records; writes under
    ``DIRECT_READ_MIN`` are gathered into writes of about ``COALESCE_BYTES`` (one system call
    instead of one per record). Larger ones (a tensor's storage) go straight through. Call :meth:`flush` before closing
    the backend file."""

    def __init__(self, raw: IO[bytes]):
        super().__init__()
        self.raw = raw
        self.hasher = Hasher()
        self.offset = 0
        #: (offset, length) of every write of at least DIRECT_READ_MIN bytes
        self.large_writes: list[tuple[int, int]] = []
        self._pending = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self.hasher.update(view)
        if n < DIRECT_READ_MIN:  # larger ones may be read in place later (raw spans)
            self._pending += view
            if len(self._pending) >= COALESCE_BYTES:
                self.flush()
        else:
            self.flush()
            self.raw.write(view)
            if n >= DIRECT_READ_MIN:
                self.large_writes.append((self.offset, n))
        self.offset += n
        return n

    def tell(self) -> int:
        return self.offset

    def flush(self) -> None:
        """Write what is gathered to the backend file."""
        if self._pending:
            # A new buffer each time: the backend file may keep what it was given.
            chunk, self._pending = self._pending, bytearray()
            self.raw.write(chunk)


def item_size(item: WriteItem) -> int:
    """Bytes of a tensor item (0 for BYTE_IO, whose size is unknown until resolved)."""
    if item.tensor_data is None:
        return 0
    numel = 1
    for s in item.tensor_data.size:
        numel *= s
    return numel * torch._utils._element_size(item.tensor_data.properties.dtype)


def split_items(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Spread items over ``bins`` files of about equal bytes (largest first, into the lightest
    bin); BYTE_IO items round-robin. Empty bins are dropped."""
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensors = sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=item_size,
                     reverse=True)
    for n, item in enumerate(byte_items):
        buckets[n % bins].append(item)
    for item in tensors:
        k = sizes.index(min(sizes))
        buckets[k].append(item)
        sizes[k] += item_size(item)
    return [b for b in buckets if b]


def _host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor holding exactly the bytes of ``tensor``, row-major, in its own storage
    (``torch.save`` writes whole storages; the direct read path assumes row-major)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if (not tensor.is_contiguous() or tensor.storage_offset() != 0
            or tensor.untyped_storage().nbytes() != tensor.nbytes):
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _save_tensor_without_crc(tensor: torch.Tensor, out: IO[bytes]) -> None:
    """``torch.save(tensor, out)`` minus the zip CRC32, which costs more CPU than the rest of a
    save together (0.5 s per GiB here) and is redundant: every byte already goes through the
    file checksum of the manifest, and ``torch.load`` never checks the CRC. The bytes are those
    of ``torch.save`` under ``torch.serialization.set_crc32_options(False)``; that option is
    process-wide, so the writer is built directly instead of flipping it under the user."""
    writer = torch._C.PyTorchFileWriter(out, False, torch.serialization._get_storage_alignment())
    torch.serialization._save(tensor, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()


def _probe_crc_free_save() -> Callable[[torch.Tensor, IO[bytes]], None]:
    """The CRC-free save when this torch supports it (private API, checked once), else torch.save."""
    try:
        probe, buf = torch.arange(5, dtype=torch.float32), io.BytesIO()
        _save_tensor_without_crc(probe, buf)
        buf.seek(0)
        if torch.equal(torch.load(buf, weights_only=True), probe):
            return _save_tensor_without_crc
    except Exception:  # any change in torch's private serialization API
        pass
    return torch.save


_save_tensor = _probe_crc_free_save()


class _HeldFailure(io.RawIOBase):
    """Passes writes to ``raw``; after the first one that fails (a full disk) it swallows the
    rest and keeps the error. torch's zip writer must always reach its end: its destructor
    aborts the whole process (``terminate called ... unexpected pos``) when its file failed
    under it half-way."""

    def __init__(self, raw: IO[bytes]):
        super().__init__()
        self._raw = raw
        self.error: OSError | None = None

    def writable(self) -> bool:
        """Always writable."""
        return True

    def write(self, data) -> int:
        """Write ``data`` through, or count it once a write has failed."""
        if self.error is None:
            try:
                return self._raw.write(data)
            except OSError as exc:
                self.error = exc
        return memoryview(data).nbytes

    def flush(self) -> None:
        """Nothing is buffered here."""


def save_tensor(tensor: torch.Tensor, out: IO[bytes]) -> None:
    """Write ``tensor`` as ``torch.save`` would (CRC-free where torch allows) into ``out``; an
    ``OSError`` of ``out`` is raised once torch's writer has finished, never inside it."""
    guarded = _HeldFailure(out)
    _save_tensor(tensor, guarded)
    if guarded.error is not None:
        raise guarded.error


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
                relative_path: str, extensions: list = ()) -> list[WriteResult]:
    """Write ``items`` into ``out`` as stock DCP does (through the codecs' stream transforms
    when there are any); resolve each one lazily (it may copy)."""
    results = []
    for item in items:
        offset = out.offset
        data = planner.resolve_data(item)
        stream, descriptors = encode_to(out, list(extensions))
        out.large_writes.clear()
        span = None
        if item.type == WriteItemType.BYTE_IO:
            stream.write(data.getbuffer())
        else:
            tensor = _host_tensor(data)
            save_tensor(tensor, stream)
            # torch.save writes a storage's bytes in one call; find it to read it in place.
            found = [w for w in out.large_writes if w[1] == tensor.nbytes]
            if descriptors is None and len(found) == 1:
                span = found[0]
        if stream is not out:
            stream.close()
        length = out.offset - offset
        info = _StorageInfo(relative_path, offset, length, transform_descriptors=descriptors)
        results.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=ItemLocation(info, raw_span=span)))
    out.flush()
    return results


# -- reading ----------------------------------------------------------------------------------

def _tensor_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    import ctypes

    buf = (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())
    return memoryview(buf).cast("B")


def _chunk_sizes(metadata: Metadata, req: ReadItem) -> torch.Size | None:
    md = metadata.state_dict_metadata.get(req.storage_index.fqn)
    if not isinstance(md, TensorStorageMetadata):
        return None
    for chunk in md.chunks:
        if tuple(chunk.offsets) == tuple(req.storage_index.offset or ()):
            return chunk.sizes
    return None


@dataclass
class _Segment:
    start: int
    length: int
    sink: Callable[[memoryview], None] | None  # gets the bytes; None: hash only
    direct: memoryview | None = None           # read straight into this memory


class FileReadError(Exception):
    """A file's bytes differ from its manifest entry (short, long or checksum mismatch)."""


def read_items(f: IO[bytes], entry: FileEntry, reqs: list[ReadItem], storage_data: dict,
               metadata: Metadata, planner: LoadPlanner, verify: bool) -> int:
    """Read the items ``reqs`` of one data file ``f``, hand them to ``planner`` and, when
    ``verify``, check the whole file against ``entry``. Returns bytes read. Raises
    FileReadError when the file does not match (the caller may try another tier)."""
    spans = {start: (data_start, data_len) for start, data_start, data_len in entry.spans or ()}
    by_offset: dict[int, list[ReadItem]] = {}
    for req in reqs:
        by_offset.setdefault(storage_data[req.storage_index].offset, []).append(req)

    segments: list[_Segment] = []
    for offset in sorted(by_offset):
        group = by_offset[offset]
        info: _StorageInfo = storage_data[group[0].storage_index]
        if info.offset + info.length > entry.size:
            raise FileReadError(f"item {group[0].storage_index.fqn} ends at byte "
                                f"{info.offset + info.length}, past the file's {entry.size} bytes")
        span = spans.get(info.offset)
        direct = (_direct_target(span, info, group, metadata, planner)
                  if len(group) == 1 and span else None)
        if direct is not None:
            (data_start, data_len), target = direct
            req = group[0]
            segments.append(_Segment(info.offset, data_start - info.offset, None))
            segments.append(_Segment(data_start, data_len, None, _tensor_view(target)))
            segments.append(_Segment(data_start + data_len,
                                     info.offset + info.length - data_start - data_len, None))
            segments[-2].sink = _committer(planner, req, target)
        else:
            segments.append(_Segment(info.offset, info.length,
                                     _decoder(group, planner, info.transform_descriptors)))

    hasher = Hasher() if verify else None
    pos = 0
    scratch = bytearray(_SCRATCH)
    pending: list[tuple[Callable, memoryview]] = []

    def read_exact(into: memoryview) -> None:
        got = 0
        while got < len(into):
            n = f.readinto(into[got:])
            if not n:
                raise FileReadError(f"file is shorter than its manifest says ({entry.size} bytes)")
            got += n

    def skip_to(target: int) -> None:
        nonlocal pos
        while pos < target:
            n = min(len(scratch), target - pos)
            view = memoryview(scratch)[:n]
            read_exact(view)
            if hasher:
                hasher.update(view)
            pos += n

    if not verify:
        segments = [s for s in segments if s.sink is not None or s.direct is not None]
    for seg in segments:
        if verify:
            skip_to(seg.start)
        elif pos != seg.start:
            f.seek(seg.start)
            pos = seg.start
        if seg.direct is not None:
            read_exact(seg.direct)
            if hasher:
                hasher.update(seg.direct)
            pending.append((seg.sink, seg.direct))
        elif seg.sink is not None:
            buf = bytearray(seg.length)
            view = memoryview(buf)
            read_exact(view)
            if hasher:
                hasher.update(view)
            pending.append((seg.sink, view))
        else:
            skip_to(seg.start + seg.length)
            continue
        pos = seg.start + seg.length
    if verify:
        skip_to(entry.size)
        if f.readinto(memoryview(scratch)[:1]):
            raise FileReadError(f"file is longer than its manifest says ({entry.size} bytes)")
        actual = hasher.hexdigest()
        if actual != entry.checksum:
            raise FileReadError(f"checksum mismatch: manifest says {entry.checksum}, "
                                f"the bytes give {actual}")
    # Hand data to the planner only once the whole file is known good.
    for sink, data in pending:
        sink(data)
    return pos


def _direct_target(span: tuple[int, int], info: _StorageInfo, group: list[ReadItem],
                   metadata: Metadata, planner: LoadPlanner):
    """``(span, destination)`` when the item's raw bytes can be read straight into the tensor
    the planner gives for it: a whole chunk, into a contiguous CPU tensor of the same dtype."""
    req = group[0]
    if req.type != LoadItemType.TENSOR or info.transform_descriptors:
        return None
    sizes = _chunk_sizes(metadata, req)
    if sizes is None or any(req.storage_offsets) or tuple(req.lengths) != tuple(sizes):
        return None
    md = metadata.state_dict_metadata[req.storage_index.fqn]
    target = planner.resolve_tensor(req).detach()
    if (target.device.type != "cpu" or not target.is_contiguous()
            or target.dtype != md.properties.dtype or tuple(target.shape) != tuple(sizes)
            or span[1] != target.nbytes
            or not info.offset <= span[0] <= info.offset + info.length - span[1]):
        return None
    return span, target


def _committer(planner: LoadPlanner, req: ReadItem, target: torch.Tensor):
    def commit(_data: memoryview) -> None:
        planner.commit_tensor(req, target)
    return commit


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


def _decoder(group: list[ReadItem], planner: LoadPlanner, descriptors=None):
    def decode(data: memoryview) -> None:
        raw = io.BytesIO(decode_item(data, descriptors))
        for req in group:
            raw.seek(0)
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(raw.getbuffer()))
                continue
            tensor = torch.load(raw, map_location="cpu", weights_only=True)
            tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise AssertionError(f"item {req.storage_index} has size {tuple(tensor.size())}, "
                                     f"expected {tuple(target.size())}")
            target.copy_(tensor)
            planner.commit_tensor(req, target)
    return decode
